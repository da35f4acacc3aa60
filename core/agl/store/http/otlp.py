"""OTLP/HTTP trace ingestion: ``ExportTraceServiceRequest`` (JSON or protobuf) -> agl spans.

Any OpenTelemetry exporter can send spans to the store server's ``/v1/traces``; a span names its rollout
and attempt with the attributes ``agl.rollout.id`` and ``agl.attempt.id`` (on the span, or on the
resource, e.g. ``OTEL_RESOURCE_ATTRIBUTES=agl.rollout.id=ro-1,agl.attempt.id=at-1``); see docs/semconv.md.

Both encodings decode to the same dict (the OTLP JSON shape) and are validated by the same pydantic
models, so a malformed request gets one kind of clear 400 whichever encoding it came in. The protobuf
wire format is read by a small decoder below (the OTLP trace messages only), so no protobuf runtime is
needed. Spans that cannot be stored (no agl ids, an unknown rollout or attempt, an ``agl.*`` attribute of the
wrong type) are refused one by one and reported back as OTLP *partial success*; the other spans of the
export are stored.
"""

from __future__ import annotations

import base64
import gzip
import re
import struct
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, Field, ValidationError

from agl import semconv
from agl.types import Span, SpanEvent, SpanKind

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
_NANOS = Field(default=0, ge=0, le=2**63 - 1)  # uint64 on the wire; stores keep 64-bit signed integers


class OtlpError(ValueError):
    """A request that is not a valid OTLP trace export (answered with 400; nothing was stored)."""


class BodyTooLarge(OtlpError):
    """A compressed body that inflates past the request size limit (answered with 413, like a large body)."""


# -- the OTLP JSON shape (field names as in the OTLP/JSON encoding) -----------------------------------------


class AnyValue(BaseModel):
    stringValue: Optional[str] = None
    boolValue: Optional[bool] = None
    intValue: Optional[int] = None  # int64: a decimal string in OTLP/JSON, which pydantic accepts
    doubleValue: Optional[float] = None
    arrayValue: Optional[ArrayValue] = None
    kvlistValue: Optional[KeyValueList] = None
    bytesValue: Optional[str] = None  # base64


class KeyValue(BaseModel):
    key: str
    value: Optional[AnyValue] = None


class ArrayValue(BaseModel):
    values: List[AnyValue] = Field(default_factory=list)


class KeyValueList(BaseModel):
    values: List[KeyValue] = Field(default_factory=list)


class OtlpStatus(BaseModel):
    message: str = ""
    code: int = 0  # 0 unset, 1 ok, 2 error


class OtlpEvent(BaseModel):
    timeUnixNano: int = _NANOS
    name: str = ""
    attributes: List[KeyValue] = Field(default_factory=list)


class OtlpSpan(BaseModel):
    traceId: str = Field(pattern=r"^[0-9a-fA-F]{32}$")
    spanId: str = Field(pattern=r"^[0-9a-fA-F]{16}$")
    parentSpanId: Optional[str] = Field(default=None, pattern=r"^([0-9a-fA-F]{16})?$")
    name: str = ""
    kind: int = 0
    startTimeUnixNano: int = _NANOS
    endTimeUnixNano: int = _NANOS
    attributes: List[KeyValue] = Field(default_factory=list)
    events: List[OtlpEvent] = Field(default_factory=list)
    status: Optional[OtlpStatus] = None


class Scope(BaseModel):
    name: str = ""
    version: str = ""


class ScopeSpans(BaseModel):
    scope: Optional[Scope] = None
    spans: List[OtlpSpan] = Field(default_factory=list)


class OtlpResource(BaseModel):
    attributes: List[KeyValue] = Field(default_factory=list)


class ResourceSpans(BaseModel):
    resource: Optional[OtlpResource] = None
    scopeSpans: List[ScopeSpans] = Field(default_factory=list)


class ExportTraceServiceRequest(BaseModel):
    """The body of an OTLP/HTTP trace export (``application/json`` or ``application/x-protobuf``)."""

    resourceSpans: List[ResourceSpans] = Field(default_factory=list)


