"""Span ingestion over HTTP: OTLP/HTTP exports (JSON and protobuf) and agl's own /v1/spans, plus fuzzing.

``data/otlp_export.pb`` and ``data/otlp_export.json`` are the bodies the real OpenTelemetry exporters
(opentelemetry-exporter-otlp-proto-http 1.45.2 and opentelemetry-exporter-otlp-json-http 0.66b1) sent for
a small agent trace, with ``agl.rollout.id=ro-000000000000`` and ``agl.attempt.id=at-000000000000`` as
resource attributes. The test's own ids are swapped in (in the protobuf body with its lengths re-encoded).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.store import SqliteLightningStore
from agl.store.http.otlp import _pb_bytes_field, _pb_varint, _read_varint
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.types import Rollout

DATA = Path(__file__).parent / "data"
DATA_FILES = ("otlp_export.pb", "otlp_export.json")
TOKEN = "otlp-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
PB = {**HEADERS, "Content-Type": "application/x-protobuf"}
JS = {**HEADERS, "Content-Type": "application/json"}


class Ingest:
    def __init__(self, path: Path) -> None:
        self.store = SqliteLightningStore(path)
        self.server = ServerThread(create_app(self.store, tokens=TokenSet({"t": TOKEN}))).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=30)

    def running(self) -> Rollout:
        self.store.enqueue_rollout("x")
        rollout = self.store.dequeue_rollout("runner")
        assert rollout is not None and rollout.attempt is not None
        return rollout

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        self.store.close()


@pytest.fixture(scope="module")
def ingest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ingest]:
    served = Ingest(tmp_path_factory.mktemp("otlp") / "store.db")
    yield served
    served.close()


def fixture_for(rollout: Rollout, name: str) -> bytes:
    assert rollout.attempt is not None
    body = (DATA / name).read_bytes()
    body = swap(body, name, b"ro-000000000000", rollout.rollout_id.encode())
    return swap(body, name, b"at-000000000000", rollout.attempt.attempt_id.encode())


def swap(body: bytes, name: str, old: bytes, new: bytes) -> bytes:
    """``body`` (a fixture named ``name``, or made from one) with the id ``old`` replaced by ``new``."""
    return _pb_swap(body, old, new) if name.endswith(".pb") else body.replace(old, new)


def _pb_swap(message: bytes, old: bytes, new: bytes) -> bytes:
    """A protobuf message with every length-delimited field equal to ``old`` set to ``new``: fields holding it
    deeper are parsed as messages in turn, and every length on the way is re-encoded."""
    out, pos = bytearray(), 0
    while pos < len(message):
        key, start = _read_varint(message, pos)
        wire = key & 7
        if wire != 2:
            end = _read_varint(message, start)[1] if wire == 0 else start + (8 if wire == 1 else 4)
            out += message[pos:end]
            pos = end
            continue
        size, start = _read_varint(message, start)
        payload, pos = message[start : start + size], start + size
        payload = new if payload == old else _pb_swap(payload, old, new) if old in payload else payload
        out += _pb_varint(key) + _pb_varint(len(payload)) + payload
    return bytes(out)


def summary(spans: List[Any]) -> List[Tuple[Any, ...]]:
    return sorted((s.name, s.kind, s.status, s.error, s.parent_id is None, len(s.events)) for s in spans)


@pytest.mark.parametrize("name, headers", [("otlp_export.pb", PB), ("otlp_export.json", JS)], ids=["protobuf", "json"])
def test_real_exporter_bodies_are_stored_as_agl_spans(ingest: Ingest, name: str, headers: Dict[str, str]) -> None:
    rollout = ingest.running()
    response = ingest.http.post("/v1/traces", content=fixture_for(rollout, name), headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == headers["Content-Type"]
    assert response.content in (b"", b"{}"), "full success: an empty ExportTraceServiceResponse"
    spans = ingest.store.query_spans(rollout.rollout_id)
    assert summary(spans) == [
        ("chat tiny", "llm", "unset", None, False, 1),
        ("execute_tool calc", "tool", "error", "division by zero", False, 0),
        ("invoke_agent solver", "agent", "unset", None, True, 0),
    ]
    chat = next(s for s in spans if s.kind == "llm")
    assert chat.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "tiny",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.request.temperature": 0.5,
        "agl.llm.stream": False,
        "agl.llm.prompt_token_ids": [1, 2, 3],
        "gen_ai.response.finish_reasons": ["stop"],
        "otel.scope.name": "fixture-lib",
        "otel.scope.version": "1.2.3",
    }, "agl.sequence.id became the sequence id and left the attributes"
    assert (
        chat.sequence_id == 7 and chat.events[0].name == "first_token" and chat.events[0].attributes == {"delay_ms": 3}
    )
    root = next(s for s in spans if s.parent_id is None)
    assert {s.parent_id for s in spans if s is not root} == {root.span_id} and len({s.trace_id for s in spans}) == 1
    assert all(len(s.span_id) == 16 and s.start_time <= s.end_time for s in spans)
    again = ingest.http.post(
        "/v1/traces", content=gzip.compress(fixture_for(rollout, name)), headers={**headers, "Content-Encoding": "gzip"}
    )
    assert again.status_code == 200 and len(ingest.store.query_spans(rollout.rollout_id)) == 3, (
        "re-sent spans are ignored"
    )


def test_spans_without_agl_ids_are_reported_as_partial_success(ingest: Ingest) -> None:
    rollout = ingest.running()
    assert rollout.attempt is not None
    ids = [
        {"key": "agl.rollout.id", "value": {"stringValue": rollout.rollout_id}},
        {"key": "agl.attempt.id", "value": {"stringValue": rollout.attempt.attempt_id}},
    ]

    def span(span_id: str, attributes: List[Any]) -> Dict[str, Any]:
        return {
            "traceId": "a" * 32,
            "spanId": span_id,
            "name": "s",
            "startTimeUnixNano": "5",
            "endTimeUnixNano": "6",
            "attributes": attributes,
        }

    body = {"resourceSpans": [{"scopeSpans": [{"spans": [span("1" * 16, ids), span("2" * 16, [])]}]}]}
    response = ingest.http.post("/v1/traces", json=body, headers=HEADERS)
    assert response.status_code == 200
    partial = response.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "1" and "agl.rollout.id" in partial["errorMessage"]
    assert [s.span_id for s in ingest.store.query_spans(rollout.rollout_id)] == ["1" * 16]
    # the same answer in protobuf: ExportTraceServiceResponse{partial_success{rejected_spans=1, error_message}}
    pb_span = _pb_bytes_field(1, bytes.fromhex("b" * 32)) + _pb_bytes_field(2, bytes.fromhex("3" * 16))
    pb_body = _pb_bytes_field(1, _pb_bytes_field(2, _pb_bytes_field(2, pb_span)))
    answer = ingest.http.post("/v1/traces", content=pb_body, headers=PB)
    assert answer.status_code == 200 and answer.content.startswith(b"\x0a") and b"agl.attempt.id" in answer.content


def test_bad_otlp_requests_get_4xx_and_store_nothing(ingest: Ingest) -> None:
    rollout = ingest.running()
    before = ingest.store.stats()
    real_id = rollout.rollout_id.encode()
    ghost = {name: swap(fixture_for(rollout, name), name, real_id, b"ro-ghost") for name in DATA_FILES}
    cases = [
        (ghost["otlp_export.json"], JS, 404, "'ro-ghost'"),
        (ghost["otlp_export.pb"], PB, 404, "ro-ghost"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "1"}]}]}]}', JS, 400, "traceId"),
        (b"{not json", JS, 400, "not a valid OTLP"),
        (b"\x0a\xff\xff\xff\xff\x0f", PB, 400, "runs past the end"),
        (b"\x0b", PB, 400, "wire type 3"),
        (b"{}", {**HEADERS, "Content-Type": "text/plain"}, 415, "application/x-protobuf"),
        (b"{}", {**JS, "Content-Encoding": "br"}, 415, "gzip"),
        (b"not gzip", {**JS, "Content-Encoding": "gzip"}, 400, "not valid gzip"),
    ]
    for body, headers, status, words in cases:
        response = ingest.http.post("/v1/traces", content=body, headers=headers)
        assert response.status_code == status, (body[:40], response.text)
        assert words.encode() in response.content, (words, response.content)
    assert ingest.store.stats() == before


# -- fuzzing: no input gets a 5xx, and a refused one changes nothing -----------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
SPAN_FIELDS = [
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "trace_id",
    "span_id",
    "parent_id",
    "name",
    "kind",
    "start_time",
    "end_time",
    "status",
    "error",
    "attributes",
    "events",
]
OTLP_SPAN_FIELDS = [
    "traceId",
    "spanId",
    "parentSpanId",
    "name",
    "kind",
    "startTimeUnixNano",
    "endTimeUnixNano",
    "attributes",
    "events",
    "status",
]


def mutated(base: Dict[str, Any], fields: List[str]) -> st.SearchStrategy[Dict[str, Any]]:
    """``base`` with some fields replaced by arbitrary JSON or dropped, and maybe an extra field."""
    changes = st.dictionaries(st.sampled_from(fields + ["extra"]), json_values | st.just("<drop>"), max_size=4)

    def apply(change: Dict[str, Any]) -> Dict[str, Any]:
        out = dict(base)
        for key, value in change.items():
            if value == "<drop>":
                out.pop(key, None)
            else:
                out[key] = value
        return out

    return changes.map(apply)


def _post_json(ingest: Ingest, path: str, document: Any) -> httpx.Response:
    body = json.dumps(document, allow_nan=True).encode()  # NaN/Infinity too: a lenient client may send them
    return ingest.http.post(path, content=body, headers=JS)


@pytest.fixture(scope="module")
def fuzz_rollout(ingest: Ingest) -> Rollout:
    return ingest.running()


FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@FUZZ
@given(data=st.data())
def test_fuzz_agl_span_ingestion_never_5xx(ingest: Ingest, fuzz_rollout: Rollout, data: st.DataObject) -> None:
    assert fuzz_rollout.attempt is not None
    valid = {
        "rollout_id": fuzz_rollout.rollout_id,
        "attempt_id": fuzz_rollout.attempt.attempt_id,
        "sequence_id": 0,
        "trace_id": "ab" * 16,
        "span_id": data.draw(st.text(min_size=1, max_size=8)),
        "name": "n",
        "start_time": 1,
        "end_time": 2,
    }
    spans = data.draw(st.lists(mutated(valid, SPAN_FIELDS), max_size=3))
    document = data.draw(st.sampled_from(["spans", "raw"]))
    payload = {"spans": spans} if document == "spans" else data.draw(json_values)
    before = ingest.store.stats()
    response = _post_json(ingest, "/v1/spans", payload)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.json()["message"] and ingest.store.stats() == before


@FUZZ
@given(data=st.data())
def test_fuzz_otlp_json_ingestion_never_5xx(ingest: Ingest, fuzz_rollout: Rollout, data: st.DataObject) -> None:
    assert fuzz_rollout.attempt is not None
    ids = [
        {"key": "agl.rollout.id", "value": {"stringValue": fuzz_rollout.rollout_id}},
        {"key": "agl.attempt.id", "value": {"stringValue": fuzz_rollout.attempt.attempt_id}},
    ]
    valid = {
        "traceId": "c" * 32,
        "spanId": data.draw(st.from_regex(r"\A[0-9a-f]{16}\Z")),
        "name": "n",
        "startTimeUnixNano": "1",
        "endTimeUnixNano": "2",
        "attributes": ids,
    }
    spans = data.draw(st.lists(mutated(valid, OTLP_SPAN_FIELDS), max_size=3))
    resource = data.draw(st.sampled_from([{"attributes": ids}, {}]) | json_values)
    payload = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": spans}]}]}
    if data.draw(st.booleans()):
        payload = data.draw(json_values)
    before = ingest.store.stats()
    response = _post_json(ingest, "/v1/traces", payload)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert ingest.store.stats() == before


@FUZZ
@given(data=st.data())
def test_fuzz_otlp_protobuf_ingestion_never_5xx(ingest: Ingest, fuzz_rollout: Rollout, data: st.DataObject) -> None:
    real = fixture_for(fuzz_rollout, "otlp_export.pb")
    kind = data.draw(st.sampled_from(["random", "truncated", "flipped"]))
    if kind == "random":
        body = data.draw(st.binary(max_size=200))
    elif kind == "truncated":
        body = real[: data.draw(st.integers(0, len(real)))]
    else:
        body = bytearray(real)
        for _ in range(data.draw(st.integers(1, 5))):
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
        body = bytes(body)
    before = ingest.store.stats()
    response = ingest.http.post("/v1/traces", content=body, headers=PB)
    assert response.status_code < 500, response.content
    if response.status_code >= 400:
        assert ingest.store.stats() == before


# -- refusals are per span: partial success, a server warning, the other spans stored ------------------------


def _ids(rollout_id: str, attempt_id: str) -> List[Dict[str, Any]]:
    return [
        {"key": "agl.rollout.id", "value": {"stringValue": rollout_id}},
        {"key": "agl.attempt.id", "value": {"stringValue": attempt_id}},
    ]


def _json_span(span_id: str, attributes: List[Dict[str, Any]], start: int = 5) -> Dict[str, Any]:
    return {
        "traceId": "d" * 32,
        "spanId": span_id,
        "name": "s",
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + 1),
        "attributes": attributes,
    }


def _export(*spans: Dict[str, Any]) -> Dict[str, Any]:
    return {"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}]}


def _pb_export(*spans: Tuple[str, Dict[str, str]]) -> bytes:
    """An ExportTraceServiceRequest in protobuf: spans of (span id hex, {string attribute: value})."""
    encoded = b""
    for span_id, attributes in spans:
        span = _pb_bytes_field(1, bytes.fromhex("e" * 32)) + _pb_bytes_field(2, bytes.fromhex(span_id))
        for key, value in attributes.items():
            any_value = _pb_bytes_field(1, value.encode())
            span += _pb_bytes_field(9, _pb_bytes_field(1, key.encode()) + _pb_bytes_field(2, any_value))
        encoded += _pb_bytes_field(2, span)
    return _pb_bytes_field(1, _pb_bytes_field(2, encoded))


def test_an_unknown_id_refuses_only_its_spans_and_the_server_says_so(
    ingest: Ingest, caplog: pytest.LogCaptureFixture
) -> None:
    """One span with a stale rollout id in a BatchSpanProcessor batch 404ed the whole export: the other
    rollouts' spans were lost, the exporter logged only "404 Not Found" and the server nothing."""
    good, other = ingest.running(), ingest.running()
    assert good.attempt is not None and other.attempt is not None
    body = _export(
        _json_span("1" * 16, _ids(good.rollout_id, good.attempt.attempt_id)),
        _json_span("2" * 16, _ids("ro-stale-json", good.attempt.attempt_id)),
        _json_span("3" * 16, _ids(good.rollout_id, other.attempt.attempt_id)),  # the attempt of another rollout
        _json_span("4" * 16, _ids("ro-stale-json", good.attempt.attempt_id)),
    )
    with caplog.at_level("WARNING", logger="agl.store.http.server"):
        for _ in range(3):  # the same bad batch again and again: logged once per rollout and reason
            response = ingest.http.post("/v1/traces", json=body, headers=HEADERS)
            assert response.status_code == 200, response.text
    partial = response.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "3"
    message = partial["errorMessage"]
    assert "2 span(s) refused: unknown rollout id 'ro-stale-json'" in message and "set agl.rollout.id" in message
    assert f"unknown attempt id '{other.attempt.attempt_id}' for rollout '{good.rollout_id}'" in message
    assert [s.span_id for s in ingest.store.query_spans(good.rollout_id)] == ["1" * 16]
    warnings = [r.getMessage() for r in caplog.records if r.name == "agl.store.http.server"]
    stale = [w for w in warnings if "ro-stale-json" in w]
    assert len(stale) == 1 and "OTLP /v1/traces: 2 span(s) for rollout ro-stale-json refused" in stale[0]
    assert sum(other.attempt.attempt_id in w for w in warnings) == 1

    # protobuf: the same, as ExportTraceServiceResponse.partial_success{rejected_spans=1, error_message}
    pb = _pb_export(
        ("5" * 16, {"agl.rollout.id": good.rollout_id, "agl.attempt.id": good.attempt.attempt_id}),
        ("6" * 16, {"agl.rollout.id": "ro-stale-pb", "agl.attempt.id": good.attempt.attempt_id}),
    )
    answer = ingest.http.post("/v1/traces", content=pb, headers=PB)
    assert answer.status_code == 200
    assert answer.content[:1] == b"\x0a"  # field 1: partial_success
    size, start = _read_varint(answer.content, 1)
    partial_pb = answer.content[start:]
    assert len(partial_pb) == size and partial_pb.startswith(b"\x08\x01\x12"), "rejected_spans=1, error_message"
    assert b"unknown rollout id 'ro-stale-pb'" in partial_pb
    assert {s.span_id for s in ingest.store.query_spans(good.rollout_id)} == {"1" * 16, "5" * 16}


