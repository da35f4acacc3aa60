"""AG2 1.x (``import ag2``): agent turns and tool runs, seen through AG2's own middleware.

AG2 1.x runs every turn through a middleware chain (``BaseMiddleware.on_turn``, ``on_tool_execution``),
awaited in the turn's own task, so a span made current there encloses the model requests of the turn
and the tools it runs. AG2 has no process-wide middleware registry, only per-agent lists and per-call
``middleware=``; agl therefore wraps ``Agent._turn_scope`` (the one place where every ``ask``, ``run``,
``AgentReply.ask`` and A2A turn builds its chain, from 1.0 to 1.2) to add its middleware to that turn's
additional middleware. The agent objects and their middleware lists are never changed.

Two tool calls AG2 settles where that middleware cannot see the failure:

- a call of a tool the agent does not have is answered with a ``ToolNotFoundEvent`` by a stream subscriber
  that runs no middleware; agl wraps ``ag2.tools.executor._execute_call`` (one call each, in the call's
  task) and records a failed tool span for that outcome;
- a delegation (``Agent.as_tool``, ``TaskConfig`` subtasks) whose sub-agent failed returns AG2's failure
  text as a normal result; AG2 also sends a ``TaskFailed`` event, which fails the delegating tool span.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Dict, List, Tuple

from ag2.events import TaskFailed, ToolErrorEvent, ToolNotFoundEvent, ToolResultEvent
from ag2.middleware import BaseMiddleware, Middleware
from opentelemetry import trace as otel_trace
from pydantic_core import to_json

from agl._util.safety import guard, report_internal_error
from agl.instrumentation.framework import PatchSet, agent_span, set_tool_result, tool_span
from agl.instrumentation.tool_failures import mark_tool_failed, record_failed_tool_call
from agl.integrations.ag2._context import enter_guarded
from agl.tracing.encoding import Computed
from agl.tracing.tracer import record_exception

FRAMEWORK = "ag2"

Wrapper = Callable[[Any, Any, Tuple[Any, ...], Dict[str, Any]], Any]


class AglMiddleware(BaseMiddleware):
    """One per turn (AG2 builds middleware per turn): an agent span around it, a tool span per tool run."""

    def __init__(self, event: Any, context: Any, *, agent_name: str) -> None:
        super().__init__(event, context)
        self.agent_name = agent_name

    async def on_turn(self, call_next: Any, event: Any, context: Any) -> Any:
        with contextlib.ExitStack() as stack:
            enter_guarded(stack, lambda: agent_span(self.agent_name, FRAMEWORK), "ag2.agent_span")
            return await call_next(event, context)

    async def on_tool_execution(self, call_next: Any, event: Any, context: Any) -> Any:
        with contextlib.ExitStack() as stack:
            span = enter_guarded(
                stack, lambda: tool_span(event.name, FRAMEWORK, event.arguments, call_id=event.id), "ag2.tool_span"
            )
            failed_subtasks: List[TaskFailed] = []
            if span is not None:
                enter_guarded(stack, lambda: _watch_subtasks(context, span, failed_subtasks), "ag2.subtask_watch")
            outcome = await call_next(event, context)
            if span is not None:
                with guard("ag2.tool_outcome"):
                    _record_outcome(span, outcome, failed_subtasks)
            return outcome


def _watch_subtasks(context: Any, span: otel_trace.Span, failed: List[TaskFailed]) -> ContextManager[None]:
    """Collect the ``TaskFailed`` events that AG2's ``run_task`` sends from inside this tool's span.

    A delegation (``Agent.as_tool``, a ``TaskConfig`` subtask) catches its sub-agent's failure and returns
    it as text (``Sub-task 'x' failed: ...`` / ``Error: ...``), but first reports it with ``TaskFailed`` on
    the delegating turn's stream. That stream is shared by the turn's parallel tool calls, so an event
    counts only when sent while this tool span is current (streams call subscribers in the sender's task).
    """

    def note(task: TaskFailed) -> None:
        if otel_trace.get_current_span() is span:
            failed.append(task)

    return context.stream.where(TaskFailed).sub_scope(note, sync_to_thread=False)


def _record_outcome(span: Any, outcome: Any, failed_subtasks: List[TaskFailed]) -> None:
    """AG2 turns a raising tool into a ``ToolErrorEvent`` (the model is told), so the error is read there; its
    result is the text the model read (the traceback), recorded as the result as agl's other adapters do.

    A result returned after a sub-task of this tool failed is the failure as AG2 told the model of it: the
    span fails like a raising tool's (LightningRL's AIR counts ``air.tool_error``, not ``air.tool_ok``).
    """
    if not isinstance(outcome, ToolResultEvent):
        return  # a ClientToolCallEvent has no result: the client runs the tool
    parts = list(outcome.result.parts)
    set_tool_result(span, Computed(lambda: _render(parts)))
    if isinstance(outcome, ToolErrorEvent):  # a ToolResultEvent whose result is the error's text
        record_exception(span, outcome.error)
    elif failed_subtasks:
        mark_tool_failed(span, _render(parts))


def _render(parts: Any) -> str:
    """The result as text: a single text part as it is, anything else as JSON (one value or a list)."""
    values = [_part_value(part) for part in parts]
    value = values[0] if len(values) == 1 else values
    return value if isinstance(value, str) else to_json(value, fallback=str).decode()


def _part_value(part: Any) -> Any:
    for attribute in ("content", "data", "url"):  # TextInput, DataInput, UrlInput
        if hasattr(part, attribute):
            return getattr(part, attribute)
    return f"<{type(part).__name__}>"  # binary and file parts have no text


def _add_agl_middleware(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``Agent._turn_scope``: the turn gets agl's middleware after the caller's (innermost)."""
    try:
        ours = Middleware(AglMiddleware, agent_name=str(instance.name))
        kwargs = {**kwargs, "additional_middleware": (*kwargs.get("additional_middleware", ()), ours)}
    except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
        report_internal_error("ag2.turn_scope", exc)
    return wrapped(*args, **kwargs)


async def _record_unknown_tool(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``_execute_call(context, call)``: a call AG2 answered with ``ToolNotFoundEvent`` gets a failed tool span.

    No tool ran, so no middleware did and no span was opened; the span carries the model's name, call id and
    arguments, and the text the model was told. Any other outcome had its span from :class:`AglMiddleware`.
    """
    started = time.time_ns()
    outcome = await wrapped(*args, **kwargs)
    if isinstance(outcome, ToolNotFoundEvent):
        with guard("ag2.unknown_tool"):
            call = args[1] if len(args) > 1 else kwargs["call"]
            message = _render(outcome.result.parts)
            record_failed_tool_call(call.name, FRAMEWORK, call.arguments, message, call_id=call.id, start_time=started)
    return outcome


TARGETS: Tuple[Tuple[str, str, Wrapper], ...] = (
    ("ag2.agent", "Agent._turn_scope", _add_agl_middleware),
    ("ag2.tools.executor", "_execute_call", _record_unknown_tool),
)


def hook(patches: PatchSet) -> List[str]:
    """Apply the patches; return the targets this AG2 version lacks."""
    return [f"{module}.{name}" for module, name, wrapper in TARGETS if not patches.wrap(module, name, wrapper)]
