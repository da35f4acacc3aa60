"""RunnerPool's stop: real forked runner processes on a real SQLite store."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import agl
from agl.runtime import agent_loops
from agl.runtime.runner import Runner
from agl.runtime.runner_pool import RunnerPool
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.types import RolloutConfig


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
    with caplog.at_level(logging.WARNING, logger="agl.runtime.runner_pool"):
        pool.stop(timeout=1.0)
    elapsed = time.monotonic() - started
    # one shared 1 s deadline, then the kills (before: 1 s per stuck runner, in turn)
    assert elapsed < 2.5, f"stop took {elapsed:.1f} s for 3 stuck runners with timeout=1"
    assert caplog.text.count("did not stop within 1.0 s; killing it") == 3
    assert not pool._workers  # all joined and forgotten
    store.close()


def test_the_attempt_of_a_runner_process_killed_on_stop_ends_at_once(tmp_path: Path) -> None:
    """Its attempt stayed running until the heartbeat timeout (120 s by default), then failed as unresponsive,
    though the pool knew which attempt the killed runner had: it now ends it as failed, saying why."""
    store = SqliteLightningStore(tmp_path / "store.db")
    config = RolloutConfig(max_attempts=2, heartbeat_timeout_seconds=300)
    (rollout,) = store.enqueue_many([EnqueueRequest(input={}, config=config)])
    pool = RunnerPool(stuck, store, n_runners=1, mode="process").start()
    deadline = time.monotonic() + 30
    while store.get_rollout(rollout.rollout_id).status != "running":
        assert time.monotonic() < deadline, "the runner never started its rollout"
        time.sleep(0.05)
    pool.stop(timeout=0.5, reason="the test stops it")
    (attempt,) = store.query_attempts(rollout.rollout_id)
    assert attempt.status == "failed" and attempt.error == (
        f"runner agl-{attempt.runner_id} was killed before this rollout ended: the test stops it"
    )
    assert store.get_rollout(rollout.rollout_id).status == "queued", "retried at once"
    store.close()


@agl.rollout
def naps(task: dict) -> float:
    time.sleep(1.5)
    return 1.0


def test_a_runner_says_its_rollout_was_cancelled_not_timed_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteLightningStore(tmp_path / "store.db")
    (rollout,) = store.enqueue_many([EnqueueRequest(input={})])
    pool = RunnerPool(naps, store, n_runners=1, mode="thread", runner_kwargs={"heartbeat_interval": 0.1}).start()
    try:
        deadline = time.monotonic() + 30
        while store.get_rollout(rollout.rollout_id).status != "running":
            assert time.monotonic() < deadline, "the rollout never started"
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="agl.runtime.runner"):
            store.cancel_rollout(rollout.rollout_id)
            time.sleep(1.0)  # a few heartbeats
        assert f"of {rollout.rollout_id} was cancelled (cancel_rollout)" in caplog.text
        assert "timed out" not in caplog.text
    finally:
        pool.stop(timeout=5)
        store.close()


@agl.rollout
def slow(task: dict) -> float:
    time.sleep(4)
    return 1.0


def test_stopping_thread_runners_does_not_wait_for_a_busy_agent(tmp_path: Path) -> None:
    """Closing a runner ends its agent thread's event loop on that thread: with the agent still busy past the
    stop timeout, that must be skipped, not waited for."""
    store = SqliteLightningStore(tmp_path / "store.db")
    store.enqueue_many([EnqueueRequest(input={"i": 0})])
    pool = RunnerPool(slow, store, n_runners=1, mode="thread").start()
    deadline = time.monotonic() + 30
    while store.stats().rollouts.get("running", 0) < 1:
        assert time.monotonic() < deadline, "the runner never started its rollout"
        time.sleep(0.05)
    started = time.monotonic()
    pool.stop(timeout=0.5)
    assert time.monotonic() - started < 2.5, "stop waited for the busy agent thread"
    # (the runner left behind reports nothing when its agent wakes: see tests/test_runner_stop_thread.py)


# --- spawned runner processes (macOS, or $AGL_START_METHOD=spawn) -------------------------------------------

SPAWNED_AGENT = """
import agl
from openai import OpenAI

# no agl.instrument() here: the script that trains calls it (under its main guard)

@agl.rollout
def ask(task, llm):
    client = OpenAI(base_url=llm.endpoint, api_key="x")
    reply = client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return float(reply.choices[0].message.content is not None)
