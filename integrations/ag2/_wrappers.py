"""AG2 classic (``ag2<1``, ``import autogen``): ``ConversableAgent`` methods wrapped with wrapt.

Classic AG2 has hooks that rewrite messages (``register_hook``) and a reply-function list, but none that
runs *around* a reply or a tool, so these methods are wrapped (the same anchors OpenInference uses):

- ``generate_reply`` / ``a_generate_reply`` -> an ``agent`` span named ``agent.name``, current while the
  agent produces its reply, so its model requests nest under it;
- ``execute_function`` / ``a_execute_function`` -> a ``tool`` span (name, call id, arguments, result;
  error status when the tool failed: AG2 catches the exception and returns ``is_exec_success=False`` with
  the ``"Error: ..."`` text the model reads, which is then the result and the error);
- ``initiate_chat`` / ``a_initiate_chat`` -> a ``chain`` span for the whole conversation;
- ``_reflection_with_llm`` (the ``summary_method="reflection_with_llm"`` model call, made outside any
  reply) -> an ``agent`` span named after the agent whose client writes the summary.

Two places where classic AG2 moves work to another thread, where context variables do not follow:

- ``a_generate_oai_reply`` runs the model call in the event loop's default executor. The reply-function
  list holds that function itself (captured when the agent was built), so it cannot be wrapped for
  agents that already exist; instead ``a_generate_reply`` offers its context for the agent, and
  ``OpenAIWrapper.create`` (which is passed ``agent=``) runs in it when called from another thread.
- ``_run_async_in_thread`` drives a coroutine (an async tool in a sync chat) on a new loop in a new
  thread: the coroutine first takes the caller's context.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, ContextManager, Dict, List, Tuple

from agl import semconv
from agl._util.safety import guard
from agl.instrumentation.framework import PatchSet, agent_span, set_tool_result, tool_span
from agl.instrumentation.tool_failures import mark_tool_failed
from agl.integrations.ag2._context import ContextHandoff, enter_guarded, in_context
from agl.tracing.context import current_scope
from agl.tracing.tracer import get_tracer

FRAMEWORK = "ag2"
_AGENT_MODULE = "autogen.agentchat.conversable_agent"
_HANDOFF = ContextHandoff()

Wrapper = Callable[[Any, Any, Tuple[Any, ...], Dict[str, Any]], Any]


def _agent_name(agent: Any) -> str:
    return str(getattr(agent, "name", None) or type(agent).__name__)


# -- agents ------------------------------------------------------------------------------------------------
def _generate_reply(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with contextlib.ExitStack() as stack:
        enter_guarded(stack, lambda: agent_span(_agent_name(instance), FRAMEWORK), "ag2.agent_span")
        return wrapped(*args, **kwargs)


async def _a_generate_reply(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with contextlib.ExitStack() as stack:
        enter_guarded(stack, lambda: agent_span(_agent_name(instance), FRAMEWORK), "ag2.agent_span")
        enter_guarded(stack, lambda: _HANDOFF.offer(instance), "ag2.context_offer")
        return await wrapped(*args, **kwargs)


def _reflection_with_llm(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A ``reflection_with_llm`` chat summary: a model call outside any reply, made with ``llm_agent``'s client."""

    def span() -> ContextManager[Any]:
        llm_agent = kwargs.get("llm_agent", args[2] if len(args) > 2 else None)
        speaker = llm_agent if getattr(llm_agent, "client", None) is not None else instance
        return agent_span(_agent_name(speaker), FRAMEWORK)

    with contextlib.ExitStack() as stack:
        enter_guarded(stack, span, "ag2.agent_span")
        return wrapped(*args, **kwargs)