# -- decoding ---------------------------------------------------------------------------------------------


def decode_export(body: bytes, content_type: str, content_encoding: str, max_bytes: int) -> ExportTraceServiceRequest:
    """Parse an export request body; raises OtlpError (bad data) or LookupError (unsupported media type)."""
    body = _decompress(body, content_encoding.strip().lower(), max_bytes)
    media = content_type.split(";", 1)[0].strip().lower()
    try:
        if media == JSON:
            return ExportTraceServiceRequest.model_validate_json(body)
        if media == PROTOBUF:
            return ExportTraceServiceRequest.model_validate(_message(body, _EXPORT_REQUEST, 0))
    except ValidationError as exc:
        raise OtlpError(f"not a valid OTLP trace export: {_first_errors(exc)}") from None
    raise LookupError(f"content type {content_type!r} is not supported: send OTLP as {JSON} or {PROTOBUF}")


def _decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise LookupError(f"content encoding {encoding!r} is not supported: send gzip, deflate or none")
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except (zlib.error, gzip.BadGzipFile) as exc:
        raise OtlpError(f"the body is not valid {encoding} data: {exc}") from None
    if len(out) > max_bytes:
        raise BodyTooLarge(f"the {encoding} body inflates to more than the {max_bytes}-byte request limit")
    return out


def _first_errors(exc: ValidationError, n: int = 3) -> str:
    errors = exc.errors(include_url=False)
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:n]]
    more = f" (and {len(errors) - n} more)" if len(errors) > n else ""
    return "; ".join(parts) + more


# -- conversion to agl spans ------------------------------------------------------------------------------

#: gen_ai.operation.name -> agl span kind, for spans that do not carry agl.span.kind themselves.
_KIND_BY_OPERATION: Dict[str, SpanKind] = {
    "chat": "llm",
    "text_completion": "llm",
    "generate_content": "llm",
    "embeddings": "llm",
    "execute_tool": "tool",
    "invoke_agent": "agent",
    "create_agent": "agent",
}
_KINDS = ("agent", "llm", "tool", "chain", "reward", "annotation")


class Refusals:
    """What an export could not store, and notes on what was stored differently than sent, for the OTLP partial
    success answer and the server's log. Each entry is one reason (a sentence that says what to do) and the
    rollout it concerns ("" when none), with how many spans it covers."""

    def __init__(self) -> None:
        self.rejected = 0  # spans not stored
        self._entries: Dict[Tuple[str, str, bool], int] = {}  # (reason, rollout id, refused?) -> spans

    def refuse(self, reason: str, rollout_id: str = "", n: int = 1) -> None:
        self.rejected += n
        key = (reason, rollout_id, True)
        self._entries[key] = self._entries.get(key, 0) + n

    def note(self, reason: str, rollout_id: str = "") -> None:
        """Something kept, but not as sent (a span still stored, so not counted as rejected)."""
        key = (reason, rollout_id, False)
        self._entries[key] = self._entries.get(key, 0) + 1

    def entries(self) -> List[Tuple[str, str, bool, int]]:
        """(reason, rollout id, refused?, spans) in the order first seen."""
        return [(reason, rollout_id, refused, n) for (reason, rollout_id, refused), n in self._entries.items()]

    def message(self, limit: int = 10) -> str:
        """The partial-success error message: one sentence per reason, refusals first."""
        entries = sorted(self.entries(), key=lambda e: not e[2])
        parts = [
            f"{n} span(s) {'refused' if refused else 'stored with a note'}: {reason}"
            for reason, _, refused, n in entries[:limit]
        ]
        if len(entries) > limit:
            parts.append(f"and {len(entries) - limit} more reason(s)")
        return "; ".join(parts)

    def __bool__(self) -> bool:
        return bool(self._entries)