"""


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("AGL_START_METHOD", "spawn")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned children get the parent's sys.path
    return tmp_path


def test_spawned_runners_run_a_module_level_agent_and_hook_what_the_parent_hooked(spawned: Path, fake_openai) -> None:
    """Before: a module-level ``@agl.rollout`` agent did not pickle ("it's not the same object as
    agl_spawned_agent.ask"), so process runners could not start where they are spawned."""
    from agl.instrumentation import instrumented

    (spawned / "agl_spawned_agent.py").write_text(SPAWNED_AGENT)
    import agl_spawned_agent

    fake_openai.always_token_ids = True
    was_hooked = instrumented() is not None
    agl.instrument(frameworks=[])
    store = SqliteLightningStore(spawned / "store.db")
    try:
        trainer = agl.Trainer(
            n_runners=2,
            store=store,
            progress=False,
            initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake")},
        )
        rows = trainer.dev(
            agl_spawned_agent.ask, [{"q": "What is 2 plus 3?"}, {"q": "What is 4 plus 4?"}], print_table=False
        )
        assert [(r.status, r.reward, r.llm_calls) for r in rows] == [("succeeded", 1.0, 1)] * 2
        for row in rows:
            (llm,) = [s for s in store.query_spans(row.rollout_id) if s.kind == "llm"]
            assert llm.attributes[agl.semconv.RESPONSE_TOKEN_IDS]  # traced in the spawned process
    finally:
        store.close()
        if not was_hooked:
            agl.uninstrument()


def test_an_agent_that_cannot_be_pickled_for_a_spawned_runner_is_refused_with_what_to_do(spawned: Path) -> None:
    @agl.rollout
    def local_agent(task: dict) -> float:
        return 1.0

    store = SqliteLightningStore(spawned / "store.db")
    try:
        with pytest.raises(
            RuntimeError,
            match="runner processes start with 'spawn' here.*Define the agent at module level.*runner_mode='thread'",
        ):
            RunnerPool(local_agent, store, n_runners=1).start()
    finally:
        store.close()


def test_the_start_method_is_fork_on_linux_spawn_on_macos_and_agl_start_method_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agl.runtime import runner_pool

    monkeypatch.delenv("AGL_START_METHOD", raising=False)
    monkeypatch.setattr(runner_pool.sys, "platform", "linux")
    assert runner_pool._mp_context().get_start_method() == "fork"
    monkeypatch.setattr(runner_pool.sys, "platform", "darwin")
    assert runner_pool._mp_context().get_start_method() == "spawn"
    monkeypatch.setenv("AGL_START_METHOD", "forkserver")
    assert runner_pool._mp_context().get_start_method() == "forkserver"
    monkeypatch.setenv("AGL_START_METHOD", "clone")
    with pytest.raises(ValueError, match="AGL_START_METHOD='clone' is not a start method here; use one of"):
        runner_pool._mp_context()


def test_runners_the_store_refuses_stop_the_pool_with_what_to_do(tmp_path: Path) -> None:
    """A token revoked on the store server (or the wrong one): every runner process died on its first call
    and was respawned, forever, each printing a traceback; the crash-loop guard never fired, since the pool
    looks at its workers once a second and it counted deaths within a second of the start."""
    from agl.errors import StoreAuthError
    from agl.store.http.client import RemoteLightningStore
    from agl.store.http.server import ServerThread, TokenSet, create_app

    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"trainer": "good"}))).start()
    pool = RunnerPool(agl.rollout(lambda task: 1.0), RemoteLightningStore(server.url, token="revoked"), 2).start()
    try:
        deadline = time.monotonic() + 30
        with pytest.raises(StoreAuthError, match="the store refused its token .* a token the store server accepts"):
            while time.monotonic() < deadline:
                pool.check()
                time.sleep(0.2)
        assert pool.respawned == 0, "no runner was respawned"
    finally:
        pool.stop()
        server.stop()
        backing.close()


_CLOSED: list = []


async def _numbers():
    try:
        yield 1
        yield 2
    finally:
        _CLOSED.append("closed")


@agl.rollout
async def _abandons_a_stream(task):
    numbers = _numbers()
    await numbers.__anext__()  # and never closed, as an agent that breaks out of a model stream
    return 1.0


