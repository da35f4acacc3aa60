"""Agent and team spans for AutoGen agentchat: the wrappers the instrumentor puts on agent and team methods.

An AutoGen agent speaks through ``on_messages`` / ``on_messages_stream`` (called by teams, by the user,
and by ``run`` / ``run_stream``). Each call becomes an ``agent`` span named after ``agent.name`` that is
current while the agent works, so the ``llm`` spans of its model client's requests nest under it. The
methods call each other (``run`` -> ``on_messages`` -> ``on_messages_stream``), so a span is opened only
by the outermost call for a given agent: the agent whose span is current is kept in the OTel context.

A team run (``BaseGroupChat.run_stream``) becomes a ``chain`` span; a ``SelectorGroupChat`` choosing the
next speaker with its model becomes an agent span named after the group chat manager
(``SelectorGroupChatManager``), so those model calls are not mistaken for any participant's.
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Span

from agl import semconv
from agl._util.safety import guard, guarded
from agl.instrumentation.framework import finish_span, start_agent_span
from agl.integrations.autogen._streams import iterate_in_span
from agl.tracing.tracer import get_tracer

FRAMEWORK = "autogen"
_SPEAKING = otel_context.create_key("agl.autogen.speaking_agent")


def _already_speaking(agent: Any) -> bool:
    return otel_context.get_value(_SPEAKING) is agent


@guarded("autogen.agent_span")
def _open_turn(agent: Any, name_attribute: str = "name") -> Optional[Tuple[Span, otel_context.Context]]:
    """An agent span, and the context the agent works in: the span current, the agent noted (so its nested
    calls open no second span)."""
    span = start_agent_span(getattr(agent, name_attribute), FRAMEWORK)
    return span, otel_context.set_value(_SPEAKING, agent, otel_trace.set_span_in_context(span))


@guarded("autogen.team_span")
def _open_team_run(team: Any) -> Optional[Tuple[Span, otel_context.Context]]:
    # Teams have a ``name`` from agentchat 0.6 on; before, the class name is all there is.
    name = getattr(team, "name", None) or type(team).__name__
    span = get_tracer().start_span(f"invoke_team {name}", "chain", {semconv.FRAMEWORK: FRAMEWORK})
    return span, otel_trace.set_span_in_context(span)


async def _await_as(agent: Any, awaitable: Awaitable[Any], name_attribute: str = "name") -> Any:
    opened = _open_turn(agent, name_attribute)
    if opened is None:
        return await awaitable
    span, context = opened
    token = otel_context.attach(context)
    error: Optional[BaseException] = None
    try:
        return await awaitable
    except BaseException as exc:
        error = exc
        raise
    finally:
        otel_context.detach(token)
        with guard("autogen.span_end"):
            finish_span(span, error)


def agent_call(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``on_messages`` / ``run``: the returned coroutine runs inside the agent's span."""
    if _already_speaking(instance):
        return wrapped(*args, **kwargs)
    return _await_as(instance, wrapped(*args, **kwargs))


def agent_stream(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``on_messages_stream`` / ``run_stream``: the generator runs inside the agent's span."""
    agen = wrapped(*args, **kwargs)
    if _already_speaking(instance) or not inspect.isasyncgen(agen):
        return agen
    return iterate_in_span(agen, lambda: _open_turn(instance))


def team_stream(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``BaseGroupChat.run_stream`` (``run`` goes through it): a chain span around the team's run.

    The team's embedded runtime starts inside the first step, so the tasks it spawns for the participants
    start from this span's context and their agent spans nest under it.
    """
    agen = wrapped(*args, **kwargs)
    return iterate_in_span(agen, lambda: _open_team_run(instance)) if inspect.isasyncgen(agen) else agen


def speaker_selection(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``SelectorGroupChatManager.select_speaker``: the manager's model calls get an agent of their own."""
    return _await_as(instance, wrapped(*args, **kwargs), "_name")
