"""Tool spans for AutoGen agentchat.

``AssistantAgent._execute_tool_call`` runs one tool call of the model (workbench tools, MCP tools and
handoffs alike) and returns the ``FunctionExecutionResult`` the model will read. It becomes a ``tool``
span: the tool's name, the model's call id and argument JSON, that result, and error status when the
result is an error. AutoGen catches the tool's exception and hands its text to the model; the exception
itself is picked up where the tool raises it (``BaseTool.run_json``), so the span records its real type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Span

from agl._util.safety import guard, guarded
from agl.instrumentation.framework import finish_tool, start_tool_span
from agl.instrumentation.tool_failures import mark_tool_failed
from agl.integrations.autogen._agents import FRAMEWORK
from agl.tracing.tracer import record_exception

_TOOL_CALL = otel_context.create_key("agl.autogen.tool_call")


@dataclass
class _ToolCall:
    """The tool call being executed, so the tool's own exception can be attached to its span."""

    name: str
    error: Optional[BaseException] = None


@guarded("autogen.tool_span")
def _start(tool_call: Any) -> Optional[Tuple[Span, _ToolCall]]:
    span = start_tool_span(tool_call.name, FRAMEWORK, tool_call.arguments, call_id=tool_call.id)
    return span, _ToolCall(tool_call.name)


@guarded("autogen.tool_result")
def _read_result(span: Span, call: _ToolCall, outcome: Any) -> Optional[str]:
    """The text the model will read; an error result marks the span (with the tool's exception if any)."""
    result = outcome[1]  # (FunctionCall, FunctionExecutionResult)
    if result.is_error:
        if call.error is not None:
            record_exception(span, call.error)
        else:  # no exception exists (unknown tool, arguments that are not JSON): error.type is _OTHER
            mark_tool_failed(span, result.content)
    return result.content


async def _run_tool_call(tool_call: Any, awaitable: Awaitable[Any]) -> Any:
    started = _start(tool_call)
    if started is None:
        return await awaitable
    span, call = started
    token = otel_context.attach(otel_context.set_value(_TOOL_CALL, call, otel_trace.set_span_in_context(span)))
    try:
        outcome = await awaitable
    except BaseException as exc:
        with guard("autogen.tool_result"):
            finish_tool(span, error=exc)
        raise
    finally:
        otel_context.detach(token)
    with guard("autogen.tool_result"):
        finish_tool(span, _read_result(span, call, outcome))
    return outcome


def execute_tool_call(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``AssistantAgent._execute_tool_call`` (a static method; AutoGen passes ``tool_call`` by keyword)."""
    tool_call = kwargs.get("tool_call", args[0] if args else None)
    return _run_tool_call(tool_call, wrapped(*args, **kwargs))


async def _note_error(call: _ToolCall, awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except Exception as exc:
        call.error = exc
        raise


def run_json(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``BaseTool.run_json``: note the exception of the tool the current tool span is for."""
    call = otel_context.get_value(_TOOL_CALL)
    if not isinstance(call, _ToolCall) or call.name != getattr(instance, "name", None):
        return wrapped(*args, **kwargs)
    return _note_error(call, wrapped(*args, **kwargs))
