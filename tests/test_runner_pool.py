"""RunnerPool's stop: real forked runner processes on a real SQLite store."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import agl
import pytest
from agl.runner_pool import RunnerPool
from agl.store import EnqueueRequest, SqliteLightningStore


@agl.rollout
def stuck(task: dict) -> float:
    time.sleep(60)  # an agent that hangs: its runner cannot stop until it is killed
    return 1.0


def test_stop_bounds_the_whole_stop_not_each_stuck_runner(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SqliteLightningStore(tmp_path / "store.db")
    store.enqueue_many([EnqueueRequest(input={"i": i}) for i in range(3)])
    pool = RunnerPool(stuck, store, n_runners=3, mode="process").start()
    deadline = time.monotonic() + 30
    while store.stats().rollouts.get("running", 0) < 3:  # every runner is inside its hanging rollout
        assert time.monotonic() < deadline, "the runners never started their rollouts"
        time.sleep(0.05)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="agl.runner_pool"):
        pool.stop(timeout=1.0)
    elapsed = time.monotonic() - started
    # one shared 1 s deadline, then the kills (before: 1 s per stuck runner, in turn)
    assert elapsed < 2.5, f"stop took {elapsed:.1f} s for 3 stuck runners with timeout=1"
    assert caplog.text.count("did not stop within 1.0 s; killing it") == 3
    assert not pool._workers  # all joined and forgotten
    store.close()
