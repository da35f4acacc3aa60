"""Every rollout mode round-trips through every backend (memory, SQLite, HTTP, PostgreSQL): `agl dev`'s runs are
stored as mode ``dev``, and reading by mode keeps them apart from the training and validation rollouts."""

from __future__ import annotations

from typing import get_args

from agl.store import LightningStore
from agl.types import RolloutMode


def test_each_mode_is_stored_read_back_and_queried_apart(store: LightningStore) -> None:
    modes = get_args(RolloutMode)
    assert "dev" in modes
    ids = {mode: store.enqueue_rollout({"mode": mode}, task_id="t", mode=mode).rollout_id for mode in modes}
    for mode in modes:
        assert [(r.rollout_id, r.mode) for r in store.query_rollouts(mode=mode)] == [(ids[mode], mode)]
        assert store.get_rollout(ids[mode]).mode == mode
    claimed = [store.dequeue_rollout("runner") for _ in modes]
    assert [(r.rollout_id, r.mode) for r in claimed if r is not None] == [(ids[m], m) for m in modes]
