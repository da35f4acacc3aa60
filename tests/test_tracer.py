"""The tracer: own provider, rollout stamping, background batching, bounded queue, flush, fork."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from opentelemetry import trace as otel_trace

import agl
from agl import semconv
from agl.tracing.context import rollout_scope
from agl.tracing.encoding import Computed
from agl.tracing.tracer import Tracer


class ListSink:
    def __init__(self):
        self.spans = []
        self.calls = 0
        self.threads = set()

    def add_spans(self, spans):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        self.spans.extend(spans)
        return len(spans)


@pytest.fixture()
def tracer():
    t = Tracer(max_queue=1000, batch_size=64)
    sink = ListSink()
    t.set_store(sink)
    yield t, sink
    t.processor.shutdown()


def test_agl_never_replaces_the_global_tracer_provider():
    before = otel_trace.get_tracer_provider()
    agl.instrument()
    try:
        with rollout_scope("ro-1", "at-1"), agl.get_tracer().span("s", "chain"):
            assert otel_trace.get_tracer_provider() is before
    finally:
        agl.uninstrument()


def test_spans_nest_with_the_users_own_spans_both_ways(tracer):
    """The user's tracer provider (SDK, exporting to memory) and agl share OpenTelemetry's context."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    t, sink = tracer
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    users = provider.get_tracer("user")
    with rollout_scope("ro-1", "at-1"):
        with users.start_as_current_span("user outer") as outer:
            with t.span("agl agent", "agent") as ours:
                with users.start_as_current_span("user inner"):
                    child = t.start_span("agl llm", "llm")  # not current: parent from the context
                    child.end()
                with otel_trace.use_span(ours, end_on_exit=False):
                    assert otel_trace.get_current_span() is ours
            explicit = t.start_span("agl explicit", "tool", parent=ours)
            explicit.end()
        root = t.start_span("agl root", "chain")
        root.end()
    assert t.flush(5)
    users_spans = {s.name: s for s in exported.get_finished_spans()}
    agl_spans = {s.name: s for s in sink.spans}
    trace = outer.get_span_context().trace_id
    assert agl_spans["agl agent"].trace_id == format(trace, "032x")
    assert agl_spans["agl agent"].parent_id == format(outer.get_span_context().span_id, "016x")
    inner = users_spans["user inner"]
    assert inner.context.trace_id == trace and inner.parent.span_id == ours.get_span_context().span_id
    assert agl_spans["agl llm"].parent_id == format(inner.context.span_id, "016x")
    assert agl_spans["agl explicit"].parent_id == agl_spans["agl agent"].span_id
    assert agl_spans["agl root"].parent_id is None and agl_spans["agl root"].trace_id != format(trace, "032x")
    ids = [s.span_id for s in sink.spans]
    assert len(set(ids)) == len(ids) and all(len(i) == 16 and int(i, 16) for i in ids)
    context = ours.get_span_context()
    assert context.is_valid and context.trace_flags.sampled and not context.is_remote


def test_ended_spans_ignore_changes_and_attribute_values_are_cleaned(tracer):
    class Thing:
        def __str__(self):
            return "thing"

    t, sink = tracer
    with rollout_scope("ro-1", "at-1"):
        span = t.start_span("s", "chain", {"list": ["a", "b"], "obj": Thing()})
        span.set_attribute("map", {"k": (1, 2)})
        span.set_status(otel_trace.StatusCode.OK)
        span.set_status(otel_trace.StatusCode.ERROR, "too late: OK is final")
        span.end()
        span.set_attribute("after", 1)
        span.update_name("renamed")
        t.set_deferred(span, {semconv.OUTPUT_MESSAGES: []})
        span.end()
    assert t.flush(5)
    (written,) = sink.spans
    assert written.name == "s" and written.status == "ok" and written.error is None
    assert written.attributes["list"] == ["a", "b"] and written.attributes["map"] == {"k": (1, 2)}
    assert written.attributes["obj"] == "thing" and "after" not in written.attributes
    assert semconv.OUTPUT_MESSAGES not in written.attributes and t.stats().enqueued == 1


