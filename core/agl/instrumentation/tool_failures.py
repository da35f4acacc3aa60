"""Tool calls that failed with no exception to record, the same way in every framework adapter.

A framework may answer a tool call with an error message and no exception: the model named a tool the
agent does not have, the tool's use limit is spent, the arguments were not JSON. The model read an error,
so the call's tool span must fail like one whose tool raised (LightningRL's AIR counts ``air.tool_error``
on it). With no exception to name, ``error.type`` is OpenTelemetry's ``_OTHER`` and the status message is
the text the model was given (also the span's ``gen_ai.tool.call.result``).

- :func:`mark_tool_failed`: fail a tool span the adapter already has open;
- :func:`record_failed_tool_call`: a whole tool span for a call the framework settled without running any
  tool, so no span of the adapter was ever opened for it.
"""

from __future__ import annotations

from typing import Any, Optional

from opentelemetry import trace as otel_trace
from opentelemetry.trace import StatusCode

from agl import semconv
from agl.instrumentation.framework import finish_tool, start_tool_span

# OpenTelemetry's error.type when there is no exception to name.
NO_EXCEPTION = "_OTHER"


def mark_tool_failed(span: otel_trace.Span, message: str) -> None:
    """Error status on a tool span, without an exception: ``error.type=_OTHER``, ``message`` as the error."""
    span.set_attribute(semconv.ERROR_TYPE, NO_EXCEPTION)
    span.set_status(StatusCode.ERROR, message)


def record_failed_tool_call(
    name: str,
    framework: str,
    arguments: Any,
    message: str,
    *,
    call_id: Optional[str] = None,
    parent: Optional[otel_trace.Span] = None,
    start_time: Optional[int] = None,
) -> None:
    """Record a tool call the framework answered with the error ``message`` without running a tool.

    The span is named by the tool name as the model wrote it, carries the model's arguments and call id,
    fails as :func:`mark_tool_failed` does and records ``message`` as the result the model read. Its parent
    is ``parent``, else the current span (the agent span a tool span would have had).
    """
    span = start_tool_span(name, framework, arguments, call_id=call_id, parent=parent, start_time=start_time)
    mark_tool_failed(span, message)
    finish_tool(span, message)


__all__ = ["NO_EXCEPTION", "mark_tool_failed", "record_failed_tool_call"]
