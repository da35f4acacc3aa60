"""agl adapter for Microsoft AutoGen agentchat, the 0.4+ line (``autogen-agentchat`` 0.5.1 to 0.7.x).

AutoGen's own extension point for observability is OpenTelemetry: its agents, tools and runtime make
GenAI-convention spans with the *global* tracer provider (or the one given to the runtime). agl does not
use those: they belong to the user's provider, agl must not replace it, and they lack what training
needs (tool arguments and results). So this adapter wraps, with wrapt, the few methods where AutoGen
invokes an agent, a team, a speaker selection and a tool call (``_agents``, ``_tools``), and makes agl's
own spans there. It carries the rollout into the thread pool AutoGen runs sync user functions in
(``_threads``), and into the task a runtime handles each message in: the sender's rollout, not that of
whoever started the runtime (``_runtime``). Model requests go through ``openai``'s client, where agl's
OpenAI layer makes the one ``llm`` span per request; the agent span current at that moment is its parent.

The framework is imported inside ``_instrument`` only, so ``agl.instrument()`` works without it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Optional

from agl._util.safety import guard
from agl.instrumentation.base import Instrumentor
from agl.instrumentation.framework import PatchSet
from agl.integrations.autogen._agents import agent_call, agent_stream, speaker_selection, team_stream
from agl.integrations.autogen._runtime import handle_messages_in_sender_context
from agl.integrations.autogen._threads import bind_context_in_executors
from agl.integrations.autogen._tools import execute_tool_call, run_json

# The methods through which an agent is invoked, on BaseChatAgent and every subclass that defines them.
_AGENT_METHODS = ("run", "run_stream", "on_messages", "on_messages_stream")


class AutoGenInstrumentor(Instrumentor):
    """Agent spans (``gen_ai.agent.name`` = ``agent.name``), team chain spans and tool spans for AutoGen."""

    name = "autogen"
    instruments = ("autogen-agentchat>=0.5.1,<0.8",)

    def __init__(self) -> None:
        super().__init__()
        self._patches = PatchSet()

    def _instrument(self, **kwargs: Any) -> None:
        # A hook that cannot be applied costs its spans, never the user's program.
        with guard("autogen.instrument"):
            self._wrap_agents()
            self._wrap_teams_and_tools()

    def _uninstrument(self) -> None:
        self._patches.restore()

    def _wrap_agents(self) -> None:
        """Wrap the invocation methods of every agent class defined so far (built-in ones included)."""
        from autogen_agentchat.agents import BaseChatAgent  # also imports every built-in agent

        for cls in _subclasses(BaseChatAgent):
            for attr in _AGENT_METHODS:
                wrapper = _agent_wrapper(cls.__dict__.get(attr), agent_call, agent_stream)
                if wrapper is not None:
                    self._patches.wrap(cls.__module__, f"{cls.__qualname__}.{attr}", wrapper)

    def _wrap_teams_and_tools(self) -> None:
        """Team runs, speaker selection, tool calls, the thread pool AutoGen hands sync functions to, and the
        runtime's message handling (teams run on a runtime)."""
        patches = self._patches
        patches.wrap("autogen_agentchat.teams", "BaseGroupChat.run_stream", team_stream)
        patches.wrap(
            "autogen_agentchat.teams._group_chat._selector_group_chat",
            "SelectorGroupChatManager.select_speaker",
            speaker_selection,
        )
        patches.wrap("autogen_agentchat.agents", "AssistantAgent._execute_tool_call", execute_tool_call)
        patches.wrap("autogen_core.tools", "BaseTool.run_json", run_json)
        bind_context_in_executors(patches)
        handle_messages_in_sender_context(patches)


def _subclasses(base: type) -> Iterator[type]:
    """``base`` and all its subclasses, each once."""
    seen = set()
    pending = [base]
    while pending:
        cls = pending.pop()
        if cls not in seen:
            seen.add(cls)
            pending.extend(cls.__subclasses__())
            yield cls


def _agent_wrapper(
    function: Any, call_wrapper: Callable[..., Any], stream_wrapper: Callable[..., Any]
) -> Optional[Callable[..., Any]]:
    """The wrapper for an agent method a class defines itself: by what it returns; None if it is abstract."""
    if function is None or getattr(function, "__isabstractmethod__", False):
        return None
    if inspect.isasyncgenfunction(function):
        return stream_wrapper
    if inspect.iscoroutinefunction(function):
        return call_wrapper
    return None


__all__ = ["AutoGenInstrumentor"]
