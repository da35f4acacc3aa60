"""What an attempt holds when its rollout ends while work it started is still going on (a framework's model call
on a worker thread that a timeout cannot stop, a task the rollout left running): the spans still open are ended
then, marked stopped, and what that work does afterwards is not stored.

Found by the async-frameworks probe (session 25): CrewAI's ``kickoff_async`` runs the crew in
``asyncio.to_thread``; at a rollout timeout its in-flight model call ended 3 s after the attempt was reported and
was stored into the finished attempt without its parents (those ended later still, or were lost with the store)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import openai
import pytest

import agl
from agl import semconv
from agl.errors import RolloutTimedOutError
from agl.instrumentation.base import any_instrumented
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply

_WORK_DONE = threading.Event()


def _slow_crew(base_url: str) -> None:
    """What a framework does on its own worker thread: an agent span around a model call."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    try:
        with agl.operation("crew_agent"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "slow"}])
    finally:
        _WORK_DONE.set()


@agl.rollout
async def _times_out(task: Dict[str, Any], llm: agl.LLM) -> float:
    await asyncio.to_thread(_slow_crew, llm.get_base_url())  # the thread goes on when this is cancelled
    return 1.0


def _spans(store: SqliteLightningStore, rollout_id: str) -> List[agl.Span]:
    return list(store.query_spans(rollout_id))


