"""The wrapt wrappers that turn CrewAI's crews, tasks, agents, flows and tools into agl spans.

Every span is made *current* while the wrapped call runs, so the ``llm`` span that the OpenAI-client layer
makes for a request nests under the agent span of the CrewAI agent that made it (CrewAI's native OpenAI
provider calls ``chat.completions.create`` / ``responses.create`` on the ``openai`` client).

Rules every wrapper follows:
- an error in agl's own code is reported (:func:`~agl._util.safety.report_internal_error`) and
  the user's call runs without that span; an error of the user's call is re-raised unchanged;
- one span per logical step: CrewAI re-enters the same step (``akickoff`` -> ``kickoff_async``, an
  agent's retry calling ``execute_task`` again, a structured tool calling its original), so a wrapper
  whose object already has a span open in this context passes straight through;
- wrappers left bound after ``uninstrument()`` (a tool's ``run`` kept in CrewAI's function table) pass
  straight through as well.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import sys
import time
from typing import Any, Callable, Dict, FrozenSet, Optional, Set, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from agl import semconv
from agl._util.safety import guard, report_internal_error
from agl.instrumentation.framework import finish_span, finish_tool, start_agent_span, start_tool_span
from agl.instrumentation.tool_failures import mark_tool_failed, record_failed_tool_call
from agl.integrations.crewai._threads import in_running_loop
from agl.tracing.tracer import get_tracer

logger = logging.getLogger("agl.integrations.crewai")

FRAMEWORK = "crewai"
_TASK_NAME_CHARS = 80  # a task without a name is called by the start of its description

Key = Tuple[str, int]
Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]
SpanStarter = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Optional[otel_trace.Span]]

# Objects (by kind and id) whose span is open in this context: re-entries pass through.
_OPEN = otel_context.create_key("agl.crewai.open")


@dataclasses.dataclass
class _NativeCall:
    """The native tool call being executed: its id for the tool span made inside (CrewAI's tools do not get
    it), and whether a tool span was opened for it at all (CrewAI settles some calls without any tool)."""

    call_id: Optional[str]
    tool_started: bool = False


_NATIVE_CALL: contextvars.ContextVar[Optional[_NativeCall]] = contextvars.ContextVar(
    "agl_crewai_native_call", default=None
)


class Hooks:
    """The instrumentor instance whose patches are on CrewAI, if any.

    One at a time: a second instance stacking its patches would double every span. Wrappers read it too,
    so a wrapper that stays bound after ``uninstrument()`` (a tool's ``run`` kept in an executor's function
    table) goes quiet.
    """

    owner: Optional[object] = None


@dataclasses.dataclass
class _Opened:
    """A span made current by a wrapper, with what is needed to restore the context and end it."""

    span: otel_trace.Span
    token: object
    is_tool: bool
    subject: Any = None  # what the span is about (a tool span's tool: its result may be a handled failure)


# -- opening and closing ------------------------------------------------------------------------------------
def _open(
    key: Optional[Key], start: SpanStarter, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], is_tool: bool
) -> Optional[_Opened]:
    """Start the span and make it current, or None (pass through) when off, re-entered or failing."""
    if Hooks.owner is None:
        return None
    try:
        open_keys: FrozenSet[Key] = otel_context.get_value(_OPEN) or frozenset()  # type: ignore[assignment]  # the context value this module stores
        if key in open_keys:
            return None
        span = start(instance, args, kwargs)
        if span is None:
            return None
        ctx = otel_trace.set_span_in_context(span)
        if key is not None:
            ctx = otel_context.set_value(_OPEN, open_keys | {key}, ctx)
        return _Opened(span, otel_context.attach(ctx), is_tool, instance)
    except Exception as exc:  # noqa: BLE001 - the user's call goes on without a span
        report_internal_error("crewai.open_span", exc)
        return None


def _close(opened: Optional[_Opened], result: Any = None, error: Optional[BaseException] = None) -> None:
    """Restore the caller's context and end the span (a tool span also records the result)."""
    if opened is None:
        return
    try:
        otel_context.detach(opened.token)  # type: ignore[arg-type]  # the token attach() returned
        if opened.is_tool:
            if error is None:
                with guard("crewai.tool_result"):  # the span still ends
                    message = _failure_text(result)  # a ToolFailure returned, not raised
                    if message is not None:
                        result = message  # the text the agent reads, not the object
                    else:
                        message = _handled_tool_failure(opened.subject, result)
                    if message is not None:
                        mark_tool_failed(opened.span, message)
            finish_tool(opened.span, result, error)
        else:
            finish_span(opened.span, error)
    except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
        report_internal_error("crewai.close_span", exc)


