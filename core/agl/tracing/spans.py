"""agl's own spans: OpenTelemetry *API* spans without the SDK's span machinery.

Why not the SDK's span: on the thread that makes an LLM call, the SDK's ``start_span`` (sampler, span
limits, attribute mappings that take a lock per write, span-processor dispatch) and ``end`` (a
``ReadableSpan`` copy) were the largest part of agl's per-call cost. agl records only the spans it starts
itself, always (no sampling), and hands them to one processor, so none of that machinery is needed.

What stays exactly as with the SDK: an :class:`AglSpan` is an ``opentelemetry.trace.Span``, so
``set_span_in_context`` / ``use_span`` / ``get_current_span`` carry it through OpenTelemetry's context.
Spans of the user's own tracer provider nest under ours (they read ``get_span_context()``), ours nest
under theirs (trace id and parent span id come from the current span's context), and trace ids are
128-bit and span ids 64-bit random numbers, as the SDK makes them.

Attribute values are cleaned as the SDK does (sequences become tuples, mappings dicts, other objects
their ``str``); span and attribute count limits are not applied (agl's store has no such limits).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Mapping as AbcMapping
from collections.abc import Sequence as AbcSequence
from typing import Any, Dict, List, Mapping, Optional, Tuple

from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags, TraceState

from agl.types import array_as_json, random_bits

logger = logging.getLogger("agl.tracing.tracer")

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NO_TRACE_STATE = TraceState()
_PLAIN_TYPES = frozenset((str, bool, int, float, type(None)))


def new_id(bits: int) -> int:
    """A random non-zero id (zero means "invalid" in OpenTelemetry), from agl's own generator (see agl.types)."""
    value = random_bits(bits)
    while not value:
        value = random_bits(bits)
    return value