def test_an_export_of_only_unknown_ids_still_gets_404_with_every_reason(ingest: Ingest) -> None:
    rollout = ingest.running()
    assert rollout.attempt is not None
    before = ingest.store.stats()
    body = _export(_json_span("7" * 16, _ids("ro-gone", rollout.attempt.attempt_id)), _json_span("8" * 16, []))
    response = ingest.http.post("/v1/traces", json=body, headers=HEADERS)
    assert response.status_code == 404
    answer = response.json()
    assert answer["error"] == "UnknownRolloutError" and answer["rollout_id"] == "ro-gone"
    assert "unknown rollout id 'ro-gone'" in answer["message"] and "name no rollout" in answer["message"]
    assert ingest.store.stats() == before


@pytest.mark.parametrize("encoding", ["json", "protobuf"])
def test_agl_sequence_id_as_a_string_of_digits_is_the_sequence_id(ingest: Ingest, encoding: str) -> None:
    """OTEL_RESOURCE_ATTRIBUTES (and many tools) can only send strings: "3" was dropped silently."""
    rollout = ingest.running()
    assert rollout.attempt is not None
    ids = {"agl.rollout.id": rollout.rollout_id, "agl.attempt.id": rollout.attempt.attempt_id}
    if encoding == "protobuf":
        body = _pb_export(("a1" * 8, {**ids, "agl.sequence.id": "3"}), ("a2" * 8, {**ids, "agl.sequence.id": "third"}))
        response = ingest.http.post("/v1/traces", content=body, headers=PB)
        assert response.status_code == 200
        size, start = _read_varint(response.content, 1)
        assert response.content[:1] == b"\x0a" and response.content[start : start + 1] == b"\x12", (
            "rejected_spans 0 (omitted)"
        )
        message = response.content
    else:
        attrs = [{"key": k, "value": {"stringValue": v}} for k, v in ids.items()]
        body = _export(
            _json_span("a1" * 8, attrs + [{"key": "agl.sequence.id", "value": {"stringValue": "3"}}], start=50),
            _json_span("a2" * 8, attrs + [{"key": "agl.sequence.id", "value": {"stringValue": "third"}}], start=50),
        )
        response = ingest.http.post("/v1/traces", json=body, headers=HEADERS)
        assert response.status_code == 200
        partial = response.json()["partialSuccess"]
        assert partial.get("rejectedSpans", "0") == "0", "a note, not a refusal: the span is stored"
        message = partial["errorMessage"].encode()
    assert b"agl.sequence.id = 'third' (str) is not an integer" in message and b"kept as an attribute" in message
    spans = {s.span_id: s for s in ingest.store.query_spans(rollout.rollout_id)}
    assert spans["a1" * 8].sequence_id == 3 and "agl.sequence.id" not in spans["a1" * 8].attributes
    third = spans["a2" * 8]
    assert third.attributes["agl.sequence.id"] == "third" and third.sequence_id == third.start_time


