"""Algorithm: the training side. It reads rollouts and spans from the store and publishes resources.

An algorithm is bound to a Trainer, which owns the store, the runner pool and the adapter; the algorithm
only decides what to run and what to learn from it (``self.trainer.run_tasks`` does the running).
"""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

from agl.errors import NoTrainableSamples

if TYPE_CHECKING:
    from agl.store.base import LightningStore
    from agl.trainer import Trainer


class Algorithm(abc.ABC):
    """Subclass and implement ``run``; the Trainer calls ``bind`` before ``run``."""

    trainer: Trainer

    def start_ray(self) -> None:
        """Start the Ray cluster this algorithm's own workers need (verl's, with their settings), so that runners
        on Ray (``Trainer(runner_mode="ray")``) join it rather than start one without them. None here."""
        return None

    def bind(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def store(self) -> LightningStore:
        return self.trainer.store

    @property
    def adapter(self) -> Any:
        return self.trainer.adapter

    @abc.abstractmethod
    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> Any:
        """Train (or evaluate); may run for a long time. Return whatever summary is useful."""


logger = logging.getLogger("agl.algorithm")


class EmptySteps:
    """Training steps in a row that had nothing to train on: each is logged and skipped, and ``limit`` in a
    row stop training with :class:`~agl.errors.NoTrainableSamples`. A mistake in the setup (an agent_match
    that selects no call, an agent that records none) would otherwise run to the last step training nothing,
    while a step or two emptied by chance (every rollout of a batch failed) does not end a run."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.in_a_row = 0

    def trained(self) -> None:
        self.in_a_row = 0

    def nothing(self, step: int, why: str) -> None:
        """Step ``step`` had nothing to train on, because ``why``; raises on the ``limit``-th in a row."""
        self.in_a_row += 1
        logger.error("step %d trains nothing and is skipped: %s", step, why)
        if self.in_a_row >= self.limit:
            raise NoTrainableSamples(f"{self.in_a_row} steps in a row had nothing to train on; last: {why}")


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
