"""Sending agl's spans to an OTLP/HTTP traces endpoint (Phoenix, Jaeger, an OpenTelemetry Collector), besides the
store: live from the tracer (:class:`OtlpExporter`, a background batcher off the agent's hot path) and after the
fact (``agl export --otlp``, through :class:`OtlpSender`).

Spans are encoded with ``opentelemetry-proto`` (the ``agl[otlp]`` extra) and posted with httpx, which agl already
uses: lighter than the SDK's exporter, which would pull the SDK, requests and googleapis-common-protos. Each span
carries agl's attributes plus OpenInference's (:mod:`agl.tracing.openinference`).

An endpoint that is down never slows or breaks the agent: the tracer's thread only appends to a bounded queue
(a full queue drops the span, counted in ``stats.dropped`` and said once); the exporter's thread retries a failed
batch with back-off while new spans wait in that queue, and warns at most once a minute.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence
from urllib.parse import urlsplit

import httpx

from agl.tracing.encoding import Finished, convert_span
from agl.tracing.openinference import otlp_attributes
from agl.types import Span

logger = logging.getLogger("agl.tracing.otlp")

ENDPOINT_ENV = "AGL_OTLP_ENDPOINT"
HEADERS_ENV = "AGL_OTLP_HEADERS"
INSTALL_HINT = 'OTLP export needs opentelemetry-proto: pip install "agl[otlp]"'
TRACES_PATH = "/v1/traces"
_WARN_EVERY_S = 60.0
_MAX_BACKOFF_S = 30.0


class OtlpError(Exception):
    """A batch did not reach the endpoint (unreachable, or answered with an error status)."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def check_installed() -> None:
    """ImportError with the install line when ``opentelemetry-proto`` is missing."""
    try:
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def traces_url(endpoint: str) -> str:
    """The URL to post to: ``endpoint`` as given, or with ``/v1/traces`` added when it names only a host."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"OTLP endpoint must be an http(s) URL such as http://127.0.0.1:4318/v1/traces, not {endpoint!r}"
        )
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


def parse_headers(text: str) -> Dict[str, str]:
    """``"k=v,k2=v2"`` (the form of ``AGL_OTLP_HEADERS`` and OpenTelemetry's ``OTEL_EXPORTER_OTLP_HEADERS``)."""
    headers: Dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"OTLP headers must be k=v pairs separated by commas, not {item.strip()!r}")
        headers[key.strip()] = value.strip()
    return headers


