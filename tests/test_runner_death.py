"""A runner process that dies mid-rollout (OOM kill, kill -9, a segfault, os._exit): the pool ends its attempt at
once, saying how it died, so the rollout is retried now rather than after its heartbeat timeout."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Dict

import agl
import pytest
from agl.runner_pool import RunnerPool
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