def test_a_timed_out_attempt_keeps_the_tree_it_ended_with_and_nothing_that_ends_later(
    tmp_path: Path, fake_openai: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake_openai.script(FakeReply(content="late answer", delay=1.5))
    _WORK_DONE.clear()
    store = SqliteLightningStore(tmp_path / "s.db")
    resources = {"llm": agl.LLM(endpoint=fake_openai.base_url, model="m")}
    trainer = agl.Trainer(
        store=store, n_runners=1, runner_mode="thread", progress=False, rollout_timeout=0.4, initial_resources=resources
    )
    with caplog.at_level(logging.WARNING):
        (row,) = trainer.dev(_times_out, [{"q": 1}], print_table=False)
        assert row.status in ("timeout", "failed") and "timeout" in (row.error or ""), (
            row
        )  # (the store may end it first)
        before = _spans(store, row.rollout_id)
        assert _WORK_DONE.wait(10), "the worker thread's model call did not end"
        time.sleep(0.3)
        agl.get_tracer().flush(5)
    after = _spans(store, row.rollout_id)
    assert [s.span_id for s in after] == [s.span_id for s in before], "a span was stored after the attempt ended"
    root = next(s for s in after if s.parent_id is None)
    (operation,) = [s for s in after if s.kind == "chain"]  # the agl.operation
    (call,) = [s for s in after if s.kind == "llm"]
    assert operation.parent_id == root.span_id and call.parent_id == operation.span_id
    for span in (operation, call):
        assert span.attributes.get(semconv.SPAN_STOPPED) is True, span
        assert span.status == "error" and "still open when the rollout timed out" in (span.error or "")
        assert span.end_time <= root.end_time + 1_000_000_000
    assert not [r for r in caplog.records if "on the ended span" in r.getMessage()]


def test_a_span_ended_by_its_rollout_ignores_its_own_late_end_quietly(
    sink: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = agl.get_tracer()
    with caplog.at_level(logging.WARNING):
        with agl.rollout_scope("ro-1", "at-1") as scope:
            outer = tracer.start_span("outer", "agent")
            inner = tracer.start_span("inner", "tool", parent=outer)
            done = tracer.start_span("done", "tool", parent=outer)
            done.end()
        scope.end()  # what the runner does when a rollout ends (rollout_scope leaves it to the caller)
        assert scope.ended and not scope.open_spans
        inner.set_attribute("late", 1)
        inner.end()
        outer.end()
        tracer.flush(5)
    by_name = {s.name: s for s in sink.spans}
    assert set(by_name) == {"outer", "inner", "done"}
    assert by_name["inner"].attributes.get(semconv.SPAN_STOPPED) is True and "late" not in by_name["inner"].attributes
    assert semconv.SPAN_STOPPED not in by_name["done"].attributes and by_name["done"].status != "error"
    assert "still open when the rollout ended" in (by_name["outer"].error or "")
    assert not [r for r in caplog.records if "on the ended span" in r.getMessage()]


_SEEN: List[BaseException] = []
_AGENT_DONE = threading.Event()


@agl.rollout
def _slow_sync(task: Dict[str, Any], llm: agl.LLM) -> float:
    client = openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0)
    time.sleep(task["delay"])  # a slow step a sync agent cannot be interrupted in
    try:
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    except BaseException as exc:
        _SEEN.append(exc)
        raise
    finally:
        if task["q"] == "late":
            _AGENT_DONE.set()
    return 1.0


def test_the_agent_of_a_timed_out_rollout_can_no_longer_call_the_model(
    tmp_path: Path, fake_openai: FakeOpenAIServer
) -> None:
    """The main-job probe (session 25): a sync agent past its timeout went on calling the policy server beside
    the rollouts that replaced it (under load the next wave timed out too). Its next model call is refused,
    also once dev() has returned: the Trainer, which hooked the OpenAI client for the run (no
    agl.instrument()), keeps that hook while such an agent runs (the timeout probe, session 26: its calls
    reached the server after the Trainer unhooked)."""
    _SEEN.clear()
    _AGENT_DONE.clear()
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(
        store=store,
        n_runners=1,
        runner_mode="thread",
        progress=False,
        rollout_timeout=1.0,
        initial_resources={"llm": agl.LLM(endpoint=fake_openai.base_url, model="m")},
    )
    late, following = trainer.dev(  # the late call comes 2 s after the timeout: dev() has returned by then
        _slow_sync, [{"q": "late", "delay": 3.0}, {"q": "next", "delay": 0.1}], print_table=False
    )
    assert not _AGENT_DONE.is_set(), "the late call came before dev() returned: it tests nothing"
    assert _AGENT_DONE.wait(10)
    assert late.status in ("timeout", "failed") and "timeout" in (late.error or "")
    assert following.status == "succeeded" and following.llm_calls == 1
    assert [r["body"]["messages"][0]["content"] for r in fake_openai.requests] == ["next"]
    assert len(_SEEN) == 1 and isinstance(_SEEN[0], RolloutTimedOutError) and late.rollout_id in str(_SEEN[0])
    assert [s.kind for s in store.query_spans(late.rollout_id) if s.kind == "llm"] == []
    # the next run takes the kept hook over, hooks the rest for itself, and unhooks everything after it
    (again,) = trainer.dev(_slow_sync, [{"q": "again", "delay": 0.0}], print_table=False)
    assert again.status == "succeeded" and again.llm_calls == 1
    assert not any_instrumented(), "the kept OpenAI hook outlived the next run"


@pytest.fixture(autouse=True)
def _unhooked_after() -> Any:
    """A Trainer whose runners gave up on an agent keeps the OpenAI client hooked (see the test above): take it
    out after each test, so that the next tests start with nothing instrumented."""
    yield
    agl.uninstrument()


def test_a_rollout_that_returned_in_time_leaves_its_kept_work_free_to_call_the_model(
    fake_openai: FakeOpenAIServer, instrumented: Any
) -> None:
    """Only a timed-out rollout's calls are refused: a task a rollout keeps (it returned in time) still calls
    the model, unrecorded."""
    client = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    with agl.rollout_scope("ro-in-time", "at-1") as scope:
        context = contextvars.copy_context()
    scope.end()
    reply = context.run(client.chat.completions.create, model="m", messages=[{"role": "user", "content": "kept"}])
    assert reply.choices[0].message.content is not None
    scope.outcome = "timed out"
    with pytest.raises(RolloutTimedOutError, match="ro-in-time ran past its timeout"):
        context.run(client.chat.completions.create, model="m", messages=[{"role": "user", "content": "late"}])
    assert [r["body"]["messages"][0]["content"] for r in fake_openai.requests] == ["kept"]


_B_STARTED = threading.Event()
_B_CANCELLED = threading.Event()


@agl.rollout
async def _ignores_then_polite(task: Dict[str, Any]) -> float:
    """``stubborn`` catches its cancellation and returns once ``polite`` (the next rollout) has started, after
    its runner gave up on it; ``polite`` sleeps past its timeout, as a plain coroutine any cancellation ends."""
    if task["kind"] == "stubborn":
        deadline = time.monotonic() + 15
        while not _B_STARTED.is_set() and time.monotonic() < deadline:
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                pass
        return 0.5
    _B_STARTED.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        _B_CANCELLED.set()
        raise
    return 1.0


def test_an_abandoned_async_rollout_ending_late_leaves_the_next_one_cancellable_at_its_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout probe (session 26): the runner gave up on a rollout that ignored its cancellation; when that
    one's task ended, during the next rollout, its agent thread cleared the runner's handle on the next one's
    task, which then ran on past its own timeout, uncancelled (and the runner left a second agent thread)."""
    from agl.runtime import agent_loops

    _B_STARTED.clear()
    _B_CANCELLED.clear()
    monkeypatch.setattr("agl.runtime.runner.CANCEL_GRACE_S", 1.5)  # (5 s by default) how long the stubborn one is given
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(store=store, n_runners=1, runner_mode="thread", progress=False, rollout_timeout=1.5)
    try:
        with caplog.at_level(logging.WARNING, "agl.runtime.runner"):
            stubborn, polite = trainer.dev(
                _ignores_then_polite, [{"kind": "stubborn"}, {"kind": "polite"}], print_table=False
            )
        cancelled_at_its_timeout = _B_CANCELLED.is_set()  # (before the loop's close cancels what is left)
    finally:  # an uncancelled coroutine would go on on the loop kept for the process, into the next tests
        agent_loops.close()
    assert _B_STARTED.is_set()
    assert cancelled_at_its_timeout, "the next rollout was not cancelled at its timeout"
    for row in (stubborn, polite):
        assert row.status in ("timeout", "failed") and "timeout" in (row.error or ""), (
            row
        )  # (the store may end it first)
    (warning,) = [r.getMessage() for r in caplog.records if "did not stop at its timeout" in r.getMessage()]
    assert stubborn.rollout_id in warning and "catches CancelledError" in warning


_LATE_RETURN: Dict[str, threading.Thread] = {}


@agl.rollout
def _returns_after_its_timeout(task: Dict[str, Any]) -> float:
    """A sync agent busy past its timeout that then returns a reward (no span of its own after the timeout)."""
    _LATE_RETURN["thread"] = threading.current_thread()
    time.sleep(task["delay"])
    return 1.0


def test_a_sync_agent_past_its_timeout_is_named_and_its_late_return_makes_no_reward_span(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout probe (session 26): a runner that gave up on an agent said so only at INFO, as for one cancelled
    cleanly; and when the agent returned on its abandoned thread, the runner's own reward span for it set off the
    tracer's warning about tasks a rollout left running (wrong advice), using up that said-once warning."""
    tracer = agl.get_tracer()
    monkeypatch.setattr(tracer, "_warned_late", False)  # said once per process: an earlier test may have
    monkeypatch.setattr(tracer, "_warned_late_timed_out", False, raising=False)
    _LATE_RETURN.clear()
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(store=store, n_runners=1, runner_mode="thread", progress=False, rollout_timeout=0.5)
    with caplog.at_level(logging.WARNING):
        row, second = trainer.dev(_returns_after_its_timeout, [{"delay": 2.0}, {"delay": 2.0}], print_table=False)
        _LATE_RETURN["thread"].join(10)  # the abandoned agent thread leaves once the agent has returned
        assert not _LATE_RETURN["thread"].is_alive()
    assert row.status in ("timeout", "failed") and "timeout" in (row.error or ""), row
    stuck = [r for r in caplog.records if "did not stop at its timeout" in r.getMessage()]
    assert len(stuck) == 2 and all(r.levelno == logging.WARNING and r.name == "agl.runtime.runner" for r in stuck)
    message, again = (r.getMessage() for r in stuck)
    assert row.rollout_id in message and "sync agent cannot be interrupted" in message
    assert "agent thread running" in message and "runner_mode='process'" in message
    # the advice once per runner (a loaded machine timed out 15 in a row, each with all of it): then one short line
    assert second.rollout_id in again and "either" in again and "runner_mode" not in again
    assert not [r for r in caplog.records if r.name == "agl.tracing.tracer"], "a span was started after the timeout"
    assert not tracer._warned_late


def test_a_span_after_a_timeout_is_told_apart_from_one_in_a_task_a_rollout_left_running(
    sink: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each late span has its own said-once warning, worded from how its rollout ended."""
    tracer = agl.get_tracer()
    monkeypatch.setattr(tracer, "_warned_late", False)
    monkeypatch.setattr(tracer, "_warned_late_timed_out", False, raising=False)
    contexts = {}
    for rollout_id in ("ro-timed-out", "ro-returned"):
        with agl.rollout_scope(rollout_id, "at-1") as scope:
            contexts[rollout_id] = contextvars.copy_context()
        scope.outcome = "timed out" if rollout_id == "ro-timed-out" else scope.outcome
        scope.end()
    with caplog.at_level(logging.WARNING, "agl.tracing.tracer"):
        for rollout_id in ("ro-timed-out", "ro-timed-out", "ro-returned", "ro-returned"):
            contexts[rollout_id].run(lambda: tracer.start_span(f"late {rollout_id}", "tool").end())  # noqa: B023 - run at once
    timed_out, returned = [r.getMessage() for r in caplog.records]  # one each, though each came twice
    assert "'late ro-timed-out' started after its rollout ro-timed-out timed out" in timed_out
    assert "went on past the timeout" in timed_out and "raise rollout_timeout" in timed_out
    assert "left running" not in timed_out and "cancel it before returning" not in timed_out
    assert "'late ro-returned' started after its rollout ro-returned had returned" in returned
    assert "cancel it before returning" in returned