def test_async_work_an_agent_left_behind_is_finished_when_the_runners_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A runner kept its agent thread's event loop open to the end: an abandoned async generator's ``aclose``
    never ran (its ``finally`` neither: an abandoned model stream's span never ended), and asyncio logged
    "Task was destroyed but it is pending!" when the loop was collected. (Runner processes close theirs the
    same way before they exit.)"""
    import gc

    _CLOSED.clear()
    trainer = agl.Trainer(
        store=SqliteLightningStore(tmp_path / "s.db"), n_runners=1, runner_mode="thread", progress=False
    )
    with caplog.at_level(logging.ERROR, "asyncio"):
        rows = trainer.dev(_abandons_a_stream, [{"n": 1}, {"n": 2}], print_table=False)
        gc.collect()
    assert [r.status for r in rows] == ["succeeded", "succeeded"]
    assert _CLOSED == ["closed", "closed"]
    assert not [r for r in caplog.records if "was destroyed but it is pending" in r.getMessage()]


_LEFT: list = []
_KEPT: dict = {}


async def _keeps_working():
    """Stands for an SDK's background run whose stream the agent stopped reading: it goes on making calls."""
    from agl.tracing.tracer import get_tracer

    while True:
        await asyncio.sleep(0.05)
        with get_tracer().span("left-behind call", "chain"):
            _LEFT.append("call")


async def _serves(queue: asyncio.Queue[Any]):
    """Stands for a session or runtime an agent starts once and keeps (an MCP session's reader, AutoGen's
    runtime): a task of the first rollout that later rollouts rely on."""
    while True:
        reply, value = await queue.get()
        reply.set_result(value * 2)


@agl.rollout
async def _leaves_tasks_running(task):
    if "queue" not in _KEPT:
        _KEPT["queue"] = asyncio.Queue()
        asyncio.get_running_loop().create_task(_serves(_KEPT["queue"]))
    if task["kind"] == "leave":
        asyncio.get_running_loop().create_task(_keeps_working())
        await asyncio.sleep(0.12)
    else:
        await asyncio.sleep(0.6)  # the next rollout on the same runner, and so on the same event loop
    reply = asyncio.get_running_loop().create_future()
    await _KEPT["queue"].put((reply, 0.5))
    return await reply  # the session the first rollout started still serves


def test_tasks_a_rollout_left_running_record_nothing_into_it_after_it_returned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent thread's event loop outlives each rollout: a task the rollout left running (an OpenAI Agents
    SDK run whose stream it stopped reading) went on during the next rollout and stored its calls in the
    finished attempt. Its spans after the rollout returned are not stored now; the task itself is not cancelled,
    since a session or runtime kept for the next rollouts is such a task too (cancelling those broke them)."""
    _LEFT.clear()
    _KEPT.clear()
    monkeypatch.setattr(agl.get_tracer(), "_warned_late", False)  # said once per process: an earlier test may have
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(store=store, n_runners=1, runner_mode="thread", progress=False)
    try:
        with caplog.at_level(logging.WARNING):
            rows = trainer.dev(_leaves_tasks_running, [{"kind": "leave"}, {"kind": "sleep"}], print_table=False)
    finally:  # the tasks it left would go on in the next tests' rollouts, on the loop kept for the process
        agent_loops.close()
    assert [(r.status, r.reward) for r in rows] == [("succeeded", 1.0), ("succeeded", 1.0)]
    (rollout,) = store.query_rollouts(rollout_ids=[rows[0].rollout_id])
    spans = store.query_spans(rows[0].rollout_id)
    ended_ns = rollout.attempt.end_time * 1e9  # (attempt times are in seconds, span times in nanoseconds)
    assert all(s.start_time <= ended_ns for s in spans), "a span started after its attempt had ended"
    stored = sum(s.name == "left-behind call" for s in spans)
    assert 1 <= stored <= 3 and len(_LEFT) > stored + 3, "the task ran on during the next rollout, unrecorded"
    assert all(s.name != "left-behind call" for s in store.query_spans(rows[1].rollout_id))
    assert "left 2 asyncio task(s) running" in caplog.text and "_keeps_working" in caplog.text
    assert "started after its rollout" in caplog.text


def test_closing_a_runner_twice_is_quiet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from agl.runtime.runner import Runner

    runner = Runner(_abandons_a_stream, SqliteLightningStore(tmp_path / "s.db"))
    with caplog.at_level(logging.WARNING, "agl.runtime.runner"):
        runner.close()
        runner.close()  # (the second found its executor shut down and logged that it could not schedule)
    assert not caplog.records


def test_a_rollout_timeout_the_store_recorded_first_is_not_reported_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's reaper and the runner enforce the same deadline; when the store got there first, every timed-out
    rollout also logged "WARNING result not recorded: attempt ... already ended as 'timeout'", read as a second
    problem."""
    import asyncio

    from agl.runtime.runner import Runner

    @agl.rollout
    async def hangs(task: dict) -> float:
        await asyncio.sleep(30)
        return 1.0

    store = SqliteLightningStore(tmp_path / "store.db")
    store.enqueue_many([EnqueueRequest(input={}, config=RolloutConfig(timeout_seconds=0.5, max_attempts=1))])
    runner = Runner(hangs, store)
    rollout = store.dequeue_rollout(runner.runner_id)
    assert rollout is not None
    deadline = time.monotonic() + 10
    while store.query_attempts(rollout.rollout_id)[0].status != "timeout":  # the store ends it first, as meant
        assert time.monotonic() < deadline, "the store never reaped the attempt"
        store.reap_expired()
        time.sleep(0.05)
    try:
        with caplog.at_level(logging.INFO, logger="agl.runtime.runner"):
            ended = runner.run_rollout(rollout)
    finally:
        runner.close()
    (attempt,) = store.query_attempts(rollout.rollout_id)
    assert (ended.status, attempt.status) == ("failed", "timeout")
    assert attempt.error and "ended by the store" in attempt.error  # the store was first, as meant here
    runner_records = [r for r in caplog.records if r.name == "agl.runtime.runner"]
    assert not [r for r in runner_records if r.levelno >= logging.WARNING], [r.getMessage() for r in runner_records]
    assert any("timed out (the store had ended attempt" in r.getMessage() for r in runner_records)
    store.close()