def test_start_hooks_see_each_new_span_once(tracer):
    t, sink = tracer
    seen = []

    def hook(span):
        seen.append(span.name)
        span.set_attribute("hooked", True)

    t.add_start_hook(hook)
    t.add_start_hook(hook)
    with rollout_scope("ro-1", "at-1"), t.span("a", "chain"):
        t.start_span("b", "tool").end()
    assert t.flush(5)
    assert seen == ["a", "b"] and all(s.attributes["hooked"] is True for s in sink.spans)


def test_spans_are_stamped_with_rollout_and_written_off_thread(tracer):
    t, sink = tracer
    with rollout_scope("ro-1", "at-1"):
        with t.span("outer", "agent", {semconv.AGENT_NAME: "writer"}) as outer:
            with t.span("inner", "tool"):
                pass
            t.set_deferred(
                outer,
                {semconv.INPUT_MESSAGES: [{"role": "user", "content": "hi"}], semconv.PROMPT_TOKEN_IDS: [1, 2, 3]},
            )
    assert t.flush(5)
    assert sink.threads == {"agl-span-writer"}
    inner, outer = sorted(sink.spans, key=lambda s: s.name)
    assert (outer.rollout_id, outer.attempt_id, outer.sequence_id) == ("ro-1", "at-1", 0)
    assert inner.sequence_id == 1 and inner.parent_id == outer.span_id and inner.trace_id == outer.trace_id
    assert outer.kind == "agent" and inner.kind == "tool"
    assert outer.attributes[semconv.PROMPT_TOKEN_IDS] == [1, 2, 3]
    assert json.loads(outer.attributes[semconv.INPUT_MESSAGES]) == [{"role": "user", "content": "hi"}]
    assert outer.end_time >= outer.start_time > 0


def test_spans_outside_rollouts_are_counted_not_stored(tracer):
    t, sink = tracer
    with t.span("loose", "chain"):
        pass
    assert t.flush(5)
    assert sink.spans == [] and t.stats().unscoped == 1


def test_queue_overflow_is_counted_and_warned(caplog):
    t = Tracer(max_queue=10, batch_size=1000)  # no store yet: spans wait in the queue
    with rollout_scope("ro-1", "at-1"):
        for i in range(25):
            with t.span(f"s{i}", "chain"):
                pass
    stats = t.stats()
    assert stats.enqueued == 10 and stats.dropped == 15
    assert "queue is full" in caplog.text
    sink = ListSink()
    t.set_store(sink)
    assert t.flush(5)
    assert len(sink.spans) == 10
    t.processor.shutdown()


def test_exceptions_mark_spans_as_errors_and_propagate(tracer):
    t, sink = tracer
    with rollout_scope("ro-1", "at-1"):
        with pytest.raises(ValueError, match="bad"):
            with t.span("failing", "tool"):
                raise ValueError("bad")
    assert t.flush(5)
    (span,) = sink.spans
    assert span.status == "error" and span.error == "ValueError: bad"
    assert span.attributes[semconv.ERROR_TYPE] == "ValueError"
    assert any(e.name == "exception" for e in span.events)


def test_store_errors_are_retried_and_nothing_is_lost(tracer):
    t, sink = tracer
    failures = {"left": 2}
    real = sink.add_spans

    def flaky(spans):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("store restarting")
        return real(spans)

    sink.add_spans = flaky
    with rollout_scope("ro-1", "at-1"):
        for i in range(5):
            with t.span(f"s{i}", "chain"):
                pass
    assert t.flush(10)
    assert sorted(s.name for s in sink.spans) == [f"s{i}" for i in range(5)]
    assert t.stats().export_errors == 2


def test_store_rejections_are_dropped_with_a_count(tracer):
    from agl.errors import UnknownRolloutError

    t, sink = tracer

    def refuse(spans):
        raise UnknownRolloutError("ro-gone")

    sink.add_spans = refuse
    with rollout_scope("ro-gone", "at-1"):
        with t.span("s", "chain"):
            pass
    assert t.flush(5)
    assert t.stats().rejected == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