def _create_in_agent_context(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``OpenAIWrapper.create(..., agent=...)``: on an executor thread, run in the replying agent's context.

    A worker that already runs in a rollout (agl's thread-pool hook gives each submitted call its submitter's
    context) keeps its own: the handoff holds one offer per agent, the latest, and an agent object shared by
    concurrent rollouts (a module-level assistant, each rollout's ``a_initiate_chat`` a task) would send one
    rollout's call into another's. The handoff serves workers that came without a context."""
    context = None
    with guard("ag2.context_handoff"):
        agent = kwargs.get("agent")
        if agent is not None and current_scope() is None:
            context = _HANDOFF.context_for(agent)
    if context is None:
        return wrapped(*args, **kwargs)
    return context.run(wrapped, *args, **kwargs)


def _run_async_in_caller_context(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``_run_async_in_thread(coro)``: the coroutine takes this thread's context on the new thread."""
    with guard("ag2.run_async_in_thread"):
        if args:
            args = (in_context(contextvars.copy_context(), args[0]), *args[1:])
    return wrapped(*args, **kwargs)


# -- tools -------------------------------------------------------------------------------------------------
def _tool_span(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> ContextManager[Any]:
    """``execute_function(func_call, call_id=None, verbose=False)``: the span for ``func_call``."""
    func_call = args[0] if args else kwargs["func_call"]
    call_id = args[1] if len(args) > 1 else kwargs.get("call_id")
    name = str(func_call.get("name") or "")
    return tool_span(name, FRAMEWORK, func_call.get("arguments"), call_id=call_id)


def _record_outcome(span: Any, outcome: Any) -> None:
    """``(is_exec_success, {"name", "role", "content"})``: content is the result, or the ``"Error: ..."`` text
    the model reads for a tool that raised (AG2 caught the exception, which is gone): that text is then the
    span's result and its error, as agl's other adapters record a failure the model was told of."""
    success, message = outcome
    content = message.get("content")
    set_tool_result(span, content)
    if not success:
        mark_tool_failed(span, str(content))


def _execute_function(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with contextlib.ExitStack() as stack:
        span = enter_guarded(stack, lambda: _tool_span(args, kwargs), "ag2.tool_span")
        outcome = wrapped(*args, **kwargs)
        if span is not None:
            with guard("ag2.tool_outcome"):
                _record_outcome(span, outcome)
        return outcome


async def _a_execute_function(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with contextlib.ExitStack() as stack:
        span = enter_guarded(stack, lambda: _tool_span(args, kwargs), "ag2.tool_span")
        outcome = await wrapped(*args, **kwargs)
        if span is not None:
            with guard("ag2.tool_outcome"):
                _record_outcome(span, outcome)
        return outcome


# -- conversations -----------------------------------------------------------------------------------------
def _chat_span(sender: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> ContextManager[Any]:
    recipient = args[0] if args else kwargs.get("recipient")
    name = f"initiate_chat {_agent_name(sender)} -> {_agent_name(recipient)}"
    return get_tracer().span(name, "chain", {semconv.FRAMEWORK: FRAMEWORK})


def _initiate_chat(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with contextlib.ExitStack() as stack:
        enter_guarded(stack, lambda: _chat_span(instance, args, kwargs), "ag2.chat_span")
        return wrapped(*args, **kwargs)


async def _a_initiate_chat(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    with contextlib.ExitStack() as stack:
        enter_guarded(stack, lambda: _chat_span(instance, args, kwargs), "ag2.chat_span")
        return await wrapped(*args, **kwargs)


TARGETS: Tuple[Tuple[str, str, Wrapper], ...] = (
    (_AGENT_MODULE, "ConversableAgent.generate_reply", _generate_reply),
    (_AGENT_MODULE, "ConversableAgent.a_generate_reply", _a_generate_reply),
    (_AGENT_MODULE, "ConversableAgent.execute_function", _execute_function),
    (_AGENT_MODULE, "ConversableAgent.a_execute_function", _a_execute_function),
    (_AGENT_MODULE, "ConversableAgent.initiate_chat", _initiate_chat),
    (_AGENT_MODULE, "ConversableAgent.a_initiate_chat", _a_initiate_chat),
    (_AGENT_MODULE, "ConversableAgent._reflection_with_llm", _reflection_with_llm),
    (_AGENT_MODULE, "ConversableAgent._run_async_in_thread", _run_async_in_caller_context),
    ("autogen.oai.client", "OpenAIWrapper.create", _create_in_agent_context),
)


def hook(patches: PatchSet) -> List[str]:
    """Apply the patches; return the targets this AG2 version lacks."""
    return [f"{module}.{name}" for module, name, wrapper in TARGETS if not patches.wrap(module, name, wrapper)]