# -- encoding -------------------------------------------------------------------------------------------------
def encode(spans: Sequence[Span], service_name: str = "agl") -> bytes:
    """An ``ExportTraceServiceRequest`` (protobuf) holding ``spans`` with their OTLP attributes."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1 import trace_pb2

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    _put_attributes(resource_spans.resource.attributes, {"service.name": service_name})
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "agl"
    for span in spans:
        out = scope_spans.spans.add()
        out.trace_id = bytes.fromhex(span.trace_id)
        out.span_id = bytes.fromhex(span.span_id)
        if span.parent_id:
            out.parent_span_id = bytes.fromhex(span.parent_id)
        out.name = span.name
        out.kind = trace_pb2.Span.SPAN_KIND_CLIENT if span.kind == "llm" else trace_pb2.Span.SPAN_KIND_INTERNAL
        out.start_time_unix_nano = span.start_time
        out.end_time_unix_nano = span.end_time
        _put_attributes(out.attributes, otlp_attributes(span))
        for event in span.events:
            added = out.events.add(name=event.name, time_unix_nano=event.timestamp)
            _put_attributes(added.attributes, event.attributes)
        if span.status == "error":
            out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
            out.status.message = span.error or ""
        elif span.status == "ok":
            out.status.code = trace_pb2.Status.STATUS_CODE_OK
    return request.SerializeToString()


def _put_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        if value is not None:
            _put_value(target.add(key=key).value, value)


def _put_value(target: Any, value: Any) -> None:
    """An attribute value as an OTLP ``AnyValue``: scalars as they are, lists as arrays (token ids as int
    arrays), anything else as JSON text."""
    if type(value) is list and value and _put_number_array(target, value):
        return
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, (list, tuple)):
        values = target.array_value.values
        for item in value:
            _put_value(values.add(), item)
    else:
        target.string_value = json.dumps(value, default=str)


class _IntElements(Dict[int, bytes]):
    """int -> the encoded ``ArrayValue.values`` entry holding it (token ids repeat: each is encoded once)."""

    def __missing__(self, n: int) -> bytes:
        if not -(2**63) <= n < 2**63:
            raise OverflowError(f"{n} does not fit an OTLP int64")
        element = _length_delimited(1, b"\x18" + _varint(n & 0xFFFFFFFFFFFFFFFF))  # AnyValue.int_value = 3
        if len(self) < 1_000_000:
            self[n] = element
        return element


_INT_ELEMENTS = _IntElements()
_DOUBLE = struct.Struct("<d")
_DOUBLE_ELEMENT = b"\x0a\x09\x21"  # values entry of 9 bytes: AnyValue.double_value (4, fixed 64-bit)


def _put_number_array(target: Any, values: List[Any]) -> bool:
    """A list of ints (token ids) or of floats (logprobs) encoded here and parsed by protobuf's C code: building
    one ``AnyValue`` per item from Python costs ~0.6 us an item, ~0.1 us this way. False for other lists."""
    kinds = set(map(type, values))
    if kinds == {int}:
        try:
            encoded = b"".join([_INT_ELEMENTS[n] for n in values])
        except OverflowError:
            return False  # a huge int: each item as its own AnyValue (a string, past int64)
        target.array_value.MergeFromString(encoded)
        return True
    if kinds == {float}:
        target.array_value.MergeFromString(b"".join([_DOUBLE_ELEMENT + _DOUBLE.pack(x) for x in values]))
        return True
    return False


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length_delimited(field_number: int, payload: bytes) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


# -- sending --------------------------------------------------------------------------------------------------
class OtlpSender:
    """Posts encoded batches to one endpoint; raises :class:`OtlpError` when a batch does not arrive."""

    def __init__(self, endpoint: str, headers: Optional[Mapping[str, str]] = None, timeout: float = 10.0) -> None:
        check_installed()
        self.endpoint = traces_url(endpoint)
        self.headers = {**(headers or {}), "Content-Type": "application/x-protobuf"}
        self.timeout = timeout
        self._client: Optional[httpx.Client] = None

    def send(self, spans: Sequence[Span]) -> None:
        body = encode(spans)
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout)
        try:
            response = self._client.post(self.endpoint, content=body, headers=self.headers)
        except httpx.HTTPError as exc:
            raise OtlpError(f"{type(exc).__name__}: {exc}", retryable=True) from None
        if response.status_code >= 300:
            retryable = response.status_code in (408, 429) or response.status_code >= 500
            raise OtlpError(f"HTTP {response.status_code}: {response.text[:200]}", retryable=retryable)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


@dataclass
class OtlpStats:
    """What the live exporter did: spans sent, dropped (queue full, or refused by the endpoint), failed sends."""

    sent: int = 0
    dropped: int = 0
    rejected: int = 0
    failed_sends: int = 0


class OtlpExporter:
    """The tracer's live OTLP export: :meth:`offer` (on the agent's thread) appends a finished span to a bounded
    queue; a daemon thread converts, encodes and posts batches, retrying a failed one with back-off."""

    def __init__(
        self,
        endpoint: str,
        headers: Optional[Mapping[str, str]] = None,
        *,
        max_queue: int = 100_000,
        batch_size: int = 256,
        interval: float = 1.0,
    ) -> None:
        self.sender = OtlpSender(endpoint, headers)
        self.headers = dict(headers or {})
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.interval = interval
        self._init_state()
        os.register_at_fork(after_in_child=self._init_state)
        atexit.register(self._at_exit)

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint

    def _init_state(self) -> None:
        # Again in a forked child: the parent's thread and queue are the parent's.
        self.stats = OtlpStats()
        self._queue: collections.deque[Finished] = collections.deque()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        self._busy = False  # the thread holds a batch it took off the queue
        self._failing = False  # the last send failed: the endpoint is down (exit does not wait for it)
        self._warned_drop = False
        self._last_warning = -_WARN_EVERY_S
        self.sender._client = None  # an httpx client's connections are not the child's either

    # -- hot path -------------------------------------------------------------------------------------------
    def offer(self, item: Finished) -> None:
        if len(self._queue) >= self.max_queue:
            self.stats.dropped += 1
            if not self._warned_drop:
                self._warned_drop = True
                logger.warning(
                    "agl's OTLP export queue is full (%d spans): dropping spans for %s (the store still gets "
                    "them); the endpoint is slower than the agent or down. Said once.",
                    self.max_queue,
                    self.endpoint,
                )
            return
        self._queue.append(item)
        if self._thread is None:
            self._start()
        elif len(self._queue) >= self.batch_size and not self._wake.is_set():
            self._wake.set()

    # -- background -----------------------------------------------------------------------------------------
    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agl-otlp-export", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            self._export_queued()

    def _export_queued(self) -> None:
        while self._queue and not self._closed.is_set():
            self._busy = True
            try:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.batch_size))]
                self._send_until_done(self._converted(batch))
            finally:
                self._busy = False

    def _converted(self, batch: List[Finished]) -> List[Span]:
        spans = []
        for item in batch:
            try:
                spans.append(convert_span(item))
            except Exception as exc:  # noqa: BLE001 - one bad span must not stop the export
                self.stats.rejected += 1
                self._warn("agl could not convert span %r for OTLP export and dropped it: %s", item[0], exc)
        return spans

    def _send_until_done(self, spans: List[Span]) -> None:
        """Send, retrying what may pass (down, overloaded) with back-off until sent or closed."""
        backoff = 1.0
        while spans:
            try:
                self.sender.send(spans)
                self.stats.sent += len(spans)
                self._failing = False
                return
            except OtlpError as exc:
                self.stats.failed_sends += 1
                self._failing = True
                if not exc.retryable:
                    self.stats.rejected += len(spans)
                    self._warn("agl's OTLP endpoint %s refused %d spans (dropped): %s", self.endpoint, len(spans), exc)
                    return
                self._warn(
                    "agl could not send %d spans to the OTLP endpoint %s (will retry; the agent and the store are "
                    "not affected; at most one such line a minute): %s",
                    len(spans),
                    self.endpoint,
                    exc,
                )
            except Exception as exc:  # noqa: BLE001 - e.g. an attribute the encoder refuses: the thread goes on
                self.stats.rejected += len(spans)
                self._warn("agl could not encode %d spans for OTLP export (dropped): %s", len(spans), exc)
                return
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def _warn(self, message: str, *args: Any) -> None:
        """At most one warning a minute: an endpoint that stays down must not flood the agent's log."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning(message, *args)

    # -- control --------------------------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every span offered so far was sent (or given up on); False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._queue or self._busy:
            if self._thread is None or time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.02)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most ``timeout`` s), then stop the thread."""
        self.flush(timeout)
        self._closed.set()
        self._wake.set()
        self.sender.close()

    def _at_exit(self) -> None:
        """A script's last spans (queued within the last interval) are sent before the interpreter exits, unless
        the endpoint is down: exit never waits for it."""
        if not self._closed.is_set() and not self._failing:
            self.flush(5.0)


def from_environment() -> Optional[OtlpExporter]:
    """The exporter ``AGL_OTLP_ENDPOINT`` (and ``AGL_OTLP_HEADERS``) ask for, or None. A bad setting or a
    missing ``agl[otlp]`` is one error line, not a failure: the tracer is created wherever agl records."""
    endpoint = os.environ.get(ENDPOINT_ENV, "").strip()
    if not endpoint:
        return None
    try:
        return OtlpExporter(endpoint, parse_headers(os.environ.get(HEADERS_ENV, "")))
    except (ImportError, ValueError) as exc:
        logger.error("agl: %s=%s is not used: %s", ENDPOINT_ENV, endpoint, exc)
        return None