def test_a_forked_child_gets_a_fresh_writer(tracer, tmp_path):
    t, _ = tracer
    with rollout_scope("ro-1", "at-1"):
        with t.span("parent-span", "chain"):
            pass
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # child: its own queue and thread; the parent's spans are not re-sent
        try:
            sink = ListSink()
            t.set_store(sink)
            with rollout_scope("ro-2", "at-1"):
                with t.span("child-span", "chain"):
                    pass
            ok = t.flush(5)
            out.write_text(f"{ok} {[s.name for s in sink.spans]}")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert out.read_text() == "True ['child-span']"


def test_store_ids_sort_by_time_and_follow_neither_the_agents_seed_nor_a_fork(tmp_path):
    """Rollout, task and attempt ids come from agl's own generator: reseeding `random` does not repeat them,
    and a forked child (a runner process) does not draw its parent's next ids."""
    import random

    from agl.types import new_id

    seeded = []
    for _ in range(3):
        random.seed(7)
        seeded.append(new_id("ro"))
    assert len(set(seeded)) == 3 and all(len(i) == len("ro-") + 20 for i in seeded)
    earlier = new_id("ro")
    time.sleep(1.01)
    assert new_id("ro") > earlier  # ids sort by the second they were made: index inserts stay at the right edge
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:
        try:
            out.write_text(" ".join(new_id("ro") for _ in range(5)))
        finally:
            os._exit(0)
    parent = {new_id("ro") for _ in range(5)}
    os.waitpid(pid, 0)
    assert not parent & set(out.read_text().split())


def test_a_value_that_cannot_be_encoded_is_marked_and_the_writer_goes_on(tracer):
    t, sink = tracer

    def broken():
        raise RuntimeError("payload builder failed")

    with rollout_scope("ro-1", "at-1"):
        with t.span("bad", "llm") as span:
            t.set_deferred(span, {semconv.OUTPUT_MESSAGES: Computed(broken)})
        with t.span("good", "llm") as span:
            t.set_deferred(span, {semconv.OUTPUT_MESSAGES: Computed(lambda: [{"role": "assistant"}]), "x": {1, 2}})
    assert t.flush(5)
    bad, good = sink.spans
    assert bad.attributes[semconv.OUTPUT_MESSAGES] == "agl-encode-error: RuntimeError: payload builder failed"
    assert json.loads(good.attributes[semconv.OUTPUT_MESSAGES]) == [{"role": "assistant"}]
    assert json.loads(good.attributes["x"]) == [1, 2]


def test_agl_records_with_the_opentelemetry_sdk_disabled(tmp_path):
    """OTEL_SDK_DISABLED=true (which CrewAI honours for its telemetry) switches off OpenTelemetry SDK
    providers; agl implements the API itself, so its spans are still recorded (docs/integrations/crewai.md)."""
    import subprocess
    import sys

    script = (
        "import agl\n"
        "from agl.store import SqliteLightningStore\n"
        f"store = SqliteLightningStore({str(tmp_path / 's.db')!r})\n"
        "done = agl.Trainer(store=store, n_runners=1, runner_mode='thread', progress=False).dev("
        "agl.rollout(lambda task: agl.emit_message('hi') or 1.0), [{'n': 1}], print_table=False)\n"
        "print(done[0].spans)\n"
    )
    env = {**os.environ, "OTEL_SDK_DISABLED": "true"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) >= 3  # the rollout, the message and the reward