def test_mistyped_agl_attributes_refuse_their_span_naming_the_attribute(ingest: Ingest) -> None:
    """A reward sent as "1.0" or token ids sent as one int were stored (200) and then crashed `agl inspect`."""
    rollout = ingest.running()
    assert rollout.attempt is not None
    ids = _ids(rollout.rollout_id, rollout.attempt.attempt_id)

    def attr(key: str, value: Dict[str, Any]) -> Dict[str, Any]:
        return {"key": key, "value": value}

    ints = {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"}]}}
    body = _export(
        _json_span(
            "b1" * 8,
            ids + [attr("agl.span.kind", {"stringValue": "reward"}), attr("agl.reward.value", {"stringValue": "1.0"})],
        ),
        _json_span("b2" * 8, ids + [attr("agl.llm.prompt_token_ids", {"intValue": "5"})]),
        _json_span(
            "b3" * 8, ids + [attr("agl.llm.response_token_ids", {"arrayValue": {"values": [{"stringValue": "x"}]}})]
        ),
        _json_span(
            "b4" * 8,
            ids
            + [
                attr("agl.llm.prompt_token_ids", ints),
                attr("agl.reward.value", {"intValue": "1"}),
                attr("agl.llm.response_logprobs", {"arrayValue": {"values": [{"doubleValue": -0.5}]}}),
            ],
        ),
    )
    response = ingest.http.post("/v1/traces", json=body, headers=HEADERS)
    assert response.status_code == 200
    partial = response.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "3"
    message = partial["errorMessage"]
    assert "attribute agl.reward.value = '1.0' (str) is not a number" in message
    assert "attribute agl.llm.prompt_token_ids = 5 (int) is not a list of integers" in message
    assert "attribute agl.llm.response_token_ids = ['x'] (list) is not a list of integers" in message
    (stored,) = ingest.store.query_spans(rollout.rollout_id)
    assert stored.span_id == "b4" * 8 and stored.attributes["agl.llm.prompt_token_ids"] == [1, 2]


def test_a_gzip_body_inflating_past_the_limit_gets_413(tmp_path: Path) -> None:
    from agl.store.http.server import ServerLimits

    store = SqliteLightningStore(tmp_path / "small.db")
    server = ServerThread(
        create_app(store, tokens=TokenSet({"t": TOKEN}), limits=ServerLimits(max_body_bytes=10_000))
    ).start()
    try:
        big = json.dumps(
            _export(_json_span("c" * 16, [{"key": "pad", "value": {"stringValue": "x" * 50_000}}]))
        ).encode()
        plain = httpx.post(server.url + "/v1/traces", content=big, headers=JS)
        packed = httpx.post(
            server.url + "/v1/traces", content=gzip.compress(big), headers={**JS, "Content-Encoding": "gzip"}
        )
        assert plain.status_code == 413 and packed.status_code == 413, packed.text
        assert "inflates to more than the 10000-byte request limit" in packed.json()["message"]
    finally:
        server.stop()
        store.close()