def test_stop_does_not_wait_out_a_store_outage_to_record_a_killed_runners_attempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM to a busy `agl runner` while its store server was down: the busy runner was killed after the stop
    timeout, then ending its attempt rode out the outage (10 minutes for `agl runner`), so a process manager's
    grace period, set a little above --stop-timeout, ran out first. Now stop waits a few seconds and says so."""
    from agl.store.http.client import RemoteLightningStore
    from agl.store.http.server import ServerThread, create_app

    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, allow_anonymous=True)).start()
    store = RemoteLightningStore(server.url)
    store.ride_out_outages(30)  # as `agl runner` does (600 s there; 30 here keeps a regression from hanging CI)
    (rollout,) = store.enqueue_many([EnqueueRequest(input={}, config=RolloutConfig(heartbeat_timeout_seconds=300))])
    pool = RunnerPool(stuck, store, n_runners=1, mode="process").start()
    try:
        deadline = time.monotonic() + 30
        while backing.get_rollout(rollout.rollout_id).status != "running":
            assert time.monotonic() < deadline, "the runner never started its rollout"
            time.sleep(0.05)
        server.stop()  # the store server is gone while the runner is busy
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="agl.runtime.runner_pool"):
            pool.stop(timeout=0.5, reason="the test stops it")
        elapsed = time.monotonic() - started
    finally:
        store.close()
    assert elapsed < 0.5 + 1.0 + 3.0 + 2.0, f"stop took {elapsed:.1f} s with the store server down"
    (attempt,) = backing.query_attempts(rollout.rollout_id)
    assert attempt.status == "running"  # the store's heartbeat timeout ends it
    assert (
        f"the store did not answer within 3 s, so attempt {attempt.attempt_id} is not recorded as failed (runner "
        f"agl-{attempt.runner_id} was killed before this rollout ended: the test stops it); the store's heartbeat "
        "timeout ends it"
    ) in caplog.text
    backing.close()


class HeartbeatInFlightAtTheEnd(SqliteLightningStore):
    """A real SQLite store whose heartbeat arrives only after the runner completed the attempt, as one does on
    a busy SQLite file or a slow network: the store then answers it with StaleAttemptError."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.beating = threading.Event()
        self.completed = threading.Event()

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Any:
        self.beating.set()
        assert self.completed.wait(30)
        return super().heartbeat(rollout_id, attempt_id)

    def complete_attempt(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().complete_attempt(*args, **kwargs)
        finally:
            self.completed.set()


def test_a_heartbeat_in_flight_as_the_runner_completes_is_no_timeout_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The late beat's StaleAttemptError logged "attempt ... was ended by the store (timed out?)" for an
    attempt that had succeeded, misleading anyone looking for real timeouts."""
    store = HeartbeatInFlightAtTheEnd(tmp_path / "store.db")
    (rollout,) = store.enqueue_many([EnqueueRequest(input={})])
    runner = Runner(agl.rollout(lambda task: 1.0 if store.beating.wait(30) else 0.0), store, heartbeat_interval=0.01)
    with caplog.at_level(logging.INFO, logger="agl.runtime.runner"):
        runner.run_rollout(store.dequeue_rollout(runner.runner_id))
        beats = [t for t in threading.enumerate() if t.name == "agl-heartbeat"]
        for beat in beats:
            beat.join(30)  # the late beat was answered
    assert beats and not any(beat.is_alive() for beat in beats)
    assert [(a.status, a.error) for a in store.query_attempts(rollout.rollout_id)] == [("succeeded", None)]
    assert "was ended by the store" not in caplog.text and "heartbeat" not in caplog.text
    runner.close()
    store.close()


def test_a_heartbeat_timeout_not_longer_than_the_heartbeat_interval_is_refused_or_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trainer(heartbeat_timeout=3) with the runners' default 5 s heartbeat interval: every rollout longer than
    3 s that emitted no span ended as "unresponsive ... presumed dead" from healthy runners, and nothing said
    why. The Trainer knows both values and refuses; a runner (maybe on another machine than the trainer that
    set the timeout) warns when it claims such a rollout."""
    with pytest.raises(
        ValueError, match=r"heartbeat_timeout=3 s is not longer than heartbeat_interval=5 s \(how often"
    ):
        agl.Trainer(store=str(tmp_path / "a.db"), heartbeat_timeout=3.0)
    agl.Trainer(store=str(tmp_path / "b.db"), heartbeat_timeout=3.0, heartbeat_interval=1.0).store.close()
    agl.Trainer(store=str(tmp_path / "c.db"), heartbeat_timeout=3.0, n_runners=0).store.close()  # runners elsewhere
    store = SqliteLightningStore(tmp_path / "store.db")
    store.enqueue_many([EnqueueRequest(input={}, config=RolloutConfig(heartbeat_timeout_seconds=3.0))] * 2)
    runner = Runner(agl.rollout(lambda task: 1.0), store, heartbeat_interval=5.0)
    with caplog.at_level(logging.WARNING, logger="agl.runtime.runner"):
        for _ in range(2):
            runner.run_rollout(store.dequeue_rollout(runner.runner_id))
    assert (
        caplog.text.count(
            f"has a heartbeat timeout of 3 s, not longer than runner {runner.runner_id}'s heartbeat interval of 5 s: "
            f"the "
            "store will end its attempts as unresponsive while they run"
        )
        == 1
    ), caplog.text
    runner.close()
    store.close()


@pytest.mark.parametrize(
    "setting, expected",
    [
        ({"rollout_timeout": float("nan")}, "rollout_timeout must be a finite number > 0, got nan"),
        ({"rollout_timeout": -1.0}, "rollout_timeout must be a finite number > 0, got -1.0"),
        ({"heartbeat_interval": 0.0}, "heartbeat_interval must be a finite number > 0, got 0.0"),
        ({"outage_timeout": float("inf")}, "outage_timeout must be a finite number > 0, got inf"),
        ({"flush_timeout": -1}, "flush_timeout must be a finite number >= 0, got -1"),
    ],
)
def test_runner_timings_that_would_break_runs_quietly_are_refused(tmp_path: Path, setting: Any, expected: str) -> None:
    """A NaN rollout timeout never fired and a negative one timed every rollout out at once; a pool checks
    them before it starts any runner process (else each process would die at start, one after another)."""
    store = SqliteLightningStore(tmp_path / "s.db")
    agent = agl.rollout(lambda task: 1.0)
    with pytest.raises(ValueError, match=re.escape(expected)):
        Runner(agent, store, **setting)
    with pytest.raises(ValueError, match=re.escape(expected)):
        RunnerPool(agent, store, 2, mode="process", runner_kwargs=setting)
    store.close()


def test_agl_runner_refuses_bad_seconds_in_one_line(tmp_path: Path) -> None:
    from agl.cli import main

    base = ["runner", "--agent", "x:y", "--store", str(tmp_path / "s.db")]
    for flag, value, expected in [
        ("--rollout-timeout", "nan", "> 0, got nan"),
        ("--stop-timeout", "-1", ">= 0, got -1.0"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main([*base, flag, value])
        assert exc.value.code == f"agl: {flag} must be a finite number of seconds {expected}"
    assert not (tmp_path / "s.db").exists()
