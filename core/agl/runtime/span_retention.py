"""Span retention: how a long training run keeps its store from growing without bound.

Spans (prompts, responses, token ids) are nearly all of a store's volume: a 10-turn agent whose context grows
to 4k tokens stores ~360 KB per rollout (measured on SQLite: 14.5 bytes per prompt token), so a VERL step of
512 rollouts adds ~0.2 GB, and a 1,000-step run fills a disk (SQLite) or the memory (the in-memory store:
Agent Lightning's 220 GB out-of-memory crash, its issue #438). Once an update
has learnt from a step's rollouts nothing reads their spans again but a person inspecting them, so
``Trainer(span_retention_steps=N)`` keeps the spans of the last N training steps and deletes older ones.
The rollouts (status, reward, attempts) stay, and so do the spans of validation rollouts.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Deque, List, Optional, Sequence

if TYPE_CHECKING:
    from agl.store.base import LightningStore
    from agl.types import Rollout

logger = logging.getLogger("agl.trainer")

DELETE_BATCH = 1000  # rollouts per delete_spans call: bounded transactions (and HTTP bodies)


def delete_spans_in_batches(store: LightningStore, rollout_ids: Sequence[str]) -> int:
    """``store.delete_spans`` in batches of :data:`DELETE_BATCH` rollouts; returns how many spans it deleted."""
    return sum(store.delete_spans(rollout_ids[i : i + DELETE_BATCH]) for i in range(0, len(rollout_ids), DELETE_BATCH))


class SpanRetention:
    """Deletes the spans of training steps older than the last ``steps`` (None: keeps every span)."""

    def __init__(self, store: LightningStore, steps: Optional[int]) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(
                f"span_retention_steps must be None (keep every span) or a whole number >= 0 of training steps "
                f"whose spans are kept, got {steps!r}"
            )
        self.store = store
        self.steps = steps
        self._kept: Deque[List[str]] = collections.deque()
        self.deleted = 0

    def learned_from(self, rollouts: Sequence[Rollout]) -> None:
        """A training step has learnt from ``rollouts``: delete the spans of the steps that fall out of the window.

        A failed deletion (the store is unreachable for a moment) is logged and not retried: it leaves spans
        behind, which costs space, while raising would end a training run over housekeeping."""
        if self.steps is None:
            return
        self._kept.append([r.rollout_id for r in rollouts if r.is_terminal])
        while len(self._kept) > self.steps:
            ids = self._kept.popleft()
            try:
                self.deleted += delete_spans_in_batches(self.store, ids)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                logger.warning(
                    "could not delete the spans of %d rollouts of an old step (they stay): %s", len(ids), exc
                )
