"""A runner process that dies mid-rollout (OOM kill, kill -9, a segfault, os._exit): the pool ends its attempt at
once, saying how it died, so the rollout is retried now rather than after its heartbeat timeout."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Dict

import pytest

import agl
from agl.runtime.runner_pool import RunnerPool
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.types import RolloutConfig


@agl.rollout
def dies_once(task: Dict[str, Any]) -> float:
    """Dies on its first attempt (the marker file does not exist yet), succeeds on the retry."""
    marker = Path(task["marker"])
    if not marker.exists():
        marker.touch()
        if task["how"] == "kill -9":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    return 1.0


@pytest.mark.parametrize(
    "how, death",
    [("kill -9", "killed by signal 9: out of memory or kill -9?"), ("os._exit(3)", "exit code 3")],
)
def test_the_attempt_of_a_runner_process_that_dies_ends_at_once_and_is_retried(
    tmp_path: Path, how: str, death: str
) -> None:
    """The pool saw the death at once but left the attempt running until its heartbeat timeout (120 s by default,
    never with heartbeat_timeout=None), then "presumed dead", the exit code lost."""
    store = SqliteLightningStore(tmp_path / "store.db")
    config = RolloutConfig(max_attempts=2, heartbeat_timeout_seconds=300)
    task = {"marker": str(tmp_path / "died"), "how": how}
    (rollout,) = store.enqueue_many([EnqueueRequest(input=task, config=config)])
    pool = RunnerPool(dies_once, store, n_runners=1, mode="process").start()
    run_until_succeeded(pool, store, rollout.rollout_id)
    first, second = store.query_attempts(rollout.rollout_id)
    assert first.status == "failed" and second.status == "succeeded"
    expected = f"runner process agl-{first.runner_id} died ({death}) while running this rollout"
    assert first.error == expected, first.error
    assert re.fullmatch(r"runner-0-\d+-0", first.runner_id or "") and second.runner_id != first.runner_id
    store.close()


def run_until_succeeded(pool: RunnerPool, store: SqliteLightningStore, rollout_id: str) -> None:
    """Check the pool (as the trainer does) until the rollout succeeded, at most 30 s; then stop the pool."""
    try:
        deadline = time.monotonic() + 30
        while store.get_rollout(rollout_id).status != "succeeded":
            assert time.monotonic() < deadline, store.query_attempts(rollout_id)
            pool.check()
            time.sleep(0.05)
    finally:
        pool.stop(timeout=2.0)


class RefusesTheFirstCompletion(SqliteLightningStore):
    """A real SQLite store whose first complete_attempt fails as a crashing store client would: the runner
    thread that called it dies of the exception."""

    refused = False

    def complete_attempt(self, *args: Any, **kwargs: Any) -> Any:
        if not self.refused:
            self.refused = True
            raise RuntimeError("the store client crashed")
        return super().complete_attempt(*args, **kwargs)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies, as meant
def test_the_attempt_of_a_runner_thread_that_dies_ends_at_once_and_is_retried(tmp_path: Path) -> None:
    store = RefusesTheFirstCompletion(tmp_path / "store.db")
    config = RolloutConfig(max_attempts=2, heartbeat_timeout_seconds=300)
    (rollout,) = store.enqueue_many([EnqueueRequest(input={}, config=config)])
    pool = RunnerPool(agl.rollout(lambda task: 1.0), store, n_runners=1, mode="thread").start()
    run_until_succeeded(pool, store, rollout.rollout_id)
    first, second = store.query_attempts(rollout.rollout_id)
    assert (first.status, second.status) == ("failed", "succeeded")
    assert first.error == (
        f"runner thread agl-{first.runner_id} died (raised an exception: see the traceback above) while running "
        "this rollout"
    )
    store.close()


@agl.rollout
def crashes_on_poison(task: Dict[str, Any]) -> float:
    """A native tool library that aborts on some inputs: the runner process dies on every attempt of those."""
    if task["poison"]:
        os._exit(3)
    return 1.0


def test_tasks_that_crash_their_runner_fail_alone_and_do_not_stop_the_pool(tmp_path: Path) -> None:
    """Runners that died while running a rollout (after starting and claiming it) counted as start-up failures:
    three poison tasks made the pool raise "runners keep dying right after they start", ending `agl runner`."""
    store = SqliteLightningStore(tmp_path / "store.db")
    config = RolloutConfig(max_attempts=2, heartbeat_timeout_seconds=300)
    rollouts = store.enqueue_many([EnqueueRequest(input={"poison": i < 3}, config=config) for i in range(5)])
    pool = RunnerPool(crashes_on_poison, store, n_runners=2, mode="process").start()
    try:
        deadline = time.monotonic() + 60
        while any(store.get_rollout(r.rollout_id).status not in ("succeeded", "failed") for r in rollouts):
            assert time.monotonic() < deadline, store.stats()
            pool.check()
            time.sleep(0.05)
    finally:
        pool.stop(timeout=2.0)
    for rollout in rollouts:
        attempts = store.query_attempts(rollout.rollout_id)
        if rollout.input["poison"]:
            assert store.get_rollout(rollout.rollout_id).status == "failed"
            assert [a.error for a in attempts] == [
                f"runner process agl-{a.runner_id} died (exit code 3) while running this rollout" for a in attempts
            ]
            assert len(attempts) == 2
        else:
            assert store.get_rollout(rollout.rollout_id).status == "succeeded"
    assert pool.respawned == 6
    store.close()


def test_stopping_the_pool_ends_the_attempt_of_a_runner_that_died_unchecked(tmp_path: Path) -> None:
    """A runner that died after the pool's last check (or one a raising check left behind) was skipped on stop:
    its attempt stayed running until the heartbeat timeout, then failed as "presumed dead"."""
    store = SqliteLightningStore(tmp_path / "store.db")
    config = RolloutConfig(max_attempts=1, heartbeat_timeout_seconds=300)
    (rollout,) = store.enqueue_many([EnqueueRequest(input={"poison": True}, config=config)])
    pool = RunnerPool(crashes_on_poison, store, n_runners=1, mode="process").start()
    pool._workers[0].join(30)  # it dies on its rollout; nobody calls check()
    assert pool._workers[0].exitcode == 3
    pool.stop(timeout=2.0)
    (attempt,) = store.query_attempts(rollout.rollout_id)
    assert attempt.status == "failed"
    assert attempt.error == f"runner process agl-{attempt.runner_id} died (exit code 3) while running this rollout"
    store.close()
