"""The tracer's writer process (``set_writer("process")``): spans reach a real SQLite store from a child
process, and a child that dies, a store it cannot share, or a fork lose nothing."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest

from agl import semconv
from agl.store import InMemoryLightningStore, SqliteLightningStore
from agl.tracing.context import rollout_scope
from agl.tracing.encoding import Computed
from agl.tracing.tracer import Tracer


@pytest.fixture()
def store(tmp_path):
    s = SqliteLightningStore(tmp_path / "spans.db")
    yield s
    s.close()


def new_attempt(store):
    rollout = store.enqueue_rollout({"q": 1})
    return rollout.rollout_id, store.dequeue_rollout("r1").attempt.attempt_id


def make_spans(tracer, rollout_id, attempt_id, n, prefix="s"):
    with rollout_scope(rollout_id, attempt_id):
        for i in range(n):
            with tracer.span(f"{prefix}{i}", "llm") as span:
                tracer.set_deferred(
                    span,
                    {
                        semconv.RESPONSE_TOKEN_IDS: (i, i + 1),
                        semconv.INPUT_MESSAGES: [{"role": "user", "content": f"q{i}"}],
                        semconv.RESPONSE_LOGPROBS: Computed(lambda i=i: [-0.5 * i]),  # computed before it is pickled
                    },
                )


@pytest.fixture()
def tracer(store):
    t = Tracer(batch_size=16, writer="process")
    t.set_store(store)
    yield t
    t.processor.shutdown()


def test_spans_are_written_by_a_child_process(tracer, store):
    pid = tracer.processor.writer_pid
    assert pid is not None and pid != os.getpid()
    rollout_id, attempt_id = new_attempt(store)
    make_spans(tracer, rollout_id, attempt_id, 100)
    assert tracer.flush(30)
    spans = store.query_spans(rollout_id)
    assert sorted(s.name for s in spans) == sorted(f"s{i}" for i in range(100))
    by_name = {s.name: s for s in spans}
    assert by_name["s7"].attributes[semconv.RESPONSE_TOKEN_IDS] == [7, 8]
    assert by_name["s7"].attributes[semconv.RESPONSE_LOGPROBS] == [-3.5]
    assert json.loads(by_name["s7"].attributes[semconv.INPUT_MESSAGES]) == [{"role": "user", "content": "q7"}]
    stats = tracer.stats()
    assert (stats.exported, stats.rejected, stats.dropped) == (100, 0, 0)
    assert tracer.processor.writer_pid == pid  # one child serves the store for good


def test_a_killed_writer_process_loses_nothing(tracer, store, caplog):
    """The child is stopped with batches in its pipe, then killed: the unacknowledged batches go back to the
    queue and the writer thread stores them; later spans are stored too."""
    rollout_id, attempt_id = new_attempt(store)
    make_spans(tracer, rollout_id, attempt_id, 40, "before")
    assert tracer.flush(30)
    pid = tracer.processor.writer_pid
    os.kill(pid, signal.SIGSTOP)
    make_spans(tracer, rollout_id, attempt_id, 200, "during")  # shipped into the pipe, never acknowledged
    assert tracer.processor._in_flight, "the test must kill the child with batches in flight"
    with caplog.at_level(logging.WARNING, logger="agl.tracing.tracer"):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while tracer.processor.writer_pid is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        make_spans(tracer, rollout_id, attempt_id, 30, "after")
        assert tracer.flush(30)
    assert tracer.processor.writer_pid is None
    names = [s.name for s in store.query_spans(rollout_id)]
    assert len(names) == len(set(names)) == 270
    assert f"span writer process {pid} exited" in caplog.text and "nothing is lost" in caplog.text
    assert tracer.stats().dropped == 0


def test_a_store_other_processes_cannot_share_keeps_the_thread(caplog):
    store = InMemoryLightningStore()
    t = Tracer(writer="process")
    with caplog.at_level(logging.WARNING, logger="agl.tracing.tracer"):
        t.set_store(store)
    assert t.processor.writer_pid is None
    assert "InMemoryLightningStore is not" in caplog.text
    rollout_id, attempt_id = new_attempt(store)
    make_spans(t, rollout_id, attempt_id, 5)
    assert t.flush(10)
    assert len(store.query_spans(rollout_id)) == 5
    t.processor.shutdown()


def test_writer_mode_is_checked_and_read_from_the_environment(monkeypatch, store):
    with pytest.raises(ValueError, match="thread, process"):
        Tracer(writer="fork")
    monkeypatch.setenv("AGL_SPAN_WRITER", "process")
    t = Tracer()
    t.set_store(store)
    assert t.processor.writer_pid is not None
    t.set_writer("thread")  # the child writes what it was sent, then exits
    assert t.processor.writer_pid is None
    rollout_id, attempt_id = new_attempt(store)
    make_spans(t, rollout_id, attempt_id, 20)
    assert t.flush(10) and len(store.query_spans(rollout_id)) == 20
    t.processor.shutdown()


def test_a_new_store_gets_a_new_writer_process_after_the_old_one_finished(tracer, store, tmp_path):
    rollout_id, attempt_id = new_attempt(store)
    make_spans(tracer, rollout_id, attempt_id, 50)
    first = tracer.processor.writer_pid
    other = SqliteLightningStore(tmp_path / "other.db")
    tracer.set_store(other)  # the first child writes its 50 spans into the first store before it exits
    assert len(store.query_spans(rollout_id)) + len(tracer.processor._queue) == 50
    assert tracer.processor.writer_pid not in (None, first)
    other_rollout, other_attempt = new_attempt(other)
    make_spans(tracer, other_rollout, other_attempt, 10)
    assert tracer.flush(30)
    assert len(store.query_spans(rollout_id)) == 50 and len(other.query_spans(other_rollout)) == 10
    other.close()


def test_a_forked_child_writes_its_own_spans_and_leaves_the_parents_writer_alone(tracer, store):
    rollout_id, attempt_id = new_attempt(store)
    child_rollout, child_attempt = new_attempt(store)
    make_spans(tracer, rollout_id, attempt_id, 10, "parent")
    assert tracer.flush(30)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            make_spans(tracer, child_rollout, child_attempt, 20, "child")
            code = 0 if tracer.flush(30) and tracer.processor.writer_pid is None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(store.query_spans(child_rollout)) == 20
    make_spans(tracer, rollout_id, attempt_id, 10, "later")
    assert tracer.flush(30) and tracer.processor.writer_pid is not None
    assert len(store.query_spans(rollout_id)) == 20
