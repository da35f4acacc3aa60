"""A real OTLP/HTTP traces receiver on 127.0.0.1 for tests and benchmarks: it decodes each
``ExportTraceServiceRequest`` with ``opentelemetry-proto`` (the ``agl[otlp]`` extra) and keeps the spans, their
attributes as Python values, so a test can check what a tracing backend would have got."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: Optional[str]
    name: str
    kind: int
    start_time: int
    end_time: int
    status_code: int
    status_message: str
    attributes: Dict[str, Any]
    resource: Dict[str, Any]
    events: List[str] = field(default_factory=list)


def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as the Python value it holds (arrays as lists, key-value lists as dicts)."""
    which = value.WhichOneof("value")
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which) if which is not None else None


def decode(body: bytes) -> List[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        kind=span.kind,
                        start_time=span.start_time_unix_nano,
                        end_time=span.end_time_unix_nano,
                        status_code=span.status.code,
                        status_message=span.status.message,
                        attributes={kv.key: any_value(kv.value) for kv in span.attributes},
                        resource=resource,
                        events=[event.name for event in span.events],
                    )
                )
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` posts to ``receiver.url`` land in ``receiver.spans`` (by span id).
    ``keep=False`` decodes and counts only (a benchmark's endless stream)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: Dict[str, ReceivedSpan] = {}
        self.requests = 0
        self.received = 0
        self.headers: List[Dict[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def _handler(self) -> type:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404 if self.path != "/v1/traces" else 415)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver.requests += 1
                    receiver.received += len(spans)
                    if receiver.keep:
                        receiver.headers.append(dict(self.headers.items()))
                        receiver.spans.update((s.span_id, s) for s in spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