Identity = Optional[Callable[[Any], Any]]


def _key(kind: str, identity: Identity, instance: Any) -> Optional[Key]:
    return (kind, id(identity(instance))) if identity is not None else None


def sync_wrapper(kind: str, start: SpanStarter, identity: Identity = lambda obj: obj) -> Wrapper:
    """A wrapt wrapper running a sync method inside the span ``start`` makes.

    At most one span per ``identity(instance)`` object is open in a context (None: no such limit)."""
    is_tool = kind == "tool"

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        opened = _open(_key(kind, identity, instance), start, instance, args, kwargs, is_tool)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            _close(opened, error=exc)
            raise
        _close(opened, result)
        return result

    return wrapper


def async_wrapper(kind: str, start: SpanStarter, identity: Identity = lambda obj: obj) -> Wrapper:
    """Like :func:`sync_wrapper` for ``async def`` methods: the coroutine is made at call time (argument
    errors raise where they did), the span opens when it is awaited, in the awaiting task's context."""
    is_tool = kind == "tool"

    async def run(coroutine: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        opened = _open(_key(kind, identity, instance), start, instance, args, kwargs, is_tool)
        try:
            result = await coroutine
        except BaseException as exc:
            _close(opened, error=exc)
            raise
        _close(opened, result)
        return result

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        return run(wrapped(*args, **kwargs), instance, args, kwargs)

    return wrapper


# -- what each span is called and carries -------------------------------------------------------------------
def _text(value: Any) -> str:
    return str(value).strip() if value is not None else ""


def start_crew(crew: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> otel_trace.Span:
    name = _text(getattr(crew, "name", None)) or "crew"
    attrs = {
        semconv.FRAMEWORK: FRAMEWORK,
        "crewai.crew.name": name,
        "crewai.crew.process": _text(getattr(crew, "process", None)),
    }
    return get_tracer().start_span(f"crew {name}", "chain", attrs)


def start_task(task: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> otel_trace.Span:
    description = _text(getattr(task, "description", None))
    name = _text(getattr(task, "name", None)) or " ".join(description.split())[:_TASK_NAME_CHARS]  # one line
    agent = args[0] if args else kwargs.get("agent")
    attrs = {semconv.FRAMEWORK: FRAMEWORK, "crewai.task.name": name, "crewai.task.description": description}
    role = _text(getattr(agent or getattr(task, "agent", None), "role", None))
    if role:
        attrs["crewai.task.agent"] = role
    return get_tracer().start_span(f"task {name}", "chain", attrs)


def agent_name(agent: Any) -> str:
    """An agent is named by its role, the name CrewAI shows and users write ``agent_match`` against."""
    return _text(getattr(agent, "role", None)) or type(agent).__name__


def start_agent(agent: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> otel_trace.Span:
    _warn_if_untraced_model(agent)
    attrs = {semconv.AGENT_ID: _text(getattr(agent, "id", None))}
    return start_agent_span(agent_name(agent), FRAMEWORK, attributes=attrs)


_NATIVE_OPENAI = 'CrewAI\'s native OpenAI provider: LLM(model=..., provider="openai", base_url=llm.get_base_url())'
_LITELLM_WARNING = (
    "CrewAI agent %r calls its model through LiteLLM, which agl does not trace: its LLM calls are not recorded "
    f"or trained on. Use {_NATIVE_OPENAI}. (Said once.)"
)
_CUSTOM_LLM_WARNING = (
    "CrewAI agent %r calls its model through %s, a custom BaseLLM: agl records its LLM calls only where it "
    "makes them with the openai client (chat.completions.create, responses.create); others are not recorded "
    f"or trained on. Call the openai client in it, or use {_NATIVE_OPENAI}. (Said once.)"
)
_warned_routes: Set[str] = set()  # the untraced model routes warned about in this process


def _warn_if_untraced_model(agent: Any) -> None:
    """An agent whose model calls agl may not see: the rollout would succeed with nothing to train on, so say
    so once per route. LiteLLM (CrewAI's route for ``openai/<name>`` it does not know as an OpenAI model when
    LiteLLM is installed, or ``is_litellm=True``) posts with the openai client's low-level ``post``, which
    agl does not hook; a custom ``BaseLLM`` (CrewAI's base class for models of one's own) is seen only if
    it calls the openai client."""
    llm = getattr(agent, "llm", None)
    if getattr(llm, "is_litellm", False):
        _warn_once("litellm", _LITELLM_WARNING, agent_name(agent))
    elif _is_custom_llm(llm):
        _warn_once("custom", _CUSTOM_LLM_WARNING, agent_name(agent), type(llm).__qualname__)


def _warn_once(route: str, message: str, *args: Any) -> None:
    """Log ``message`` the first time an agent on ``route`` runs in this process."""
    if route in _warned_routes:
        return
    _warned_routes.add(route)
    logger.warning(message, *args)


def _is_custom_llm(llm: Any) -> bool:
    """A ``crewai.BaseLLM`` subclass defined outside CrewAI (CrewAI's own, ``LLM`` and the native providers,
    are what the rest of this module and the LiteLLM check are about)."""
    klass = type(llm)
    is_base_llm = any(k.__name__ == "BaseLLM" and k.__module__.startswith("crewai.") for k in klass.__mro__)
    return is_base_llm and not klass.__module__.startswith("crewai.")


def start_agent_kickoff(agent: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[otel_trace.Span]:
    """``Agent.kickoff`` inside a running loop only returns ``kickoff_async()``, whose wrapper makes the span."""
    if in_running_loop():
        return None
    return start_agent(agent, args, kwargs)


def _is_users_flow(flow: Any) -> bool:
    """CrewAI runs its own agent loop as a Flow (``AgentExecutor``): only the user's flows get spans."""
    return not type(flow).__module__.startswith("crewai.")


def start_flow(flow: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[otel_trace.Span]:
    if not _is_users_flow(flow):
        return None
    name = type(flow).__name__
    return get_tracer().start_span(f"flow {name}", "chain", {semconv.FRAMEWORK: FRAMEWORK, "crewai.flow.name": name})


def start_flow_method(flow: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[otel_trace.Span]:
    """A flow method is a node of the user's graph: an agent span named after the method, so LLM calls made
    directly in it (``LLM.call``) can be selected by ``agent_match``; crews inside nest their own agents."""
    if not _is_users_flow(flow):
        return None
    method = _text(args[0] if args else kwargs.get("method_name"))
    attrs = {"crewai.flow.name": type(flow).__name__, "crewai.flow.method": method}
    return start_agent_span(method, FRAMEWORK, attributes=attrs)


def original_tool(tool: Any) -> Any:
    """The tool a span is about: a ``CrewStructuredTool`` stands for the ``BaseTool`` it was made from."""
    return getattr(tool, "_original_tool", None) or tool


def _run_arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return {"args": list(args), **kwargs} if args else dict(kwargs)


def _start_tool(tool: Any, arguments: Any) -> otel_trace.Span:
    call_id = None
    native = _NATIVE_CALL.get()
    if native is not None and not native.tool_started:
        native.tool_started = True  # consumed: a tool run inside this one is not that call
        call_id = native.call_id
    return start_tool_span(
        _text(getattr(tool, "name", None)) or type(tool).__name__, FRAMEWORK, arguments, call_id=call_id
    )


def start_tool_run(tool: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> otel_trace.Span:
    """``BaseTool.run(**arguments)``: the native tool-calling path and direct calls."""
    return _start_tool(tool, _run_arguments(args, kwargs))


def start_tool_invoke(tool: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> otel_trace.Span:
    """``CrewStructuredTool.invoke(input)``: the ReAct (text) tool path, which skips ``BaseTool.run``."""
    return _start_tool(tool, args[0] if args else kwargs.get("input"))


# -- native tool call ids -----------------------------------------------------------------------------------
def _call_id(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """The call id from ``_execute_single_native_tool_call(tool_call)`` (newer CrewAI: the provider's tool
    call object or dict) or ``(call_id=..., ...)`` (older CrewAI)."""
    if "call_id" in kwargs:
        return _text(kwargs["call_id"]) or None
    call = args[0] if args else kwargs.get("tool_call")
    value = call.get("id") if isinstance(call, dict) else getattr(call, "id", None)
    return value if isinstance(value, str) and value else None


def with_native_call_id(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """Wrapper of the executor's per-call method: the tool span made inside gets the model's call id, and a
    call CrewAI answers with an error without running a tool (an unknown tool name, a spent
    ``max_usage_count``) gets an error tool span of its own."""
    token = native = None
    if Hooks.owner is not None:
        try:
            native = _NativeCall(_call_id(args, kwargs))
            token = _NATIVE_CALL.set(native)
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("crewai.call_id", exc)
    started = time.time_ns()
    try:
        outcome = wrapped(*args, **kwargs)
    except BaseException as exc:
        if native is not None and not native.tool_started:
            with guard("crewai.unrun_tool_call"):  # the user's exception propagates regardless
                _record_aborted_call(native, args, kwargs, exc, started)
        raise
    finally:
        if token is not None:
            _NATIVE_CALL.reset(token)
    if native is not None and not native.tool_started:
        try:
            _record_call_without_tool(native, args, kwargs, outcome, started)
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("crewai.unrun_tool_call", exc)
    return outcome


# -- tool calls CrewAI answers with an error --------------------------------------------------------------------
# CrewAI's answer to a native call of a tool the agent lacks (older CrewAI, 1.10, has no structured failure).
_TOOL_NOT_FOUND = "Tool not found"
# CrewAI's ToolFailureReason values (1.15.30) for calls it settles without running the tool.
_NOT_RUN_REASONS = frozenset({"unknown_tool", "usage_limit"})


def _outcome(outcome: Any) -> Dict[str, Any]:
    """A native call's outcome as a dict: the executors' method returns one, the planning ``StepExecutor``'s
    function (CrewAI 1.15) a ``NativeToolCallResult`` dataclass (no ``tool_failure``, no ``original_tool``)."""
    if isinstance(outcome, dict):
        return outcome
    if dataclasses.is_dataclass(outcome) and not isinstance(outcome, type):
        return {field.name: getattr(outcome, field.name) for field in dataclasses.fields(outcome)}
    return {}


def _unrun_failure(outcome: Dict[str, Any]) -> Optional[str]:
    """The error text the model is given for a native call no tool ran for, or None if it did not fail so.

    Newer CrewAI (1.15.30) says why in ``tool_failure`` (a ``ToolFailure``); older CrewAI (and 1.15's
    ``StepExecutor``) only answers its ``"Tool not found"`` placeholder, which is recognised (its spent-tool
    text is a template and is not)."""
    message = outcome.get("result")
    if not isinstance(message, str):
        return None
    if "tool_failure" in outcome:
        return message if _failure_reason(outcome["tool_failure"]) in _NOT_RUN_REASONS else None
    if outcome.get("original_tool") is None and not outcome.get("from_cache") and message == _TOOL_NOT_FOUND:
        return message
    return None


def _failure_reason(failure: Any) -> Optional[str]:
    reason = getattr(failure, "reason", None)
    value = getattr(reason, "value", reason)
    return value if isinstance(value, str) else None


def _requested(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Optional[str], Any]:
    """The tool name as the model wrote it and its arguments, from the provider's tool call object or dict
    (newer CrewAI) or ``func_name=`` / ``func_args=`` (older CrewAI)."""
    if "func_name" in kwargs:
        return _text(kwargs["func_name"]) or None, kwargs.get("func_args")
    call = args[0] if args else kwargs.get("tool_call")
    if isinstance(call, dict):
        function = call.get("function") or {}
        name = function.get("name") or call.get("name")
        arguments = function.get("arguments", call.get("arguments", call.get("input")))
    else:
        function = getattr(call, "function", None) or getattr(call, "function_call", None)
        source = function if function is not None else call
        name = getattr(source, "name", None)
        arguments = getattr(source, "arguments", None)
        if arguments is None:
            arguments = getattr(source, "args", None) or getattr(call, "input", None)
    return (name if isinstance(name, str) and name else None), arguments


def _record_call_without_tool(
    native: _NativeCall, args: Tuple[Any, ...], kwargs: Dict[str, Any], outcome: Any, started: int
) -> None:
    """An error tool span (parented where the tool's span would be) for a call CrewAI failed unrun."""
    fields = _outcome(outcome)
    message = _unrun_failure(fields)
    if message is None:
        return
    name, arguments = _requested(args, kwargs)
    name = name or _text(fields.get("func_name")) or "unknown"
    call_id = native.call_id or _text(fields.get("call_id")) or None
    record_failed_tool_call(name, FRAMEWORK, arguments, message, call_id=call_id, start_time=started)


def _record_aborted_call(
    native: _NativeCall, args: Tuple[Any, ...], kwargs: Dict[str, Any], error: BaseException, started: int
) -> None:
    """Under ``tool_failure_policy="raise"`` (CrewAI 1.15.30) a call CrewAI settles unrun (an unknown tool,
    a spent one) raises ``ToolExecutionFailedError`` instead of answering the model: the error tool span is
    recorded before the run aborts, so the model call that asked for it is still penalised."""
    failure = getattr(getattr(error, "record", None), "failure", None)
    if type(error).__name__ != "ToolExecutionFailedError" or _failure_reason(failure) not in _NOT_RUN_REASONS:
        return
    name, arguments = _requested(args, kwargs)
    name = name or _text(getattr(error.record, "tool_name", None)) or "unknown"  # type: ignore[attr-defined]  # CrewAI's error record carries it
    message = _failure_text(failure) or _text(error)
    record_failed_tool_call(name, FRAMEWORK, arguments, message, call_id=native.call_id, start_time=started)


# -- tool results that are failures -----------------------------------------------------------------------------
def _failure_text(failure: Any) -> Optional[str]:
    """What the agent reads for a CrewAI ``ToolFailure`` (CrewAI 1.15.30; None for anything else). A tool
    that *returns* one (1.15's way to fail without raising; also what a spent tool's ``run`` returns) failed."""
    klass = type(failure)
    if klass.__name__ != "ToolFailure" or not klass.__module__.startswith("crewai."):
        return None
    render = getattr(failure, "as_agent_message", None)
    return _text(render() if callable(render) else getattr(failure, "message", None))


# -- text (ReAct) tool calls CrewAI cannot run --------------------------------------------------------------------
def with_unrunnable_action(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """Wrapper of ``ToolUsage.parse_tool_calling``, where CrewAI's text (ReAct) tool path turns the model's
    ``Action:`` / ``Action Input:`` into a call. When it answers a ``ToolUsageError`` instead (the action names
    a tool the agent does not have, or its input does not parse), no tool runs and the model reads that
    error as the observation: an error tool span records it, in the agent's context like a tool span that
    ran (no call id: text calls have none, so AIR credits the agent's last model call, the one that wrote
    the action). Under ``tool_failure_policy="raise"`` CrewAI aborts right after; the span is already made."""
    started = time.time_ns()
    calling = wrapped(*args, **kwargs)
    if Hooks.owner is not None:
        with guard("crewai.unrunnable_action"):
            _record_unrunnable_action(instance, calling, started)
    return calling


def _record_unrunnable_action(usage: Any, calling: Any, started: int) -> None:
    if type(calling).__name__ != "ToolUsageError":
        return
    message = _text(getattr(calling, "message", None)) or _text(calling)
    action = getattr(usage, "action", None)
    name = _text(getattr(action, "tool", None)) or "unknown"
    record_failed_tool_call(name, FRAMEWORK, getattr(action, "tool_input", None), message, start_time=started)


def _handled_tool_failure(tool: Any, result: Any) -> Optional[str]:
    """The result of a tool that ran and answered a failure as text: CrewAI's delegation tools (hierarchical
    process, ``allow_delegation``) return an error message for a coworker that does not exist. CrewAI gives
    no structured signal there, so the text is matched against CrewAI's own template (the one it formats
    the message from, translated if CrewAI's prompts are)."""
    tool = original_tool(tool)
    if not isinstance(result, str) or not any(k.__name__ == "BaseAgentTool" for k in type(tool).__mro__):
        return None
    i18n = getattr(tool, "i18n", None) or getattr(sys.modules.get("crewai.utilities.i18n"), "I18N_DEFAULT", None)
    template = i18n.errors("agent_tool_unexisting_coworker") if i18n is not None else None
    prefix = template.split("{", 1)[0].strip() if isinstance(template, str) else ""
    return result if prefix and result.strip().startswith(prefix) else None