def test_a_callable_value_is_stored_as_a_value_and_never_called(tracer):
    """A tool that returns a function or a callable object (a pending order, a handle): the writer called it,
    on its own thread, with whatever side effects it had, and stored what it returned instead."""
    t, sink = tracer
    calls = []

    class Pending:
        def __call__(self) -> str:
            calls.append(threading.current_thread().name)
            return "called!"

        def __str__(self) -> str:
            return "<pending order>"

    with rollout_scope("ro-1", "at-1"):
        with t.span("tool", "tool") as span:
            t.set_deferred(span, {semconv.TOOL_CALL_RESULT: Pending(), "fn": len})
    assert t.flush(5)
    (span,) = sink.spans
    assert calls == [] and json.loads(span.attributes[semconv.TOOL_CALL_RESULT]) == "<pending order>"
    assert json.loads(span.attributes["fn"]) == str(len)  # an unknown object is stored as its str()


def test_a_span_the_store_refuses_is_dropped_alone_and_its_batch_is_kept(tmp_path):
    from agl.store import SqliteLightningStore

    store = SqliteLightningStore(tmp_path / "s.db")
    rollout = store.enqueue_rollout({"q": 1})
    attempt = store.dequeue_rollout("r1").attempt
    t = Tracer(batch_size=100)
    with rollout_scope(rollout.rollout_id, attempt.attempt_id):
        for name in ("a", "bad", "c"):
            with t.span(name, "chain") as span:
                if name == "bad":  # passes the tracer's quick number-list check, fails JSON in the store
                    t.set_deferred(span, {"weird": [1, object(), 2]})
    t.set_store(store)
    assert t.flush(5)
    assert sorted(s.name for s in store.query_spans(rollout.rollout_id)) == ["a", "c"]
    assert t.stats().rejected == 1 and t.stats().exported == 2
    t.processor.shutdown()
    store.close()


def test_written_spans_are_complete_pydantic_spans(tracer):
    """The writer builds spans without validation (speed); they must equal validated ones field by field."""
    t, sink = tracer
    with rollout_scope("ro-1", "at-1"):
        with pytest.raises(ValueError):
            with t.span("step", "chain", {"n": 1, "tags": ("a", "b")}) as span:
                span.add_event("note", {"k": 2})
                t.set_deferred(
                    span,
                    {
                        semconv.OUTPUT_MESSAGES: [{"role": "assistant", "content": "x"}],
                        semconv.RESPONSE_TOKEN_IDS: (5, 6),
                    },
                )
                raise ValueError("boom")
    assert t.flush(5)
    (written,) = sink.spans
    validated = agl.types.Span.model_validate(written.model_dump())
    assert validated == written
    assert written.model_fields_set == set(agl.types.Span.model_fields)
    assert written.attributes["tags"] == ["a", "b"] and written.attributes[semconv.RESPONSE_TOKEN_IDS] == [5, 6]
    assert written.status == "error" and written.error == "ValueError: boom"
    assert [e.name for e in written.events] == ["note", "exception"] and written.events[0].attributes == {"k": 2}


def test_spans_are_recorded_under_a_parent_the_users_tracing_did_not_sample(tracer, monkeypatch):
    """The user's provider may sample (or OTEL_TRACES_SAMPLER may say so); training spans must not be lost."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    t = Tracer(max_queue=100, batch_size=10)
    sink = ListSink()
    t.set_store(sink)
    users = TracerProvider(sampler=ALWAYS_OFF).get_tracer("user")
    with rollout_scope("ro-1", "at-1"):
        with users.start_as_current_span("user's unsampled request"):
            with t.span("chat", "llm"):
                pass
    assert t.flush(5)
    assert [s.name for s in sink.spans] == ["chat"]
    t.processor.shutdown()


def test_span_ids_do_not_repeat_when_the_agent_reseeds_random(tracer):
    """Agents seed `random` for reproducibility; agl's ids must not follow (repeats would be dropped)."""
    import random

    t, sink = tracer
    with rollout_scope("ro-1", "at-1"):
        for _ in range(3):
            random.seed(1234)
            with t.span("call", "llm"):
                pass
    assert t.flush(5)
    assert len({s.span_id for s in sink.spans}) == 3