_NO_IDS = (
    f"they name no rollout: set the attributes {semconv.OTLP_ROLLOUT_ID} and {semconv.OTLP_ATTEMPT_ID} "
    "on the span or its resource (OTEL_RESOURCE_ATTRIBUTES)"
)
_DIGITS = re.compile(r"^[0-9]+$")


def to_spans(request: ExportTraceServiceRequest) -> Tuple[List[Span], Refusals]:
    """agl spans of an export, and the spans refused (no agl ids, mistyped agl.* attributes) with why."""
    spans: List[Span] = []
    refusals = Refusals()
    for resource_spans in request.resourceSpans:
        resource = _attributes(resource_spans.resource.attributes if resource_spans.resource else [])
        for scope_spans in resource_spans.scopeSpans:
            scope = scope_spans.scope or Scope()
            for otlp_span in scope_spans.spans:
                span = _to_span(otlp_span, resource, scope, refusals)
                if span is not None:
                    spans.append(span)
    return spans, refusals


def _to_span(span: OtlpSpan, resource: Dict[str, Any], scope: Scope, refusals: Refusals) -> Optional[Span]:
    attributes = _attributes(span.attributes)
    rollout_id = attributes.get(semconv.OTLP_ROLLOUT_ID, resource.get(semconv.OTLP_ROLLOUT_ID))
    attempt_id = attributes.get(semconv.OTLP_ATTEMPT_ID, resource.get(semconv.OTLP_ATTEMPT_ID))
    if not isinstance(rollout_id, str) or not isinstance(attempt_id, str) or not rollout_id or not attempt_id:
        refusals.refuse(_NO_IDS)
        return None
    wrong = _mistyped(attributes)
    if wrong:
        refusals.refuse(wrong, rollout_id)
        return None
    attributes.pop(semconv.OTLP_ROLLOUT_ID, None)
    attributes.pop(semconv.OTLP_ATTEMPT_ID, None)
    given = attributes.pop(semconv.OTLP_SEQUENCE_ID, None)
    sequence_id = _sequence_id(given)
    if sequence_id is None:
        sequence_id = span.startTimeUnixNano  # the default; LightningRL orders calls by start time first anyway
        if given is not None:  # not what was meant: kept as sent, and said so
            attributes[semconv.OTLP_SEQUENCE_ID] = given
            refusals.note(
                f"{semconv.OTLP_SEQUENCE_ID} = {_shown(given)} is not an integer >= 0 (nor a string of digits): "
                "kept as an attribute, and the span's sequence id is its start time in ns",
                rollout_id,
            )
    if scope.name:
        attributes.setdefault("otel.scope.name", scope.name)
        if scope.version:
            attributes.setdefault("otel.scope.version", scope.version)
    status = span.status or OtlpStatus()
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=span.traceId.lower(),
        span_id=span.spanId.lower(),
        parent_id=span.parentSpanId.lower() if span.parentSpanId else None,
        name=span.name,
        kind=_kind(attributes),
        start_time=span.startTimeUnixNano,
        end_time=max(span.endTimeUnixNano, span.startTimeUnixNano),
        status={1: "ok", 2: "error"}.get(status.code, "unset"),
        error=(status.message or None) if status.code == 2 else None,
        attributes=attributes,
        events=[
            SpanEvent(name=e.name, timestamp=e.timeUnixNano, attributes=_attributes(e.attributes)) for e in span.events
        ],
    )


def _sequence_id(value: Any) -> Optional[int]:
    """An ``agl.sequence.id`` as an int: an int in [0, 2**63), or a string of digits (all that
    ``OTEL_RESOURCE_ATTRIBUTES`` can send) in that range; None for anything else."""
    if isinstance(value, str) and _DIGITS.match(value.strip()):
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


