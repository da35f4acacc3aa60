"""One generation request through the recording proxy (:mod:`agl.instrumentation.proxy`): the body it sends
upstream (asking for token ids and logprobs) and the ``llm`` span it becomes, built from the answer, the
streamed lines or the failure by the same code as the client hook's spans (:mod:`agl.openai_wire.payloads`,
:mod:`~agl.openai_wire.streams`)."""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from agl import semconv
from agl.openai_wire.apis import CHAT, COMPLETIONS, TOKEN_IDS_REQUEST
from agl.openai_wire.payloads import (
    SPAN_PREFIX,
    add_request_payloads,
    logprobs_requested,
    record_response,
    record_token_ids,
    request_attributes,
    sdk_response,
)
from agl.openai_wire.sse import EventReader
from agl.openai_wire.streams import Accumulator, new_accumulator, sdk_stream_item
from agl.tracing.tracer import encode_attribute
from agl.types import Span

if TYPE_CHECKING:
    from agl.instrumentation.proxy import LLMProxy

logger = logging.getLogger("agl.proxy")

FRAMEWORK_NAME = "agl.proxy"
CLIENT_DISCONNECTED = "ClientDisconnected"  # error.type of a call whose agent went away before its answer


class ProxyCall:
    """One generation request: the body sent upstream and what becomes its span."""

    def __init__(
        self,
        proxy: LLMProxy,
        api: str,
        body: Dict[str, Any],
        route: Optional[Tuple[str, str]],
        traceparent: Optional[str],
    ) -> None:
        self.proxy = proxy
        self.api = api
        self.route = route
        self.start_ns = time.time_ns()
        stream = bool(body.get("stream"))
        if proxy.model:
            body["model"] = proxy.model
        body[TOKEN_IDS_REQUEST] = True
        if api == CHAT and proxy.logprobs and not body.get("logprobs"):
            body["logprobs"] = True
        elif api == COMPLETIONS and proxy.logprobs and body.get("logprobs") is None:
            body["logprobs"] = 0
        self.body = body
        self.with_logprobs = logprobs_requested(api, body)
        self.deferred: Dict[str, Any] = {}
        if route is not None:
            self.deferred = request_attributes(api, body, stream)
            add_request_payloads(api, body, self.deferred)
        self.accumulator: Optional[Accumulator] = None
        if stream and route is not None:
            self.accumulator = new_accumulator(api, self.with_logprobs)
        self.events = EventReader()  # the upstream stream's SSE lines
        self.trace_id, self.parent_id = _parse_traceparent(traceparent)

    def completed(self, content: bytes) -> Optional[Span]:
        if self.route is None:
            return None
        reasons: List[str] = []
        try:
            data = json.loads(content)
            reasons = record_response(self.api, sdk_response(self.api, data), self.deferred, self.with_logprobs)
        except Exception as exc:  # noqa: BLE001 - a reply we cannot read is still the agent's reply
            logger.warning("agl proxy could not read the model's reply: %s", exc)
            record_token_ids(None, None, self.deferred)
            return self._span(reasons, ("UnreadableResponse", f"{type(exc).__name__}: {exc}"))
        return self._span(reasons, None)

    def add_sse_line(self, line: str) -> None:
        """Feed one SSE line of the upstream stream to the accumulator (``event:`` names the next data)."""
        if self.accumulator is None:
            return
        text = self.events.data(line)
        if text is None:
            return
        try:
            self.accumulator.add(sdk_stream_item(self.api, json.loads(text), self.events.event))
        except Exception as exc:  # noqa: BLE001 - keep relaying; the span says what could not be read
            logger.warning("agl proxy could not read a streamed chunk: %s", exc)
            self.accumulator = None

    def streamed(self, error: Optional[BaseException]) -> Optional[Span]:
        if self.route is None:
            return None
        accumulator = self.accumulator
        if accumulator is None:
            record_token_ids(None, None, self.deferred)
            return self._span([], ("UnreadableStream", "the proxy could not read the streamed reply"))
        reasons = accumulator.record(self.deferred)
        failure = accumulator.failure
        if error is not None:
            failure = (type(error).__name__, f"the stream ended early: {type(error).__name__}: {error}")
        return self._span(reasons, failure)

    def failed(self, error_type: str, message: str) -> Optional[Span]:
        if self.route is None:
            return None
        record_token_ids(None, None, self.deferred)
        return self._span([], (error_type, message))

    def _span(self, reasons: List[str], failure: Optional[Tuple[str, str]]) -> Span:
        assert self.route is not None
        rollout_id, attempt_id = self.route
        attributes: Dict[str, Any] = {semconv.SPAN_KIND: "llm", semconv.FRAMEWORK: FRAMEWORK_NAME}
        for key, value in self.deferred.items():
            attributes[key] = encode_attribute(value)
        if reasons:
            attributes[semconv.RESPONSE_FINISH_REASONS] = reasons
        if failure is not None:
            attributes[semconv.ERROR_TYPE] = failure[0]
        model = self.body.get("model")
        prefix = SPAN_PREFIX[self.api]
        return Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=self.proxy.next_sequence_id(rollout_id, attempt_id),
            trace_id=self.trace_id or secrets.token_hex(16),
            span_id=secrets.token_hex(8),
            parent_id=self.parent_id,
            name=f"{prefix} {model}" if isinstance(model, str) and model else prefix,
            kind="llm",
            start_time=self.start_ns,
            end_time=time.time_ns(),
            status="error" if failure is not None else "ok",
            error=failure[1] if failure is not None else None,
            attributes=attributes,
        )


def _parse_traceparent(value: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """W3C ``traceparent`` (``00-<32 hex trace>-<16 hex span>-<flags>``) to (trace id, parent span id)."""
    if not value:
        return None, None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None, None
    try:
        int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None, None
    return parts[1], parts[2]