class BlockingSink(ListSink):
    """A store whose writes hang until released, like a store server's client riding out an outage."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def add_spans(self, spans):
        self.entered.set()
        self.release.wait(30)
        try:
            return super().add_spans(spans)
        finally:
            self.returned.set()


def tracer_writing_a_span_to(old: ListSink) -> Tracer:
    """A Tracer on store ``old`` that has just ended a span "old" of rollout ro-old (its write is under way)."""
    t = Tracer(batch_size=64)
    t.set_store(old)
    with rollout_scope("ro-old", "at-1"):
        with t.span("old", "chain"):
            pass
    return t


def test_a_new_store_is_not_held_up_by_a_write_stuck_on_the_store_it_replaces(caplog):
    """A second Trainer in the same process, after the first one's store server went away, waited up to the
    old client's outage timeout (10 minutes) before any of its spans were stored."""
    old, new = BlockingSink(), ListSink()
    t = tracer_writing_a_span_to(old)
    assert old.entered.wait(5)
    t.set_store(new)
    assert not old.returned.is_set(), "set_store waited for the write stuck on the old store"
    with rollout_scope("ro-new", "at-1"):
        for i in range(3):
            with t.span(f"new{i}", "chain"):
                pass
    assert t.flush(5), "the new store's spans waited for the stuck write to the old store"
    assert sorted(s.name for s in new.spans) == ["new0", "new1", "new2", "old"]  # the stuck batch is offered too
    assert "abandoned" in caplog.text
    old.release.set()  # the abandoned call ends: its thread must leave the queue alone
    time.sleep(0.5)
    with rollout_scope("ro-new", "at-1"):
        with t.span("later", "chain"):
            pass
    assert t.flush(5)
    assert sorted(s.name for s in new.spans) == ["later", "new0", "new1", "new2", "old"]
    t.processor.shutdown()


def test_a_store_replaced_during_a_quick_write_gets_no_duplicates(caplog):
    """The replaced store's write in progress is let finish (no warning, its batch is not written twice)."""

    class SlowSink(ListSink):
        def __init__(self):
            super().__init__()
            self.entered = threading.Event()

        def add_spans(self, spans):
            self.entered.set()
            time.sleep(0.3)
            return super().add_spans(spans)

    old, new = SlowSink(), ListSink()
    t = tracer_writing_a_span_to(old)
    assert old.entered.wait(5)
    t.set_store(new)
    with rollout_scope("ro-new", "at-1"):
        with t.span("new", "chain"):
            pass
    assert t.flush(5)
    assert [s.name for s in old.spans] == ["old"] and [s.name for s in new.spans] == ["new"]
    assert "abandoned" not in caplog.text
    t.processor.shutdown()


def test_spans_reach_a_new_store_while_the_old_store_server_is_down(tmp_path, caplog):
    """The real case: the writer was inside RemoteLightningStore's outage retries (server stopped)."""
    import socket

    from agl.store import SqliteLightningStore
    from agl.store.http.client import RemoteLightningStore

    with socket.socket() as sock:  # a port nobody listens on: connections are refused, as after a server stops
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    remote = RemoteLightningStore(f"http://127.0.0.1:{port}", retries=1, outage_timeout=600)
    t = Tracer(batch_size=64)
    t.set_store(remote)
    with rollout_scope("ro-gone", "at-1"):
        with t.span("lost-server", "chain"):
            pass
    deadline = time.monotonic() + 10
    while "still trying" not in caplog.text and time.monotonic() < deadline:  # the client is riding out the outage
        time.sleep(0.05)
    store = SqliteLightningStore(tmp_path / "s.db")
    rollout = store.enqueue_rollout({"q": 1})
    attempt = store.dequeue_rollout("r1").attempt
    t.set_store(store)
    with rollout_scope(rollout.rollout_id, attempt.attempt_id):
        with t.span("stored", "chain"):
            pass
    assert t.flush(10)
    assert [s.name for s in store.query_spans(rollout.rollout_id)] == ["stored"]
    assert t.stats().rejected == 1  # the old rollout's span: the new store does not know its rollout
    remote.close()
    t.processor.shutdown()
    store.close()
