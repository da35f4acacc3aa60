"""Stopping thread-mode runners while a rollout runs: real threads, a real SQLite store file, and a real
``agl runner --runner-mode thread`` process stopped with a real SIGTERM.

Before: the pool only joined its threads. A rollout still running at the stop timeout kept its attempt
``running`` (for ever without a heartbeat timeout), its heartbeat thread warned about the closed store until the
agent returned, and the agent thread (a ThreadPoolExecutor worker, joined at exit) kept ``agl runner`` alive
past ``--stop-timeout`` until the agent returned."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, List

import pytest

import agl
from agl.runtime.runner_pool import RunnerPool
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.testing.waiting import eventually
from agl.types import RolloutConfig

_RETURNED = threading.Event()


@agl.rollout
def naps_then_reports(task: dict) -> float:
    agl.emit_message("started")
    end = time.monotonic() + task["sleep"]
    while time.monotonic() < end:
        time.sleep(0.05)
    agl.emit_message("done")
    _RETURNED.set()
    return 1.0


def test_a_thread_runner_busy_past_the_stop_timeout_has_its_attempt_ended_and_reports_nothing_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _RETURNED.clear()
    crashes: List[Any] = []
    previous_hook = threading.excepthook
    threading.excepthook = crashes.append  # an abandoned runner thread must not die with a traceback
    store = SqliteLightningStore(tmp_path / "store.db")
    config = RolloutConfig(max_attempts=2)  # no heartbeat timeout: nothing else would ever end the attempt
    (rollout,) = store.enqueue_many([EnqueueRequest(input={"sleep": 2.0}, config=config)])
    pool = RunnerPool(
        naps_then_reports, store, n_runners=1, mode="thread", runner_kwargs={"heartbeat_interval": 0.1}
    ).start()
    try:
        eventually(lambda: store.get_rollout(rollout.rollout_id).status == "running", 10, "the rollout to start")
        with caplog.at_level(logging.INFO):
            pool.stop(timeout=0.5, reason="the test stops it")
            assert not _RETURNED.is_set(), "stop waited for the busy agent thread (it naps 2 s)"
            (attempt,) = store.query_attempts(rollout.rollout_id)
            assert attempt.status == "failed", "the attempt of the runner left behind is ended at once"
            assert attempt.error == (
                f"runner agl-{attempt.runner_id} was stopped before this rollout ended: the test stops it"
            )
            assert store.get_rollout(rollout.rollout_id).status == "queued", "retried at once (max_attempts=2)"
            caplog.clear()
            assert _RETURNED.wait(5), "the agent never returned"
            time.sleep(0.5)  # what the runner does once its agent returns
        (attempt,) = store.query_attempts(rollout.rollout_id)
        assert (attempt.status, attempt.error) == (
            "failed",
            f"runner agl-{attempt.runner_id} was stopped before this rollout ended: the test stops it",
        ), "not overwritten"
        assert store.get_rollout(rollout.rollout_id).status == "queued"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("agl")]
        assert not [w for w in warnings if "heartbeat" in w or "result not recorded" in w], warnings
        assert not crashes
    finally:
        threading.excepthook = previous_hook
        store.close()


AGENT = """
import time
import agl


@agl.rollout
def agent(task, rollout):
    agl.emit_message("started " + task["name"])
    end = time.monotonic() + (task["sleep"] if rollout.attempt.sequence == 1 else 0)
    while time.monotonic() < end:
        time.sleep(0.05)
    agl.emit_message("done " + task["name"])
    return 1.0
"""


def test_agl_runner_in_thread_mode_keeps_what_finishes_within_stop_timeout_and_fails_the_rest_then_exits(
    tmp_path: Path,
) -> None:
    """SIGTERM with two busy thread runners, ``--stop-timeout 2.5``: the rollout that ends 1 s later is stored
    as usual; the one that needs 30 s has its attempt ended as failed after 2.5 s, saying why, and is queued
    again; ``agl runner`` exits then, not when that agent returns."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    db = tmp_path / "store.db"
    store = SqliteLightningStore(db)
    config = RolloutConfig(max_attempts=2)  # no heartbeat timeout
    quick, slow = store.enqueue_many(
        [
            EnqueueRequest(input={"name": "quick", "sleep": 1.5}, config=config),
            EnqueueRequest(input={"name": "slow", "sleep": 30}, config=config),
        ]
    )
    log = tmp_path / "runner.log"
    cmd = [
        sys.executable,
        "-m",
        "agl.cli",
        "runner",
        "--store",
        str(db),
        "--agent",
        f"{agent}:agent",
        "--runner-mode",
        "thread",
        "--n-runners",
        "2",
        "--stop-timeout",
        "2.5",
        "--heartbeat-interval",
        "0.2",
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        eventually(
            lambda: store.stats().rollouts.get("running", 0) == 2, 30, f"both rollouts to start\n{log.read_text()}"
        )
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agl runner outlived --stop-timeout 2.5:\n{log.read_text()}") from None
        took = time.monotonic() - sent
        output = log.read_text()
        assert code == 0, output
        assert 2.0 < took < 6.0, f"exited {took:.1f} s after SIGTERM\n{output}"

        done = store.get_rollout(quick.rollout_id)
        assert (done.status, done.final_reward) == ("succeeded", 1.0), output
        names = [s.attributes.get("agl.message.body") or s.name for s in store.query_spans(quick.rollout_id)]
        assert {"started quick", "done quick", "agl.rollout"} <= set(names), names

        (attempt,) = store.query_attempts(slow.rollout_id)
        assert attempt.status == "failed", output
        assert attempt.error == (
            f"runner agl-{attempt.runner_id} was stopped before this rollout ended: agl runner was stopped by "
            "SIGTERM; busy runners get --stop-timeout 2.5 s"
        ), output
        assert store.get_rollout(slow.rollout_id).status == "queued", "retried at once (max_attempts=2)"
        assert "heartbeat" not in output and "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        store.close()
