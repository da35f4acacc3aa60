"""AG2 1.x (``import ag2``): agent turns and tool runs, seen through AG2's own middleware.

AG2 1.x runs every turn through a middleware chain (``BaseMiddleware.on_turn``, ``on_tool_execution``),
awaited in the turn's own task, so a span made current there encloses the model requests of the turn
and the tools it runs. AG2 has no process-wide middleware registry, only per-agent lists and per-call
``middleware=``; agl therefore wraps ``Agent._turn_scope`` (the one place where every ``ask``, ``run``,
``AgentReply.ask`` and A2A turn builds its chain, from 1.0 to 1.2) to add its middleware to that turn's
additional middleware. The agent objects and their middleware lists are never changed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

from ag2.events import ToolErrorEvent, ToolResultEvent
from ag2.middleware import BaseMiddleware, Middleware
from pydantic_core import to_json

from agl.instrumentation.framework import PatchSet, agent_span, set_tool_result, tool_span
from agl.instrumentation.safety import guard, report_internal_error
from agl.integrations.ag2._context import enter_guarded
from agl.span_encoding import Computed
from agl.tracer import record_exception

FRAMEWORK = "ag2"
TARGETS: Tuple[Tuple[str, str], ...] = (("ag2.agent", "Agent._turn_scope"),)


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
            outcome = await call_next(event, context)
            if span is not None:
                with guard("ag2.tool_outcome"):
                    _record_outcome(span, outcome)
            return outcome


def _record_outcome(span: Any, outcome: Any) -> None:
    """AG2 turns a raising tool into a ``ToolErrorEvent`` (the model is told), so the error is read there."""
    if isinstance(outcome, ToolErrorEvent):
        record_exception(span, outcome.error)
    elif isinstance(outcome, ToolResultEvent):
        parts = list(outcome.result.parts)
        set_tool_result(span, Computed(lambda: _render(parts)))
    # a ClientToolCallEvent has no result: the client runs the tool


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
    except Exception as exc:  # noqa: BLE001
        report_internal_error("ag2.turn_scope", exc)
    return wrapped(*args, **kwargs)


def hook(patches: PatchSet) -> List[str]:
    """Apply the patch; return the targets this AG2 version lacks."""
    return [f"{module}.{name}" for module, name in TARGETS if not patches.wrap(module, name, _add_agl_middleware)]