def clean_value(value: Any) -> Any:
    """An attribute value as the SDK would store it: primitives as they are, sequences as tuples,
    mappings as dicts, NumPy and torch values as their numbers, anything else as its ``str``."""
    kind = type(value)
    if kind in _PLAIN_TYPES or isinstance(value, (str, bool, int, float, bytes)):
        return value
    if kind is list or kind is tuple:  # the common case (finish reasons, tags): no ABC checks
        for item in value:
            if type(item) not in _PLAIN_TYPES:
                return tuple(clean_value(v) for v in value)
        return tuple(value)
    if isinstance(value, AbcMapping):
        return {str(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, AbcSequence):
        return tuple(clean_value(v) for v in value)
    try:
        return clean_value(array_as_json(value))  # NumPy / torch values: the numbers they hold
    except Exception:  # noqa: BLE001 - an attribute is never refused
        return str(value)


def clean_attributes(attributes: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    if not attributes:
        return {}
    return {k: v if type(v) in _PLAIN_TYPES else clean_value(v) for k, v in attributes.items()}


class AglSpan(otel_trace.Span):
    """A span agl started: plain fields, read by the tracer's processor when the span ends.

    ``attributes`` is the span's own dict: read it, change it through ``set_attribute(s)``. After
    ``end()`` every change is ignored, as with the SDK. The rollout fields are set by the tracer when the
    span starts inside a rollout; ``deferred`` holds payloads encoded off the caller's thread.
    """

    __slots__ = (
        "name",
        "trace_id",
        "span_id",
        "parent_id",
        "trace_state",
        "attributes",
        "events",
        "start_time",
        "end_time",
        "status_code",
        "status_description",
        "rollout_id",
        "attempt_id",
        "sequence_id",
        "generation",
        "deferred",
        "scope",
        "cut",
        "_processor",
        "_span_context",
    )

    def __init__(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        parent_id: Optional[int],
        trace_state: Optional[TraceState],
        attributes: Dict[str, Any],
        start_time: int,
        processor: Any,
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.trace_state = trace_state
        self.attributes = attributes
        self.events: Optional[List[Tuple[str, int, Dict[str, Any]]]] = None
        self.start_time = start_time
        self.end_time: Optional[int] = None
        self.status_code = StatusCode.UNSET
        self.status_description: Optional[str] = None
        self.rollout_id: Optional[str] = None
        self.attempt_id: Optional[str] = None
        self.sequence_id = 0
        self.generation = 0
        self.deferred: Optional[Dict[str, Any]] = None
        self.scope: Any = None  # the agl.tracing.context.RolloutScope it is stored in, if any
        self.cut = False  # ended by its rollout's end (agl.tracing.context.RolloutScope.end): later calls are expected
        self._processor = processor
        self._span_context: Optional[SpanContext] = None

    # -- opentelemetry.trace.Span ---------------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        context = self._span_context
        if context is None:  # built on demand: agl's own code reads the ids directly
            context = self._span_context = SpanContext(
                self.trace_id, self.span_id, False, _SAMPLED, self.trace_state or _NO_TRACE_STATE
            )
        return context

    @property
    def context(self) -> SpanContext:
        """As on the SDK's spans."""
        return self.get_span_context()

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is not None:
            _ignored(self, "set_attribute")
        elif not key or not isinstance(key, str):
            logger.warning("invalid attribute key %r: must be a non-empty string; dropped", key)
        else:
            self.attributes[key] = value if type(value) in _PLAIN_TYPES else clean_value(value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Optional[Mapping[str, Any]] = None, timestamp: Optional[int] = None
    ) -> None:
        if self.end_time is not None:
            _ignored(self, "add_event")
            return
        event = (name, timestamp if timestamp is not None else time.time_ns(), clean_attributes(attributes))
        if self.events is None:
            self.events = [event]
        else:
            self.events.append(event)

    def add_link(self, context: SpanContext, attributes: Optional[Mapping[str, Any]] = None) -> None:
        """Links are not stored by agl (its spans form one tree per rollout)."""

    def update_name(self, name: str) -> None:
        if self.end_time is not None:
            _ignored(self, "update_name")
        else:
            self.name = name

    def set_status(self, status: Any, description: Optional[str] = None) -> None:
        """The SDK's rules: OK is final, UNSET is ignored, a description is kept for ERROR only."""
        if self.end_time is not None:
            _ignored(self, "set_status")
            return
        if isinstance(status, Status):
            code, description = status.status_code, status.description
        else:
            code = status
        if self.status_code is StatusCode.OK or code is StatusCode.UNSET:
            return
        self.status_code = code
        self.status_description = description if code is StatusCode.ERROR else None

    def record_exception(
        self,
        exception: BaseException,
        attributes: Optional[Mapping[str, Any]] = None,
        timestamp: Optional[int] = None,
        escaped: bool = False,
    ) -> None:
        """An ``exception`` event with the same attributes as the SDK's."""
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        event_attributes: Dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event_attributes.update(attributes)
        self.add_event("exception", event_attributes, timestamp)

    def end(self, end_time: Optional[int] = None) -> None:
        if self.end_time is not None:
            _ignored(self, "end")
            return
        self.end_time = end_time if end_time is not None else time.time_ns()
        self._processor.on_end(self)

    def __exit__(self, exc_type: Any, exc_val: Optional[BaseException], exc_tb: Any) -> None:
        """``with tracer.start_span(...) as span``: an exception marks the span failed, as the SDK does."""
        if exc_val is not None and self.end_time is None and not isinstance(exc_val, GeneratorExit):
            self.record_exception(exc_val, escaped=True)
            self.set_status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}")
        self.end()

    def __repr__(self) -> str:
        return f"AglSpan(name={self.name!r}, span_id={self.span_id:016x}, trace_id={self.trace_id:032x})"


def _ignored(span: AglSpan, method: str) -> None:
    if span.cut:  # the code that made it goes on after its rollout ended it: nothing to tell the user
        return
    logger.warning("%s on the ended span %r is ignored", method, span.name)
