"""Carry the caller's context into the thread pool where AutoGen runs synchronous user functions.

AutoGen runs a synchronous ``FunctionTool`` function, and a synchronous ``UserProxyAgent`` input function
(e.g. a simulated user asking a model), with ``loop.run_in_executor(None, ...)``. Unlike
``asyncio.to_thread``, that does not copy contextvars: spans made inside the function (an LLM call, a
nested agent) would lose their rollout and their parent span. AutoGen reads the function from the instance
(``self._func``, ``self.input_func``) right before handing it to the executor, so the wrapper runs
AutoGen's own method on a proxy of the instance whose function is bound to the caller's context
(``agl.propagate``); nothing of AutoGen's logic is copied.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, Tuple

import wrapt

from agl._util.safety import guarded
from agl.instrumentation.framework import PatchSet
from agl.tracing.context import propagate


class _ContextBound(wrapt.ObjectProxy):
    """The instance as its own method sees it, except that one attribute carries the caller's context."""

    def __init__(self, wrapped: Any, attribute: str) -> None:
        super().__init__(wrapped)
        self._self_attribute = attribute

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__wrapped__, name)
        return propagate(value) if name == self._self_attribute else value


def _run_with_context_bound(
    original: Callable[..., Any], attribute: str, runs_in_thread: Callable[[Any], bool]
) -> Callable[..., Any]:
    """A wrapper that calls ``original`` (the unwrapped method) on a proxy binding ``attribute`` to the
    caller's context, when ``runs_in_thread(instance)`` says the function goes to the executor."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not runs_in_thread(instance):
            return wrapped(*args, **kwargs)
        return original(_ContextBound(instance, attribute), *args, **kwargs)

    return wrapper


@guarded("autogen.executor_context", default=False)
def _sync_tool_function(tool: Any) -> bool:
    # The same test FunctionTool.run makes to choose between awaiting and the executor.
    return not asyncio.iscoroutinefunction(tool._func)


@guarded("autogen.executor_context", default=False)
def _sync_input_function(agent: Any) -> bool:
    return not agent._is_async


def bind_context_in_executors(patches: PatchSet) -> None:
    """Wrap ``FunctionTool.run`` and ``UserProxyAgent._get_input`` (skipped where a version lacks them)."""
    from autogen_agentchat.agents import UserProxyAgent
    from autogen_core.tools import FunctionTool

    handoffs = (
        ("autogen_core.tools", FunctionTool, "run", "_func", _sync_tool_function),
        ("autogen_agentchat.agents", UserProxyAgent, "_get_input", "input_func", _sync_input_function),
    )
    for module, cls, method, attribute, runs_in_thread in handoffs:
        original = cls.__dict__.get(method)
        if original is not None:
            wrapper = _run_with_context_bound(original, attribute, runs_in_thread)
            patches.wrap(module, f"{cls.__name__}.{method}", wrapper)
