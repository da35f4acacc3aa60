"""OTLP export: agl's spans of a real instrumented agent (Trainer.dev against the fake OpenAI server, with a tool)
arrive complete at a real OTLP/HTTP receiver on 127.0.0.1, with the GenAI and OpenInference attributes; `agl export
--otlp` sends stored rollouts; an endpoint that is down does not fail the rollouts."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from ui_run import TASKS, solver

import agl
from agl import semconv
from agl.cli import main as agl_main
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer
from agl.testing.otlp_receiver import OtlpReceiver, ReceivedSpan, decode
from agl.testing.waiting import eventually
from agl.tracing import openinference as oi
from agl.tracing.otlp import encode
from agl.tracing.tracer import Tracer, get_tracer
from agl.types import Span


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def dead_endpoint() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/traces"


def run_dev(fake_openai: FakeOpenAIServer, fake_trainer: Any, store_path: Path, **instrument: Any) -> List[Span]:
    """``Trainer.dev`` of the planner/solver agent with its ``add`` tool over two tasks, instrumented with
    ``instrument`` (the OTLP settings); returns every stored span. The fake server returns token ids."""
    fake_openai.always_token_ids = True
    agl.instrument(**instrument)
    try:
        trainer = fake_trainer(str(store_path), model="fake-model")
        summaries = trainer.dev(solver, TASKS[:2], print_table=False)
        assert [s.status for s in summaries] == ["succeeded", "succeeded"]
        store = trainer.store
        spans = [s for r in store.query_rollouts() for s in store.query_spans(r.rollout_id, None)]
        otlp = get_tracer().otlp
        assert (otlp is not None) == ("otlp_endpoint" in instrument)
        if otlp is not None:
            assert otlp.flush(30)
        return spans
    finally:
        agl.uninstrument()


def plain(value: Any) -> Any:
    """A stored attribute value as OTLP carries it (tuples are arrays; dicts JSON text)."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return json.dumps(value)
    return value


def check_complete(stored: List[Span], received: Dict[str, ReceivedSpan]) -> None:
    """Every stored span arrived once, with its ids, parent link, times, status and every agl attribute."""
    assert set(received) == {s.span_id for s in stored}
    for span in stored:
        got = received[span.span_id]
        assert (got.trace_id, got.parent_id, got.name) == (span.trace_id, span.parent_id, span.name)
        assert (got.start_time, got.end_time) == (span.start_time, span.end_time)
        assert got.resource["service.name"] == "agl"
        for key, value in span.attributes.items():
            assert got.attributes[key] == plain(value), key
        assert got.attributes[semconv.OTLP_ROLLOUT_ID] == span.rollout_id
        assert got.attributes[semconv.OTLP_ATTEMPT_ID] == span.attempt_id
        assert got.attributes[semconv.OTLP_SEQUENCE_ID] == span.sequence_id
        assert got.attributes[oi.SPAN_KIND] == oi.KINDS[span.kind]


