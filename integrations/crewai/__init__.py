"""agl's CrewAI adapter: crews, tasks, agents, flows and tools become agl spans.

Why wrapt patches and not CrewAI's event bus: the bus runs sync listeners on a thread pool of its own,
after the emitting code has moved on, so a listener can neither make the agent's span current for the
LLM requests the agent makes (they would not nest under it) nor see events in order across threads.
The patches (see ``_TARGETS``) wrap the methods those events come from; all are restored exactly by
``uninstrument()``. LLM requests are not patched here: CrewAI's native OpenAI provider calls the ``openai``
client, whose instrumentation makes one ``llm`` span per request.

Agent names (``gen_ai.agent.name``, what ``agent_match`` is tested against): a CrewAI ``Agent`` is named by
its ``role``; a method of the user's ``Flow`` by the method's name.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, Optional, Tuple

from agl._util.safety import guard
from agl.instrumentation.base import Instrumentor
from agl.instrumentation.framework import PatchSet
from agl.integrations.crewai import _wrappers as w
from agl.integrations.crewai._threads import bind_run_func_to_caller, copy_context_on_access, kickoff_outside_loop

__all__ = ["CrewAIInstrumentor"]

logger = logging.getLogger("agl.instrumentation")

Target = Tuple[str, str, str]  # (module, "Class.method" or "function", key of its wrapper in _make_wrappers())
HopTarget = Tuple[str, str, Optional[str]]  # the same; None: no wrapper, only the context copy

# Where CrewAI's work happens, by the public class names (stable from 1.10 to 1.15; see resolve_target).
# A method missing in an installed version is skipped.
_TARGETS: Tuple[Target, ...] = (
    ("crewai", "Crew.kickoff", "crew"),
    ("crewai", "Crew.akickoff", "crew_async"),  # kickoff_async runs kickoff in a thread
    ("crewai", "Task._execute_core", "task"),
    ("crewai", "Task._aexecute_core", "task_async"),
    ("crewai", "Agent.execute_task", "agent"),
    ("crewai", "Agent.aexecute_task", "agent_async"),
    ("crewai", "Agent.kickoff", "agent_kickoff"),  # standalone agents (no crew)
    ("crewai", "Agent.kickoff_async", "agent_async"),  # akickoff is an alias calling it
    ("crewai", "Flow.kickoff", "flow_kickoff"),
    ("crewai", "Flow.kickoff_async", "flow_async"),  # kickoff and akickoff run it
    ("crewai", "Flow._execute_method", "flow_method"),
    ("crewai.tools.base_tool", "BaseTool.run", "tool_run"),
    ("crewai.tools.base_tool", "BaseTool.arun", "tool_run_async"),
    ("crewai.tools.base_tool", "Tool.run", "tool_run"),  # overrides run without calling it
    ("crewai.tools.base_tool", "Tool.arun", "tool_run_async"),
    ("crewai.tools.structured_tool", "CrewStructuredTool.invoke", "tool_invoke"),
    ("crewai.tools.structured_tool", "CrewStructuredTool.ainvoke", "tool_invoke_async"),
    # the text (ReAct) path: an Action CrewAI cannot run (unknown tool, unparsable input) runs no tool
    ("crewai.tools.tool_usage", "ToolUsage.parse_tool_calling", "react_action"),
    # the planning StepExecutor's native calls (>= 1.15): call ids, calls answered unrun (its own function)
    ("crewai.agents.step_executor", "execute_single_native_tool_call", "call_id"),
    ("crewai.crew", "create_chunk_generator", "stream_thread"),  # Crew(stream=True)
    ("crewai.flow.flow", "create_chunk_generator", "stream_thread"),  # Flow(stream=True), 1.10
)

# Methods that CrewAI submits to a thread pool or a thread: bound in the submitting thread's context.
# The executors' per-call method also passes the model's tool call id to the tool span.
_THREAD_HOPS: Tuple[HopTarget, ...] = (
    ("crewai", "Agent._execute_without_timeout", None),  # max_execution_time path
    ("crewai", "Task._execute_task_async", None),  # async_execution=True
    ("crewai.agents.agent_executor", "AgentExecutor._execute_single_native_tool_call", "call_id"),  # >= 1.11
    ("crewai.agents.crew_agent_executor", "CrewAgentExecutor._execute_single_native_tool_call", "call_id"),
    ("crewai.experimental.agent_executor", "AgentExecutor._execute_single_native_tool_call", "call_id"),
)


def resolve_target(module: str, name: str) -> Optional[Tuple[str, str]]:
    """Where ``module.Class.method`` is defined: the (module, "Class.method") of the class in ``Class``'s
    MRO that has it, or None. CrewAI moves code between modules (``crewai.Flow`` is a subclass of
    ``crewai.flow.runtime.Flow`` in 1.15, ``crewai.flow.flow.Flow`` itself in 1.10), so targets name the
    public class and are patched where the method lives."""
    class_name, dot, attr = name.partition(".")
    try:
        found = getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError):
        return None
    if not dot:  # a module-level function
        return (module, name) if callable(found) else None
    for klass in found.__mro__:
        if attr in vars(klass):
            if not klass.__module__.startswith("crewai") or "<locals>" in klass.__qualname__:
                return None
            return klass.__module__, f"{klass.__qualname__}.{attr}"
    return None


def _make_wrappers() -> Dict[str, Callable[..., Any]]:
    """The wrapper of each target key (``_wrappers`` and ``_threads`` import nothing from CrewAI)."""
    sync, async_, tool = w.sync_wrapper, w.async_wrapper, w.original_tool
    return {
        "crew": sync("crew", w.start_crew),
        "crew_async": async_("crew", w.start_crew),
        "task": sync("task", w.start_task),
        "task_async": async_("task", w.start_task),
        "agent": sync("agent", w.start_agent),
        "agent_async": async_("agent", w.start_agent),
        "agent_kickoff": sync("agent", w.start_agent_kickoff),
        "flow_kickoff": kickoff_outside_loop,
        "flow_async": async_("flow", w.start_flow),
        "flow_method": async_("flow_method", w.start_flow_method, identity=None),  # methods may nest
        "tool_run": sync("tool", w.start_tool_run, tool),
        "tool_run_async": async_("tool", w.start_tool_run, tool),
        "tool_invoke": sync("tool", w.start_tool_invoke, tool),
        "tool_invoke_async": async_("tool", w.start_tool_invoke, tool),
        "call_id": w.with_native_call_id,
        "react_action": w.with_unrunnable_action,
        "stream_thread": bind_run_func_to_caller,
    }


class CrewAIInstrumentor(Instrumentor):
    """Hooks CrewAI (``crewai>=1.10.1,<2``): agent spans per agent role, chain spans per crew, task and
    flow, tool spans per tool run, and contextvars carried into CrewAI's worker threads."""

    name = "crewai"
    instruments = ("crewai>=1.10.1,<2",)

    def __init__(self) -> None:
        super().__init__()
        self._patches = PatchSet()

    def _instrument(self, **kwargs: Any) -> None:
        # A second CrewAIInstrumentor shares these hooks (agl.instrumentation.base) and never gets here.
        wrappers = _make_wrappers()
        for module, name, key in _TARGETS:
            target = resolve_target(module, name)
            if target is not None:
                with guard("crewai.instrument"):  # an unforeseen CrewAI shape costs one hook, not the program
                    self._patches.wrap(*target, wrappers[key])
        for module, name, hop_key in _THREAD_HOPS:
            target = resolve_target(module, name)
            if target is not None:
                with guard("crewai.instrument"):
                    copy_context_on_access(self._patches, *target, *([wrappers[hop_key]] if hop_key else []))
        w.Hooks.owner = self

    def _uninstrument(self) -> None:
        if w.Hooks.owner is not self:
            return
        w.Hooks.owner = None
        self._patches.restore()