#: agl.* attributes LightningRL and ``agl inspect`` read, with the type docs/semconv.md gives them. A span that
#: sends one with another type is refused (nothing is coerced: a reward sent as the string "1.0" is refused too).
_TYPED: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    semconv.PROMPT_TOKEN_IDS: ("a list of integers", _int_list),
    semconv.RESPONSE_TOKEN_IDS: ("a list of integers", _int_list),
    semconv.LLM_PROMPT: ("a string or a list of integers", lambda v: isinstance(v, str) or _int_list(v)),
    semconv.RESPONSE_LOGPROBS: ("a list of numbers", lambda v: isinstance(v, list) and all(_is_number(x) for x in v)),
    semconv.RESOURCES_VERSION: ("an integer", _is_int),
    semconv.REWARD_VALUE: ("a number (int or double)", _is_number),
    semconv.REWARD_DIMENSIONS: ("a JSON string", lambda v: isinstance(v, str)),
}


def _mistyped(attributes: Dict[str, Any]) -> str:
    """Why the span's agl.* attributes cannot be stored ("" when they can)."""
    for key, (expected, fits) in _TYPED.items():
        value = attributes.get(key)
        if value is not None and not fits(value):
            return (
                f"attribute {key} = {_shown(value)} is not {expected} (docs/semconv.md): "
                "send it with that type, or under another name"
            )
    return ""


def _shown(value: Any, width: int = 60) -> str:
    text = repr(value)
    text = text if len(text) <= width else text[: width - 3] + "..."
    return f"{text} ({type(value).__name__})"


def _kind(attributes: Dict[str, Any]) -> SpanKind:
    kind = attributes.get(semconv.SPAN_KIND)
    if kind in _KINDS:
        return kind
    return _KIND_BY_OPERATION.get(str(attributes.get(semconv.OPERATION_NAME)), "chain")


def _attributes(pairs: List[KeyValue]) -> Dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: Optional[AnyValue]) -> Any:
    if value is None:
        return None
    if value.arrayValue is not None:
        return [_value(v) for v in value.arrayValue.values]
    if value.kvlistValue is not None:
        return _attributes(value.kvlistValue.values)
    for name in ("stringValue", "boolValue", "intValue", "doubleValue", "bytesValue"):
        found = getattr(value, name)
        if found is not None:
            return found
    return None


# -- responses ------------------------------------------------------------------------------------------


def export_response(media: str, rejected: int, message: str) -> bytes:
    """``ExportTraceServiceResponse``: empty on full success, else its partial_success (a ``message`` with
    ``rejected=0`` is a warning about spans that were stored, which OTLP allows)."""
    if media == PROTOBUF:
        if not rejected and not message:
            return b""
        partial = (_pb_varint_field(1, rejected) if rejected else b"") + _pb_bytes_field(2, message.encode())
        return _pb_bytes_field(1, partial)
    if not rejected and not message:
        return b"{}"
    from pydantic_core import to_json

    return to_json({"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": message}})


def status_response(code: int, message: str) -> bytes:
    """A ``google.rpc.Status`` in protobuf (what OTLP/HTTP servers answer failures with)."""
    return _pb_varint_field(1, code) + _pb_bytes_field(2, message.encode())


def _pb_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _pb_varint_field(number: int, value: int) -> bytes:
    return _pb_varint(number << 3) + _pb_varint(value)


def _pb_bytes_field(number: int, data: bytes) -> bytes:
    return _pb_varint(number << 3 | 2) + _pb_varint(len(data)) + data


# -- a protobuf reader for the OTLP trace messages ---------------------------------------------------------
# A schema maps field number -> (name, type, repeated); a type is a scalar name or another schema. Unknown
# fields are skipped, as protobuf requires; a field whose wire type does not fit its schema is an error.

Schema = Dict[int, Tuple[str, Union[str, Dict[int, Any]], bool]]
_MAX_DEPTH = 32

