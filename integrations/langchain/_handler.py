"""agl's LangChain callback handler: LangChain runs -> agent / chain / tool spans, parented by run id.

Why it looks like this:
- Parents come from LangChain's ``run_id`` / ``parent_run_id``, kept in a thread-safe run table, never
  from the ambient OpenTelemetry context: callbacks of parallel nodes and async tasks interleave, and a
  handler that attached contexts would leak one on the first missed end event. So spans are started
  explicitly (``start_*_span(parent=...)``) and never made current.
- The OpenAI-client layer makes the one ``llm`` span per request. To nest it under the right node it asks
  :meth:`AglCallbackHandler.llm_parent` (a parent resolver): LangChain keeps the config of the Runnable that
  is calling the model in ``var_child_runnable_config``, whose callback manager names that run. That is not
  always set: LangGraph runs the steps after the first of a node that is a chain (``prompt | model``) outside
  it, so the model run's own start event (called inline, in the caller's context) also notes the run in a
  context variable of ours, which the resolver prefers while the Runnable config is still the one the model
  run started under. Only the resolver reads it; no span is made current.
- Every run is recorded, spanned or not, with its *anchor* (its own span or its nearest ancestor's), so a
  run under a transparent one (a prompt, a sequence, a routing function) still finds its parent in O(1).
- ``run_inline``: LangChain then calls it in the caller's thread and context, in event order, even from
  async code (otherwise async managers run sync handlers in an executor thread).
- Disabled by :meth:`disable` on uninstrument: callback managers built before keep a reference to it, so
  it must become inert rather than be removed from every manager.
- What the model was told decides a tool span's status, since AIR rewards the call that asked for the tool
  by it: a tool that handles its own failure still ends "successfully" with a ``ToolMessage`` whose status
  is ``error``; and ``ToolNode(handle_tool_errors=...)`` writes the error text only after the tool's run
  failed, so that span waits for the end of the run it ran in, whose output holds the text, and finds it
  there by call id (older langchain-core sends tool events none: then the matching call in the node's
  inputs). A call that a node answers with an error without running any tool (an unknown tool name, a call
  middleware blocked) gets an error tool span of its own when that node ends, since its output holds it.
- Runs LangChain never ends leave the table with the run they ran in, their spans ended as stopped: a model
  call whose task is cancelled (``asyncio.wait_for`` around ``ainvoke``) gets no end event; nor does a node
  whose task ``asyncio.run`` cancels on its way out (a caller that left ``astream()`` early) while its end
  event waits in the task LangChain's ``shielded`` made for it, which that cancels before it ever runs.
- Not failures: LangGraph's control flow (``interrupt()``), and a caller that stops a run (breaks out of a
  graph stream, cancels its task): those spans end without error status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, TypeVar
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables.config import var_child_runnable_config
from opentelemetry import trace as otel_trace

from agl import semconv
from agl._util.safety import report_internal_error
from agl.instrumentation.framework import (
    finish_span,
    finish_tool,
    mark_as_agent,
    set_tool_result,
    start_agent_span,
    start_chain_span,
    start_tool_span,
)
from agl.instrumentation.tool_failures import mark_tool_failed, record_failed_tool_call
from agl.integrations.langchain._runs import (
    ParentInfo,
    SpanPlan,
    is_node_run,
    parent_info,
    plan_chain_run,
    run_name,
)
from agl.tracing.tracer import record_exception

FRAMEWORK = "langchain"
F = TypeVar("F", bound=Callable[..., Any])

# LangGraph raises these to pause or redirect a graph (interrupt(), Command(graph=PARENT)): control
# flow, not failures, so the runs they unwind are not marked as errors.
_CONTROL_FLOW_ERRORS = frozenset({"GraphBubbleUp", "GraphInterrupt", "ParentCommand", "NodeInterrupt"})
# Raised into a run when its caller stops it: a generator closed early (a graph stream the consumer broke
# out of), a cancelled task (astream's and astream_events' running nodes when the consumer leaves).
_STOPPED_BY_CALLER = (GeneratorExit, asyncio.CancelledError)

# The model (or retriever) run started last in this context, and the run that LangChain's Runnable config named
# then: see AglCallbackHandler.llm_parent. Set by the run's start event, cleared by its end.
_leaf_run: ContextVar[Optional[Tuple[UUID, Optional[UUID]]]] = ContextVar("agl_langchain_leaf_run", default=None)


@dataclass
class _Node:
    """A running LangGraph node, for the tool calls it answers without a tool run (see ``_record_unrun_calls``)."""

    run_id: UUID
    inputs: Any  # what the node was given: the model's tool calls it answers are in it
    ran: Set[str] = field(default_factory=set)  # call ids (or tool names, when no id is known) a tool ran for
    nested: bool = False  # other nodes ran inside it (a subgraph): they answered the calls, not this one


@dataclass(frozen=True)
class _Run:
    """One live LangChain run as agl tracks it."""

    span: Optional[otel_trace.Span]  # the run's own span, if it got one
    anchor: Optional[otel_trace.Span]  # own span, else the nearest ancestor's: the parent of what runs inside
    info: ParentInfo  # what its child runs' naming decisions need
    name: str = ""  # the run's name, for a chain span that turns out to be an agent
    is_agent: bool = False
    node: Optional[_Node] = None  # the node that runs started inside this one run in (none inside a tool run)
    call_id: Optional[str] = None  # a tool run's: the model's call it answers
    parent_id: Optional[UUID] = None  # the run it ran in, if that one is in the table


@dataclass(frozen=True)
class _FailedTool:
    """A tool span that failed, waiting for the end of the run it ran in (see :meth:`AglCallbackHandler._settle`)."""

    span: otel_trace.Span
    call_id: str
    end_time: int  # when the tool's run failed


def _callback(fn: F) -> F:
    """Every callback: a no-op once disabled, and an error in agl's code is reported, never raised."""
    site = f"langchain.{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(self: AglCallbackHandler, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - LangChain would only log it; we count it too
            report_internal_error(site, exc)
            return None

    return wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps


