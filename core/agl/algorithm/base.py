"""Algorithm: the training side. It reads rollouts and spans from the store and publishes resources.

An algorithm is bound to a Trainer, which owns the store, the runner pool and the adapter; the algorithm
only decides what to run and what to learn from it (``self.trainer.run_tasks`` does the running).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from agl.store.base import LightningStore
    from agl.trainer import Trainer


class Algorithm(abc.ABC):
    """Subclass and implement ``run``; the Trainer calls ``bind`` before ``run``."""

    trainer: "Trainer"

    def bind(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    @property
    def store(self) -> "LightningStore":
        return self.trainer.store

    @property
    def adapter(self) -> Any:
        return self.trainer.adapter

    @abc.abstractmethod
    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> Any:
        """Train (or evaluate); may run for a long time. Return whatever summary is useful."""


class Baseline(Algorithm):
    """No learning: runs the training tasks then the validation tasks once and returns their rollouts.

    Useful to check the whole pipeline (agent, tracing, rewards) before spending GPU hours.
    """

    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> Any:
        results = {}
        if train_dataset:
            results["train"] = self.trainer.run_tasks(train_dataset, mode="train", description="baseline train")
        if val_dataset:
            results["val"] = self.trainer.run_tasks(val_dataset, mode="val", description="baseline val")
        return results