_ANY_VALUE: Schema = {}
_KEY_VALUE: Schema = {1: ("key", "string", False), 2: ("value", _ANY_VALUE, False)}
_VALUES_OF_ANY: Schema = {1: ("values", _ANY_VALUE, True)}
_VALUES_OF_KV: Schema = {1: ("values", _KEY_VALUE, True)}
_ANY_VALUE.update(
    {
        1: ("stringValue", "string", False),
        2: ("boolValue", "bool", False),
        3: ("intValue", "int64", False),
        4: ("doubleValue", "double", False),
        5: ("arrayValue", _VALUES_OF_ANY, False),
        6: ("kvlistValue", _VALUES_OF_KV, False),
        7: ("bytesValue", "bytes_b64", False),
    }
)
_EVENT: Schema = {
    1: ("timeUnixNano", "fixed64", False),
    2: ("name", "string", False),
    3: ("attributes", _KEY_VALUE, True),
}
_STATUS: Schema = {2: ("message", "string", False), 3: ("code", "varint", False)}
_SPAN: Schema = {
    1: ("traceId", "bytes_hex", False),
    2: ("spanId", "bytes_hex", False),
    4: ("parentSpanId", "bytes_hex", False),
    5: ("name", "string", False),
    6: ("kind", "varint", False),
    7: ("startTimeUnixNano", "fixed64", False),
    8: ("endTimeUnixNano", "fixed64", False),
    9: ("attributes", _KEY_VALUE, True),
    11: ("events", _EVENT, True),
    15: ("status", _STATUS, False),
}
_SCOPE: Schema = {1: ("name", "string", False), 2: ("version", "string", False)}
_SCOPE_SPANS: Schema = {1: ("scope", _SCOPE, False), 2: ("spans", _SPAN, True)}
_RESOURCE: Schema = {1: ("attributes", _KEY_VALUE, True)}
_RESOURCE_SPANS: Schema = {1: ("resource", _RESOURCE, False), 2: ("scopeSpans", _SCOPE_SPANS, True)}
_EXPORT_REQUEST: Schema = {1: ("resourceSpans", _RESOURCE_SPANS, True)}

_WIRE_TYPE = {
    "varint": 0,
    "int64": 0,
    "bool": 0,
    "fixed64": 1,
    "double": 1,
    "string": 2,
    "bytes_hex": 2,
    "bytes_b64": 2,
}


def _read_varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise OtlpError("truncated or overlong varint in the protobuf body")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _message(buf: bytes, schema: Schema, depth: int) -> Dict[str, Any]:
    if depth > _MAX_DEPTH:
        raise OtlpError(f"protobuf messages nested deeper than {_MAX_DEPTH} levels")
    out: Dict[str, Any] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            raw: Any
            raw, pos = _read_varint(buf, pos)
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise OtlpError("truncated fixed-size field in the protobuf body")
            raw, pos = buf[pos : pos + size], pos + size
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise OtlpError("a length-delimited field runs past the end of the protobuf body")
            raw, pos = buf[pos : pos + size], pos + size
        else:
            raise OtlpError(f"unsupported protobuf wire type {wire} (field {number})")
        field = schema.get(number)
        if field is None:
            continue  # unknown field: skipped
        name, kind, repeated = field
        value = _field_value(name, kind, wire, raw, depth)
        if repeated:
            out.setdefault(name, []).append(value)
        else:
            out[name] = value
    return out


def _field_value(name: str, kind: Union[str, Schema], wire: int, raw: Any, depth: int) -> Any:
    expected = 2 if isinstance(kind, dict) else _WIRE_TYPE[kind]
    if wire != expected:
        raise OtlpError(f"field {name!r} has protobuf wire type {wire}, expected {expected}")
    if isinstance(kind, dict):
        return _message(raw, kind, depth + 1)
    return _SCALARS[kind](raw)


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise OtlpError("a protobuf string field is not valid UTF-8") from None


def _int64(raw: int) -> int:
    return raw - (1 << 64) if raw >= 1 << 63 else raw


_SCALARS: Dict[str, Callable[[Any], Any]] = {
    "varint": lambda raw: raw,
    "int64": _int64,
    "bool": bool,
    "fixed64": lambda raw: struct.unpack("<Q", raw)[0],
    "double": lambda raw: struct.unpack("<d", raw)[0],
    "string": _utf8,
    "bytes_hex": lambda raw: raw.hex(),
    "bytes_b64": lambda raw: base64.b64encode(raw).decode(),
}