class AglCallbackHandler(BaseCallbackHandler):
    """Added (inheritable) to every LangChain callback manager by :class:`LangChainInstrumentor`."""

    run_inline = True
    raise_error = False

    def __init__(self) -> None:
        self.enabled = True
        self._lock = threading.Lock()
        self._runs: Dict[UUID, _Run] = {}
        self._failed_tools: Dict[UUID, List[_FailedTool]] = {}  # by the run the tools ran in
        self._children: Dict[UUID, Set[UUID]] = {}  # the runs in the table, by the run they ran in

    # -- lifecycle -------------------------------------------------------------------------------------------
    def disable(self) -> None:
        """Become inert; end the spans of runs still open so none is left unfinished in the tracer."""
        self.enabled = False
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
            failed, self._failed_tools = [t for tools in self._failed_tools.values() for t in tools], {}
            self._children = {}
        for tool in failed:
            with contextlib.suppress(Exception):
                tool.span.end(end_time=tool.end_time)
        for run in runs:
            if run.span is not None:
                with contextlib.suppress(Exception):
                    run.span.end()

    def llm_parent(self) -> Optional[otel_trace.Span]:
        """Parent resolver for the OpenAI-client layer: the span of the LangChain run calling the model.

        That is the model run started in this context, while the Runnable config is still the one it started
        under (LangGraph runs the model of a ``prompt | model`` node with no config of its own, or with an
        enclosing node's when the graph runs inside another graph's node function); else the run the Runnable
        config names (a node function calling the OpenAI client directly, code entered since the model run).
        """
        if not self.enabled:
            return None
        config_run_id = _config_run_id()
        leaf, run = _leaf_run.get(), None
        if leaf is not None and leaf[1] == config_run_id:
            run = self._get(leaf[0])
        if run is None:
            run = self._get(config_run_id)
        return _innermost(run.anchor) if run is not None else None

    # -- chains (graphs, nodes, agents, sequences...) --------------------------------------------------------
    @_callback
    def on_chain_start(
        self,
        serialized: Optional[Dict[str, Any]],
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: Optional[UUID] = None,
        tags: Optional[List[str]] = None,
        metadata: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        parent = self._get(parent_run_id)
        name = run_name(kwargs.get("name"), serialized, "chain")
        plan = plan_chain_run(name, serialized, tags, metadata, parent.info if parent else None)
        span = self._start_planned(plan, parent) if plan is not None else None
        info = parent_info(metadata, plan is not None and plan.named_agent)
        node = parent.node if parent is not None else None
        if is_node_run(name, tags or [], metadata, parent.info if parent else None):
            if node is not None:
                node.nested = True
            node = _Node(run_id, inputs)
        self._put(run_id, span, parent, info, name, plan is not None and plan.kind == "agent", node, parent_run_id)

    @_callback
    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._end(run_id, outputs)
        if run is None:
            return
        try:
            if run.node is not None and run.node.run_id == run_id:
                self._record_unrun_calls(run, run.node, outputs)
        finally:  # the node's span ends even if agl's own code failed above
            if run.span is not None:
                finish_span(run.span)

    @_callback
    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._end(run_id)
        if run is not None and run.span is not None:
            finish_span(run.span, _failure(run.span, error))

    @_callback
    def on_agent_action(self, action: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._promote_to_agent(run_id)

    @_callback
    def on_agent_finish(self, finish: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._promote_to_agent(run_id)

    def _promote_to_agent(self, run_id: UUID) -> None:
        """A classic ``AgentExecutor`` reports its actions on its own run, which the start event could not
        tell apart from any chain (no class, any run name): its chain span becomes an agent span named after
        the run. Calls it made before its first action already hang under that span, so they move with it."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.span is None or run.is_agent:
                return
            self._runs[run_id] = replace(run, is_agent=True)
        mark_as_agent(run.span, run.name, FRAMEWORK)

    # -- tools ------------------------------------------------------------------------------------------------
    @_callback
    def on_tool_start(
        self,
        serialized: Optional[Dict[str, Any]],
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: Optional[UUID] = None,
        metadata: Optional[Dict[str, Any]] = None,
        inputs: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        parent = self._get(parent_run_id)
        name = str((serialized or {}).get("name") or kwargs.get("name") or "tool")
        arguments = dict(inputs) if inputs is not None else input_str  # a snapshot: encoded later
        given = kwargs.get("tool_call_id")
        call_id = given if isinstance(given, str) else None
        if parent is not None and parent.node is not None:
            call_id = self._claim_call(parent.node, name, arguments, call_id)
        span = start_tool_span(name, FRAMEWORK, arguments, call_id=call_id, parent=_parent_of(parent))
        # no node: runs inside a tool answer no call
        self._put(run_id, span, parent, parent_info(metadata), call_id=call_id, parent_id=parent_run_id)

    @_callback
    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self._end(run_id, output)
        if run is None or run.span is None:
            return
        result, call_id = _tool_output(output)
        if call_id:  # langchain-core before langchain-ai/langchain#34235 gives none at start; the ToolMessage has it
            run.span.set_attribute(semconv.TOOL_CALL_ID, call_id)
        if _is_error_message(output):  # handle_tool_error / handle_validation_error: the model reads the error
            _fail_with_text(run.span, result)
        finish_tool(run.span, result)

    @_callback
    def on_tool_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: Optional[UUID] = None, **kwargs: Any
    ) -> None:
        run = self._end(run_id)
        if run is None or run.span is None:
            return
        failure = _failure(run.span, error)
        if failure is None:
            finish_tool(run.span)
            return
        record_exception(run.span, failure)
        if not self._await_error_text(run.span, run.call_id or kwargs.get("tool_call_id"), parent_run_id):
            run.span.end()

    def _claim_call(self, node: _Node, name: str, arguments: Any, call_id: Optional[str]) -> Optional[str]:
        """The call id of a tool run starting in ``node``, noted there as a call the node does not answer
        unrun. Older langchain-core (0.3.30 for one) gives tool events no call id (it is sent since
        langchain-ai/langchain#34235), yet a failed tool's span needs it to find the error text the node
        answers the call with (:meth:`_settle`): it is then the id of the call in the node's inputs that
        asked for this tool with these arguments, and no other run claimed."""
        with self._lock:  # ToolNode runs a message's tool calls in parallel threads
            if call_id is None:
                call_id = _match_call(node, name, arguments)
            node.ran.add(call_id if call_id is not None else name)
        return call_id

    def _await_error_text(self, span: otel_trace.Span, call_id: Any, parent_run_id: Optional[UUID]) -> bool:
        """Leave a failed tool's span to end with the run it ran in (:meth:`_settle`), whose outputs may hold
        the error text the model is given; False (end it now) without a call id to find it by, or that run."""
        if not isinstance(call_id, str) or parent_run_id is None:
            return False
        with self._lock:
            if parent_run_id not in self._runs:
                return False
            self._failed_tools.setdefault(parent_run_id, []).append(_FailedTool(span, call_id, time.time_ns()))
        return True

    def _settle(self, run_id: UUID, outputs: Any) -> None:
        """End the failed tools that ran in this run, with the error text its outputs give the model, if any.

        ``ToolNode(handle_tool_errors=True)`` catches the tool's exception after the tool's run ended, and
        answers the model with a ``ToolMessage`` (status ``error``, e.g. "Error: ZeroDivisionError(...)
        Please fix your mistakes.") that only the node's outputs hold.
        """
        with self._lock:
            failed = self._failed_tools.pop(run_id, None)
        if not failed:
            return
        texts = {message.tool_call_id: message.content for message in _error_messages(outputs)}
        for tool in failed:
            if tool.call_id in texts:
                set_tool_result(tool.span, texts[tool.call_id])
            tool.span.end(end_time=tool.end_time)

    def _record_unrun_calls(self, run: _Run, node: _Node, outputs: Any) -> None:
        """An error tool span, under the node, for each call the node answered with an error without running a
        tool: LangGraph's ``ToolNode`` for an unknown tool name ("Error: x is not a valid tool..."), middleware
        such as ``ToolCallLimitMiddleware`` for a blocked call. No tool run means no callback, but the model
        reads the error and AIR penalises the call by its tool span. A node that other nodes ran in (a
        subgraph) answered nothing itself: its output repeats theirs.
        """
        if node.nested:
            return
        unrun = [m for m in _error_messages(outputs) if m.tool_call_id not in node.ran and m.name not in node.ran]
        if not unrun:
            return
        seen = {message.tool_call_id for message in _tool_messages(node.inputs)}  # answered before this node
        requested = {call.get("id"): call for call in _tool_calls(node.inputs)}
        for message in unrun:
            if message.tool_call_id in seen:
                continue
            call = requested.get(message.tool_call_id, {})
            name = call.get("name") or message.name or "unknown"
            text = message.content if isinstance(message.content, str) else str(message.content)
            record_failed_tool_call(
                name, FRAMEWORK, call.get("args"), text, call_id=message.tool_call_id, parent=run.anchor
            )

    # -- model and retriever runs: no span (the OpenAI layer makes the llm span), but kept in the run table
    # so anything a custom model or retriever runs inside still finds its parent ------------------------------
    @_callback
    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: Optional[UUID] = None, **kwargs: Any
    ) -> None:
        self._pass_through(run_id, parent_run_id)

    @_callback
    def on_llm_start(
        self, serialized: Any, prompts: Any, *, run_id: UUID, parent_run_id: Optional[UUID] = None, **kwargs: Any
    ) -> None:
        self._pass_through(run_id, parent_run_id)

    @_callback
    def on_retriever_start(
        self, serialized: Any, query: Any, *, run_id: UUID, parent_run_id: Optional[UUID] = None, **kwargs: Any
    ) -> None:
        self._pass_through(run_id, parent_run_id)

    @_callback
    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end_pass_through(run_id)

    @_callback
    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end_pass_through(run_id)

    @_callback
    def on_retriever_end(self, documents: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end_pass_through(run_id)

    @_callback
    def on_retriever_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end_pass_through(run_id)

    # -- LangGraph graph lifecycle: dispatched to every handler of its graph callback managers ----------------
    def on_interrupt(self, event: Any) -> None:
        """LangGraph's interrupt event; the interrupted node's run already ends (without error status)."""

    def on_resume(self, event: Any) -> None:
        """LangGraph's resume event; the resumed nodes start new runs."""

    # -- the run table ----------------------------------------------------------------------------------------
    def _start_planned(self, plan: SpanPlan, parent: Optional[_Run]) -> otel_trace.Span:
        start = start_agent_span if plan.kind == "agent" else start_chain_span
        return start(plan.name, FRAMEWORK, parent=_parent_of(parent))

    def _pass_through(self, run_id: UUID, parent_run_id: Optional[UUID]) -> None:
        parent = self._get(parent_run_id)
        info = replace(parent.info, named_agent=False) if parent else ParentInfo(None, False)
        self._put(run_id, None, parent, info, parent_id=parent_run_id)
        _leaf_run.set((run_id, _config_run_id()))

    def _end_pass_through(self, run_id: UUID) -> None:
        self._end(run_id)
        leaf = _leaf_run.get()
        if leaf is not None and leaf[0] == run_id:  # an end in another context cannot clear it there: the id
            _leaf_run.set(None)  # left behind is then in no table, so the resolver ignores it

    def _put(
        self,
        run_id: UUID,
        span: Optional[otel_trace.Span],
        parent: Optional[_Run],
        info: ParentInfo,
        name: str = "",
        is_agent: bool = False,
        node: Optional[_Node] = None,
        parent_id: Optional[UUID] = None,
        call_id: Optional[str] = None,
    ) -> None:
        anchor = span if span is not None else (parent.anchor if parent else None)
        parent_id = parent_id if parent is not None else None
        with self._lock:
            self._runs[run_id] = _Run(span, anchor, info, name, is_agent, node, call_id, parent_id)
            if parent_id is not None:
                self._children.setdefault(parent_id, set()).add(run_id)

    def _get(self, run_id: Optional[UUID]) -> Optional[_Run]:
        if run_id is None:
            return None
        with self._lock:
            return self._runs.get(run_id)

    def _end(self, run_id: UUID, outputs: Any = None) -> Optional[_Run]:
        """Take an ended run out of the table, after ending the failed tools that ran in it and the runs still
        open in it (:meth:`_take_orphans`)."""
        self._settle(run_id, outputs)
        with self._lock:
            run = self._runs.pop(run_id, None)
            if run is not None and run.parent_id is not None:
                siblings = self._children.get(run.parent_id)
                if siblings is not None:
                    siblings.discard(run_id)
                    if not siblings:
                        del self._children[run.parent_id]
            orphans = self._take_orphans(run_id)
        for orphan_id, orphan in orphans:
            self._settle(orphan_id, None)
            if orphan.span is not None:
                orphan.span.set_attribute(semconv.SPAN_STOPPED, True)
                finish_span(orphan.span)
        return run

    def _take_orphans(self, run_id: UUID) -> List[Tuple[UUID, _Run]]:
        """Take the runs still open in an ended run out of the table (lock held), the innermost first: they
        never got an end event and never will (see the module's docstring), so their spans end now, marked
        stopped like a run its caller stopped, rather than stay open until the rollout ends."""
        orphans: List[Tuple[UUID, _Run]] = []
        for child_id in self._children.pop(run_id, ()):
            orphans.extend(self._take_orphans(child_id))
            child = self._runs.pop(child_id, None)
            if child is not None:
                orphans.append((child_id, child))
        return orphans


def _config_run_id() -> Optional[UUID]:
    """The run that LangChain's current Runnable config names as the parent of what runs in it."""
    config = var_child_runnable_config.get()
    manager = config.get("callbacks") if config else None
    return getattr(manager, "parent_run_id", None)


def _parent_of(parent: Optional[_Run]) -> Optional[otel_trace.Span]:
    """The explicit parent for a new span; None means the ambient context (a root run, or see
    :func:`_innermost`)."""
    return _innermost(parent.anchor) if parent is not None else None


def _innermost(anchor: Optional[otel_trace.Span]) -> Optional[otel_trace.Span]:
    """``anchor``, unless an agent span opened inside that run is current (then None: the current context).

    agl's LangChain spans are never current, so a current span that started after ``anchor`` was opened by
    code running inside the run: if it is an agent (another adapter's, or ``agent_span``), the calls made
    in it are that agent's and it must stay their parent. Any other span opened there (``agl.operation``,
    ``@agl.tool``) hangs under the ambient context, not under ``anchor``: parenting an LLM call to it would
    cut the call off from its node, so the node stays the parent.
    """
    if anchor is None:
        return None
    current = otel_trace.get_current_span()
    if not current.is_recording() or (getattr(current, "attributes", None) or {}).get(semconv.SPAN_KIND) != "agent":
        return anchor
    current_start, anchor_start = getattr(current, "start_time", None), getattr(anchor, "start_time", None)
    return None if current_start and anchor_start and current_start > anchor_start else anchor


def _is_control_flow(error: BaseException) -> bool:
    return any(cls.__name__ in _CONTROL_FLOW_ERRORS for cls in type(error).__mro__)


def _failure(span: otel_trace.Span, error: BaseException) -> Optional[BaseException]:
    """The error to record on a run's span, or None when ``error`` is no failure of the run: LangGraph's
    control flow, or the caller stopping the run (then marked ``agl.span.stopped``)."""
    if isinstance(error, _STOPPED_BY_CALLER):
        span.set_attribute(semconv.SPAN_STOPPED, True)
        return None
    return None if _is_control_flow(error) else error


def _fail_with_text(span: otel_trace.Span, text: Any) -> None:
    """Error status for a failure that LangChain reports as a message (no exception, e.g. a tool's handled
    error): its text is the status description, as the model read it."""
    mark_tool_failed(span, text if isinstance(text, str) else str(text))


def _is_error_message(output: Any) -> bool:
    """A ``ToolMessage`` that tells the model its tool call failed."""
    return getattr(output, "type", None) == "tool" and getattr(output, "status", None) == "error"


def _error_messages(outputs: Any) -> Iterator[Any]:
    """The error ``ToolMessage``s with a call id in a run's outputs."""
    return (message for message in _tool_messages(outputs) if _is_error_message(message))


def _tool_calls(inputs: Any, depth: int = 3) -> Iterator[Dict[str, Any]]:
    """The model's tool calls in a node's inputs: a state whose messages hold the model's ``AIMessage``, or
    the calls themselves (``create_agent``'s tools node gets a list of them, ``ToolNode`` under
    ``create_react_agent`` one inside a ``Send``'s ``{"tool_call": ...}``), looked for a few levels deep."""
    calls = getattr(inputs, "tool_calls", None)
    if isinstance(calls, list):  # an AIMessage
        yield from (call for call in calls if isinstance(call, dict))
    elif isinstance(inputs, dict) and inputs.get("type") == "tool_call":
        yield inputs
    elif depth > 0 and isinstance(inputs, (dict, list, tuple)):
        for item in inputs.values() if isinstance(inputs, dict) else inputs:
            yield from _tool_calls(item, depth - 1)


def _match_call(node: _Node, name: str, arguments: Any) -> Optional[str]:
    """The id of the first call in ``node``'s inputs to tool ``name`` with ``arguments`` (a tool's own
    arguments: ``ToolNode`` may add injected ones) that neither a message before the node answered nor
    another tool run claimed; None when no call fits."""
    taken = node.ran | {message.tool_call_id for message in _tool_messages(node.inputs)}
    for call in _tool_calls(node.inputs):
        call_id, args = call.get("id"), call.get("args")
        if call.get("name") != name or not isinstance(call_id, str) or call_id in taken:
            continue
        if not (isinstance(args, dict) and isinstance(arguments, dict)) or all(
            key in arguments and arguments[key] == value for key, value in args.items()
        ):
            return call_id
    return None


def _tool_messages(outputs: Any, depth: int = 3) -> Iterator[Any]:
    """The ``ToolMessage``s with a call id in a run's outputs (a state update: a dict of lists of messages, a
    list of them, or a LangGraph ``Command`` whose ``update`` holds them), looked for a few levels deep."""
    if getattr(outputs, "type", None) == "tool" and isinstance(getattr(outputs, "tool_call_id", None), str):
        yield outputs
    elif depth > 0:
        update = getattr(outputs, "update", None) if not isinstance(outputs, (dict, list, tuple)) else None
        if update is not None:  # a tool returning Command(update={"messages": [ToolMessage(...)], ...})
            yield from _tool_messages(update, depth - 1)
        elif isinstance(outputs, (dict, list, tuple)):
            for item in outputs.values() if isinstance(outputs, dict) else outputs:
                yield from _tool_messages(item, depth - 1)


def _tool_output(output: Any) -> Tuple[Any, Optional[str]]:
    """What the model sees of a tool's output (a ToolMessage's content, also inside a ``Command`` the tool
    returned) and the call id it answers."""
    content = getattr(output, "content", None)
    if content is None:
        message = next(_tool_messages(output), None)
        if message is None:
            return output, None
        output, content = message, message.content
    call_id = getattr(output, "tool_call_id", None)
    return (list(content) if isinstance(content, list) else content), (call_id if isinstance(call_id, str) else None)