def check_openinference(stored: List[Span], received: Dict[str, ReceivedSpan]) -> None:
    """The OpenInference attributes Phoenix shows: LLM messages, tool calls, token counts; tools; agents."""
    llm = [s for s in stored if s.kind == "llm"]
    assert len(llm) == 6  # per task: the planner's call and the solver's two
    for span in llm:
        got = received[span.span_id].attributes
        prompt, response = span.attributes[semconv.PROMPT_TOKEN_IDS], span.attributes[semconv.RESPONSE_TOKEN_IDS]
        assert got[semconv.PROMPT_TOKEN_IDS] == list(prompt) and len(prompt) > 0
        assert got[semconv.RESPONSE_TOKEN_IDS] == list(response) and len(response) > 0
        assert got[oi.TOKEN_COUNT_PROMPT] == span.attributes[semconv.USAGE_INPUT_TOKENS]
        assert got[oi.TOKEN_COUNT_TOTAL] == got[oi.TOKEN_COUNT_PROMPT] + got[oi.TOKEN_COUNT_COMPLETION]
        assert got[oi.LLM_MODEL_NAME] == "fake-model"
        inputs = json.loads(span.attributes[semconv.INPUT_MESSAGES])
        for i, message in enumerate(inputs):
            assert got[f"llm.input_messages.{i}.message.role"] == message["role"]
        assert got["llm.input_messages.0.message.content"] == inputs[0]["content"]
        assert got["llm.output_messages.0.message.role"] == "assistant"
        assert got[oi.INPUT_VALUE] == span.attributes[semconv.INPUT_MESSAGES]
        assert got[oi.INPUT_MIME_TYPE] == "application/json"
    with_tools = [received[s.span_id].attributes for s in llm if semconv.TOOL_DEFINITIONS in s.attributes]
    assert len(with_tools) == 2
    for got in with_tools:
        assert got["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "add"
        assert json.loads(got["llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments"])
        assert json.loads(got["llm.tools.0.tool.json_schema"])["function"]["name"] == "add"
    answers = [a for a in (received[s.span_id].attributes for s in llm) if "llm.input_messages.2.message.role" in a]
    assert answers and all(a["llm.input_messages.2.message.role"] == "tool" for a in answers)
    assert all(a["llm.input_messages.2.message.tool_call_id"] for a in answers)
    tools = [s for s in stored if s.kind == "tool"]
    assert len(tools) == 2
    for span in tools:
        got = received[span.span_id].attributes
        assert got[oi.TOOL_NAME] == "add"
        assert json.loads(got[oi.TOOL_PARAMETERS]) == json.loads(span.attributes[semconv.TOOL_CALL_ARGUMENTS])
        assert json.loads(got[oi.OUTPUT_VALUE]) == span.attributes[semconv.TOOL_CALL_RESULT]  # as text
    planners = [received[s.span_id].attributes for s in stored if s.kind == "agent" and s.name == "planner"]
    assert [a[oi.AGENT_NAME] for a in planners] == ["planner", "planner"]


def test_instrumented_run_arrives_complete_at_an_otlp_receiver(
    fake_openai: FakeOpenAIServer, fake_trainer: Any, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    stored = run_dev(
        fake_openai, fake_trainer, tmp_path / "store.db", otlp_endpoint=receiver.url, otlp_headers={"x-team": "a"}
    )
    assert get_tracer().otlp is None  # uninstrument() stops the export
    check_complete(stored, receiver.spans)
    check_openinference(stored, receiver.spans)
    assert {kinds for kinds in (s.kind for s in stored)} >= {"llm", "tool", "agent", "reward"}
    assert all(h.get("x-team") == "a" for h in receiver.headers)


def test_runner_processes_send_their_last_spans_before_they_leave(
    fake_openai: FakeOpenAIServer, fake_trainer: Any, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """A runner process leaves with os._exit, which skips the exporter's exit hook: it sends what is queued first,
    so every span is at the receiver when the run returns."""
    fake_openai.always_token_ids = True
    agl.instrument(otlp_endpoint=receiver.url)
    try:
        trainer = fake_trainer(str(tmp_path / "store.db"), model="fake-model", runner_mode="process", n_runners=2)
        summaries = trainer.dev(solver, TASKS[:2], print_table=False)
    finally:
        agl.uninstrument()
    assert [s.status for s in summaries] == ["succeeded", "succeeded"]
    store = trainer.store
    stored = [s for r in store.query_rollouts() for s in store.query_spans(r.rollout_id, None)]
    check_complete(stored, receiver.spans)


def test_export_otlp_sends_stored_rollouts(
    fake_openai: FakeOpenAIServer, fake_trainer: Any, receiver: OtlpReceiver, tmp_path: Path, capsys: Any
) -> None:
    path = tmp_path / "store.db"
    stored = run_dev(fake_openai, fake_trainer, path)
    assert receiver.requests == 0
    store = SqliteLightningStore(str(path))
    first = store.query_rollouts()[0].rollout_id
    store.close()

    assert agl_main(["export", "--otlp", receiver.url, "--rollout", first, "--store", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    own = [s for s in stored if s.rollout_id == first]
    assert out[0].startswith(f"sent rollout {first} (succeeded") and out[0].endswith(f": {len(own)} spans")
    assert out[-1] == f"sent {len(own)} spans of 1 rollouts to {receiver.url}"
    check_complete(own, receiver.spans)

    receiver.spans.clear()
    assert agl_main(["export", "--otlp", receiver.url, "--store", str(path)]) == 0  # every finished rollout
    assert len(capsys.readouterr().out.splitlines()) == 3
    check_complete(stored, receiver.spans)
    check_openinference(stored, receiver.spans)


def test_export_otlp_to_a_dead_endpoint_is_one_line_and_exit_1(
    fake_openai: FakeOpenAIServer, fake_trainer: Any, tmp_path: Path, capsys: Any
) -> None:
    path = tmp_path / "store.db"
    stored = run_dev(fake_openai, fake_trainer, path)
    url = dead_endpoint()
    with pytest.raises(SystemExit) as exc:
        agl_main(["export", "--otlp", url, "--store", str(path)])
    message = str(exc.value.code)
    assert message.startswith("agl: cannot send rollout ") and "ConnectError" in message
    assert "\n" not in message and "0 rollouts were sent" in message
    store = SqliteLightningStore(str(path))
    assert len([s for r in store.query_rollouts() for s in store.query_spans(r.rollout_id, None)]) == len(stored)
    store.close()
    with pytest.raises(SystemExit) as bad:
        agl_main(["export", "--otlp", "127.0.0.1:4318", "--store", str(path)])
    assert "must be an http(s) URL" in str(bad.value.code)


def test_a_dead_endpoint_does_not_fail_the_rollouts(
    fake_openai: FakeOpenAIServer, fake_trainer: Any, tmp_path: Path, caplog: Any
) -> None:
    url = dead_endpoint()
    caplog.set_level(logging.WARNING, logger="agl.tracing.otlp")
    fake_openai.always_token_ids = True
    agl.instrument(otlp_endpoint=url)
    try:
        trainer = fake_trainer(str(tmp_path / "store.db"), model="fake-model")
        summaries = trainer.dev(solver, TASKS[:2], print_table=False)
        otlp = get_tracer().otlp
        assert otlp is not None
        eventually(lambda: otlp.stats.failed_sends >= 2, 30, "two failed sends to the dead endpoint")
    finally:
        agl.uninstrument()
    assert [s.status for s in summaries] == ["succeeded", "succeeded"]
    store = trainer.store
    assert all(store.query_spans(r.rollout_id) for r in store.query_rollouts())  # the store has every rollout's spans
    warnings = [r.getMessage() for r in caplog.records if r.name == "agl.tracing.otlp"]
    assert len(warnings) == 1  # at most one line a minute, however many sends failed
    assert warnings[0].startswith("agl could not send") and url in warnings[0]
    assert otlp.stats.sent == 0


def test_otlp_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver) -> None:
    monkeypatch.setenv("AGL_OTLP_ENDPOINT", receiver.url.removesuffix("/v1/traces"))
    monkeypatch.setenv("AGL_OTLP_HEADERS", "authorization=Bearer x, x-team=a")
    tracer = Tracer()
    assert tracer.otlp is not None
    assert tracer.otlp.endpoint == receiver.url  # a bare host gets /v1/traces
    assert tracer.otlp.headers == {"authorization": "Bearer x", "x-team": "a"}
    tracer.set_otlp(None)
    assert tracer.otlp is None


def test_bad_otlp_settings_are_one_line(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("AGL_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("AGL_OTLP_HEADERS", "no-equals-sign")
    caplog.set_level(logging.ERROR, logger="agl.tracing.otlp")
    assert Tracer().otlp is None  # the tracer still works: agl records to the store
    assert "k=v pairs" in caplog.records[-1].getMessage()
    with pytest.raises(ValueError, match="must be an http"):
        agl.instrument(otlp_endpoint="localhost:4318")
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.collector.trace.v1.trace_service_pb2", None)
    with pytest.raises(ImportError, match=r'pip install "agl\[otlp\]"'):
        get_tracer().set_otlp("http://127.0.0.1:4318/v1/traces")
    assert get_tracer().otlp is None


def test_a_script_that_exits_at_once_still_sends_its_last_spans(
    fake_openai: FakeOpenAIServer, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """The exporter sends a batch a second; a script's last spans go out at interpreter exit."""
    script = tmp_path / "run.py"
    script.write_text(
        "import agl\n"
        "from ui_run import TASKS, solver\n"
        f"agl.instrument(otlp_endpoint={receiver.url!r})\n"
        f"llm = agl.LLM(endpoint={fake_openai.base_url!r}, model='fake-model')\n"
        f"trainer = agl.Trainer(store={str(tmp_path / 'store.db')!r}, runner_mode='thread', "
        "initial_resources={'main_llm': llm}, progress=False)\n"
        "trainer.dev(solver, TASKS[:1], print_table=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}  # where ui_run is
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    store = SqliteLightningStore(str(tmp_path / "store.db"))
    stored = [s for r in store.query_rollouts() for s in store.query_spans(r.rollout_id, None)]
    store.close()
    check_complete(stored, receiver.spans)


def test_attribute_values_round_trip_through_the_protobuf_encoding() -> None:
    """Token ids and logprobs take a hand-encoded fast path: every int64 and float comes back as it was sent."""
    values: Dict[str, Any] = {
        "ids": [0, 1, 127, 128, 16_383, 16_384, 151_643, 2**40, 2**63 - 1, -1, -(2**63)],
        "too_big": [1, 2**70],  # past int64: sent as text, not wrapped
        "logprobs": [-0.5, -1e-9, 0.0, -123.456],
        "mixed": [1, "a", True, 2.5],
        "flags": [True, False],
        "object": {"a": 1},
        "text": "x",
    }
    span = Span(
        rollout_id="r",
        attempt_id="a",
        sequence_id=1,
        trace_id="1" * 32,
        span_id="2" * 16,
        name="chat",
        kind="llm",
        start_time=1,
        end_time=2,
        attributes=values,
    )
    (got,) = decode(encode([span]))
    expected = {**values, "too_big": [1, str(2**70)], "object": '{"a": 1}'}
    assert {key: got.attributes[key] for key in values} == expected
