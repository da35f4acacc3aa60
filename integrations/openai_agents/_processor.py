"""The Agents SDK ``TracingProcessor`` that mirrors the SDK's spans as agl spans.

The SDK reports every trace and span it makes to its registered processors, synchronously and in the
task that runs the agent, which is the one extension point that sees handoffs, agents-as-tools and
guardrails without patching. The mapping:

- trace → ``chain`` span ``workflow <name>`` (groups one ``Runner.run`` or a user's ``trace()`` block);
- ``AgentSpanData`` → ``agent`` span named by ``Agent.name``; it is made *current* (OpenTelemetry
  context) while it is open, so the ``llm`` spans that agl's OpenAI-client layer makes for this agent's
  model requests, and any span the user makes inside, nest under it;
- ``FunctionSpanData`` → ``tool`` span (arguments, result, call id, error status), current as well;
- ``HandoffSpanData`` / ``GuardrailSpanData`` → ``chain`` spans (from/to agents, triggered);
- everything else (model ``Response``/``Generation`` spans, the SDK's task/turn/custom spans, MCP
  listings) passes through: its children hang under the nearest mirrored ancestor. Model spans never
  become ``llm`` spans; the client layer makes exactly one per HTTP request.

Errors. The SDK reports failures as a ``SpanError`` on the span it deems responsible. An error on one of
its run-structure spans (``task``, ``turn``: a tool name the agent lacks, a non-streamed input guardrail
tripwire) is the run's failure, so it marks the nearest mirrored ancestor (the agent span) failed, as the
streamed path, where the SDK puts the same error on the agent span, does. Errors on the other pass-through
spans stay there: a failed model request is already an error ``llm`` span and may be retried by the SDK
(``ModelRetrySettings``), and a custom span's error (a sandbox command's non-zero exit) is not the agent's.
The first error an agl span gets is kept: a later one (the SDK's generic ``Error in agent run`` on the
agent span, after its turn's specific error) neither replaces it nor counts twice.
A function tool that timed out with ``timeout_behavior="error_as_result"`` gives the model the SDK's
message but leaves no ``SpanError``; see :func:`_timeout_message`. Nor does a cancelled one: a tool cancelled
before it finished fails as ``CancelledError`` (see :func:`_end_tool`), and the spans of a run cancelled
that way are marked ``agl.span.stopped``, as LangChain's adapter marks a run its caller stopped (see
:meth:`AglTracingProcessor.on_trace_end`). How a run ended is read from the exception leaving the SDK's
block as it ends the span (see :func:`_leaving`); an agent span that an exception left without a
``SpanError`` (SDKs before 0.19.4 put none there on a non-streamed run) gets the SDK's generic one,
``Error in agent run``, as newer SDKs do.

Parents come from the SDK's ``parent_id`` (else the trace), not from the ambient context, so concurrent
runs cannot cross. Making a span current follows the SDK exactly: the SDK marks these spans current right
after ``on_span_start`` and resets them right after ``on_span_end`` in the same context, so our
attach/detach pair nests the same way. A span the SDK ends from another context (an abandoned async
generator finalized elsewhere) cannot be detached there; :class:`_Attachment` notices and leaves that
foreign context alone instead of corrupting it.
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from agents.tracing import (
    AgentSpanData,
    FunctionSpanData,
    GuardrailSpanData,
    HandoffSpanData,
    Span,
    SpanError,
    Trace,
    TracingProcessor,
)
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import StatusCode

from agl import semconv
from agl._util.safety import guarded
from agl.instrumentation.framework import finish_span, finish_tool, start_agent_span, start_tool_span
from agl.integrations.openai_agents._tool_calls import ToolCall, requested_calls, take_call_id
from agl.tracing.tracer import get_tracer

FRAMEWORK = "openai_agents"
HANDOFF_FROM = "openai_agents.handoff.from_agent"
HANDOFF_TO = "openai_agents.handoff.to_agent"
GUARDRAIL_TRIGGERED = "openai_agents.guardrail.triggered"
TRACE_ID = "openai_agents.trace_id"
TOOL_TIMEOUT = "ToolTimeoutError"  # error.type of a timed-out tool: the exception the SDK made of the timeout
RUN_ERROR = "Error in agent run"  # the SDK's message on the agent span of a failed run (non-streamed: 0.19.4+)

# The SDK's run-structure spans (``SpanData.type``; older SDKs make none, hence no import of their classes):
# an error on one of them is the enclosing agent's failure.
_RUN_SPAN_TYPES = frozenset({"task", "turn"})
# agents.tool.default_tool_timeout_error_message, exactly:
# f"Tool '{tool_name}' timed out after {timeout_seconds:g} seconds."
_TIMEOUT_MESSAGE = re.compile(r"Tool '(?P<name>.+)' timed out after (?P<seconds>[0-9.e+\-]+|inf) seconds\.")

# Set beside each OpenTelemetry attach: resetting it tells whether we are still in the context that made
# the attach (a contextvar token is only valid there), before OpenTelemetry's own detach would log an error.
_attach_owner: contextvars.ContextVar[bool] = contextvars.ContextVar("agl_openai_agents_attach", default=False)


class _Attachment:
    """Our span made current in the OpenTelemetry context of the task that started the SDK span."""

    __slots__ = ("_otel_token", "_owner_token")

    def __init__(self, span: otel_trace.Span) -> None:
        self._owner_token = _attach_owner.set(True)
        self._otel_token = otel_context.attach(otel_trace.set_span_in_context(span))

    def release(self) -> None:
        try:
            _attach_owner.reset(self._owner_token)
        except (ValueError, RuntimeError):
            return  # another context (or released already): that context is not ours to change
        otel_context.detach(self._otel_token)


@dataclass
class _Mirror:
    """What one SDK span or trace is on agl's side.

    ``owned`` mirrors were started here and end with the SDK span; pass-through ones reuse the nearest
    mirrored ancestor's span and its list of pending tool calls (shared, so an agent's model answers and
    its function spans meet there whatever SDK spans lie between them).
    """

    span: otel_trace.Span
    owned: bool
    trace_id: str
    pending_calls: List[ToolCall] = field(default_factory=list)
    attachment: Optional[_Attachment] = None
    # The exception the caller was handling when the SDK started it, if any: not one that ends it (see _leaving).
    ambient: Optional[BaseException] = None
    # A function span's: its SDK data (read at its end, or at its trace's end if the SDK ends it later), the
    # span it hangs under, and that agent's pending calls (its call id is taken from them).
    tool: Optional[FunctionSpanData] = None
    anchor: Optional[otel_trace.Span] = None
    calls: Optional[List[ToolCall]] = None


class AglTracingProcessor(TracingProcessor):
    """Registered beside the user's processors; ``enabled = False`` makes it ignore new traces and spans."""

    def __init__(self) -> None:
        self.enabled = True
        self._mirrors: Dict[str, _Mirror] = {}  # SDK trace/span id -> mirror; single dict ops are atomic

    # -- traces -------------------------------------------------------------------------------------------
    @guarded("openai_agents.trace_start")
    def on_trace_start(self, trace: Trace) -> None:
        if not self.enabled:
            return
        span = get_tracer().start_span(
            f"workflow {trace.name}", "chain", {semconv.FRAMEWORK: FRAMEWORK, TRACE_ID: trace.trace_id}
        )
        self._mirrors[trace.trace_id] = _Mirror(span, owned=True, trace_id=trace.trace_id, ambient=sys.exc_info()[1])

    @guarded("openai_agents.trace_end")
    def on_trace_end(self, trace: Trace) -> None:
        """Also ends the trace's spans the SDK left open, so that none is lost from the store or kept here
        forever. They were interrupted: older SDKs never end the agent span of a cancelled streamed run, and
        a cancelled run (``asyncio.wait_for`` around ``Runner.run``, a rollout timeout) ends its trace before
        the function span of the tool it was running (the SDK's later ``on_span_end`` of it is ignored).
        Such a tool is a failed call (``CancelledError``), with the arguments and call id it had by then (the
        SDK sets the arguments as the span starts); any other span, and then the trace's own, is marked
        stopped (see :func:`_stopped`). The trace's own is marked stopped too when a cancellation ends it with
        nothing left open (older SDKs, 0.5, end a cancelled tool's span, and its agent's, before the trace),
        and not when a failure does (0.5 leaves the sibling tools of a failed one running)."""
        own = self._mirrors.pop(trace.trace_id, None)
        left_open = False
        for key, mirror in dict(self._mirrors).items():
            if mirror.trace_id != trace.trace_id or self._mirrors.pop(key, None) is None or not mirror.owned:
                continue
            left_open = True
            if mirror.attachment is not None:
                mirror.attachment.release()
            if mirror.tool is not None:
                _end_tool(mirror.span, mirror.tool, None, mirror.calls, _interrupted())
            else:
                _stopped(mirror.span)
                finish_span(mirror.span)
        if own is not None:
            if _was_stopped(_leaving(own.ambient), left_open):
                _stopped(own.span)
            finish_span(own.span)

    # -- spans --------------------------------------------------------------------------------------------
    @guarded("openai_agents.span_start")
    def on_span_start(self, span: Span[Any]) -> None:
        if not self.enabled:
            return
        parent = self._mirrors.get(span.parent_id or span.trace_id)
        start = _STARTERS.get(type(span.span_data))
        if start is not None:
            anchor = parent.span if parent is not None else None
            ours = start(span.span_data, anchor)
            mirror = _Mirror(ours, True, span.trace_id, attachment=_Attachment(ours), ambient=sys.exc_info()[1])
            if isinstance(span.span_data, FunctionSpanData):
                mirror.tool, mirror.anchor = span.span_data, anchor
                mirror.calls = parent.pending_calls if parent is not None else None
            self._mirrors[span.span_id] = mirror
        elif parent is not None:
            self._mirrors[span.span_id] = _Mirror(parent.span, False, span.trace_id, parent.pending_calls)

    @guarded("openai_agents.span_end")
    def on_span_end(self, span: Span[Any]) -> None:
        mirror = self._mirrors.pop(span.span_id, None)
        if mirror is None:
            return
        if mirror.attachment is not None:
            mirror.attachment.release()
        data = span.span_data
        if not mirror.owned:
            mirror.pending_calls.extend(requested_calls(data))
            if getattr(data, "type", None) in _RUN_SPAN_TYPES:
                _mark_failed(mirror.span, span.error)  # mirror.span is the nearest mirrored ancestor's span
            return
        leaving = _leaving(mirror.ambient)
        if isinstance(data, FunctionSpanData):
            cancelled = isinstance(leaving, asyncio.CancelledError)
            _end_tool(mirror.span, data, span.error, mirror.calls, _interrupted() if cancelled else None)
            return
        if isinstance(data, HandoffSpanData):
            _end_handoff(mirror.span, data)
        elif isinstance(data, GuardrailSpanData):
            mirror.span.set_attribute(GUARDRAIL_TRIGGERED, bool(data.triggered))
        _mark_failed(mirror.span, span.error)
        if isinstance(data, AgentSpanData):
            self._end_run(mirror.span, leaving)
        finish_span(mirror.span)

    def _end_run(self, agent: otel_trace.Span, leaving: Optional[BaseException]) -> None:
        """Records how an agent's run ended where its ``SpanError`` does not say: a failure leaving it is the
        SDK's generic ``Error in agent run`` (kept behind a more specific error already there), a cancellation
        marks it stopped (the SDK ends it with no error)."""
        if isinstance(leaving, Exception):
            _mark_failed(agent, SpanError(message=RUN_ERROR, data={"error": str(leaving)}))
        elif _was_stopped(leaving, self._running_tools(agent)):
            _stopped(agent)

    def _running_tools(self, agent: otel_trace.Span) -> bool:
        """Whether a function span under ``agent`` is still open: newer SDKs end an agent span with its tools
        running only when its run is cancelled (they await every tool otherwise)."""
        return any(m.tool is not None and m.anchor is agent for m in list(self._mirrors.values()))

    # -- lifecycle ----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Nothing to release: agl's tracer is flushed by the runner, not by the SDK's exit hook."""

    def force_flush(self) -> None:
        """Nothing is buffered here: agl's tracer writes spans and ``agl`` flushes it at rollout end."""


def _start_agent(data: AgentSpanData, parent: Optional[otel_trace.Span]) -> otel_trace.Span:
    return start_agent_span(data.name, FRAMEWORK, parent=parent)


def _start_tool(data: FunctionSpanData, parent: Optional[otel_trace.Span]) -> otel_trace.Span:
    return start_tool_span(data.name, FRAMEWORK, parent=parent)


def _start_handoff(data: HandoffSpanData, parent: Optional[otel_trace.Span]) -> otel_trace.Span:
    attributes = {semconv.FRAMEWORK: FRAMEWORK, HANDOFF_FROM: data.from_agent or ""}
    return get_tracer().start_span(f"handoff {data.from_agent}", "chain", attributes, parent=parent)


def _start_guardrail(data: GuardrailSpanData, parent: Optional[otel_trace.Span]) -> otel_trace.Span:
    return get_tracer().start_span(f"guardrail {data.name}", "chain", {semconv.FRAMEWORK: FRAMEWORK}, parent=parent)


_STARTERS: Dict[type, Callable[[Any, Optional[otel_trace.Span]], otel_trace.Span]] = {
    AgentSpanData: _start_agent,
    FunctionSpanData: _start_tool,
    HandoffSpanData: _start_handoff,
    GuardrailSpanData: _start_guardrail,
}


def _end_tool(
    span: otel_trace.Span,
    data: FunctionSpanData,
    error: Optional[SpanError],
    calls: Optional[List[ToolCall]],
    interrupted: Optional[BaseException] = None,
) -> None:
    """The SDK fills in arguments and output after the span starts, so they are read at its end.

    ``interrupted``: the tool was cancelled before it finished (its run was cancelled, or the SDK cancelled
    it beside a sibling whose failure ended the run). The SDK puts no ``SpanError`` on it, yet no result
    reached the model: it fails with that exception, as agl's own ``@agl.tool`` span of a cancelled tool
    does, so AIR does not count it as a tool call that worked (nor as one that failed: it was interrupted)."""
    if data.input is not None:
        get_tracer().set_deferred(span, {semconv.TOOL_CALL_ARGUMENTS: data.input})
    if calls is not None:
        call_id = take_call_id(calls, data.name, data.input)
        if call_id:
            span.set_attribute(semconv.TOOL_CALL_ID, call_id)
    timeout = None if error or interrupted else _timeout_message(data)
    if timeout is not None:
        span.set_attribute(semconv.ERROR_TYPE, TOOL_TIMEOUT)
        span.set_status(StatusCode.ERROR, timeout)
    _mark_failed(span, error)
    if interrupted is not None and not _failed(span):
        finish_tool(span, error=interrupted)
        return
    finish_tool(span, data.output)


def _interrupted() -> asyncio.CancelledError:
    """What a tool span fails with when the tool was cancelled (the SDK gives no exception to record)."""
    return asyncio.CancelledError("cancelled before the tool finished")


def _leaving(ambient: Optional[BaseException]) -> Optional[BaseException]:
    """The exception that ends an SDK span or trace, if any. The SDK ends them in a ``with`` block's
    ``__exit__`` or a ``finally``, where the exception leaving the block is the one being handled; one the
    caller was handling already when the span started (a run started in an ``except`` block) is not."""
    exc = sys.exc_info()[1]
    return None if exc is ambient else exc


def _was_stopped(leaving: Optional[BaseException], left_running: bool) -> bool:
    """Whether a run was stopped by its caller: cancelled, or ended with work still running and no failure
    leaving it."""
    return isinstance(leaving, asyncio.CancelledError) or (left_running and not isinstance(leaving, Exception))


def _stopped(span: otel_trace.Span) -> None:
    """Mark a span the SDK ended (or left open) because its run was cancelled as stopped
    (``agl.span.stopped``): not a failure, so no error status, as LangChain's adapter records a run its
    caller stopped. A span that failed keeps only its error."""
    if not _failed(span):
        span.set_attribute(semconv.SPAN_STOPPED, True)


def _timeout_message(data: FunctionSpanData) -> Optional[str]:
    """The SDK's message if the function span is a tool call that timed out and was answered with it.

    With ``@function_tool(timeout=...)`` and the default ``timeout_behavior="error_as_result"`` the SDK
    tells the model ``Tool 'NAME' timed out after N seconds.`` and puts no ``SpanError`` on the span: its only
    structured signal (``is_sdk_generated_error`` on an internal result object, also set for other handled
    failures) never reaches a processor. So the output is matched against the SDK's exact template, with the
    span's own tool name (the span may name it qualified, ``namespace.NAME``). Not recognised: a custom
    ``timeout_error_function``'s text, and any timeout with ``trace_include_sensitive_data=False`` (the span
    then has no output). ``timeout_behavior="raise_exception"`` needs none of this: the SDK marks the span.
    """
    output = data.output
    match = _TIMEOUT_MESSAGE.fullmatch(output) if isinstance(output, str) else None
    if match is None or not data.name:
        return None
    name = match.group("name")
    return output if data.name == name or data.name.endswith(f".{name}") else None


def _end_handoff(span: otel_trace.Span, data: HandoffSpanData) -> None:
    """The target agent is known only once the handoff ran."""
    if data.to_agent:
        span.set_attribute(HANDOFF_TO, data.to_agent)
        span.update_name(f"handoff {data.from_agent} -> {data.to_agent}")


def _mark_failed(span: otel_trace.Span, error: Optional[SpanError]) -> None:
    """The SDK reports failures as ``SpanError`` dicts, not exceptions: its message is the error class.

    A span marked failed already keeps its first error: that is the cause (a turn's ``Tool not found``), a
    later one its consequence (the SDK's generic ``Error in agent run``)."""
    if not error or _failed(span):
        return
    message = error.get("message") or "error"
    detail = (error.get("data") or {}).get("error")
    span.set_attribute(semconv.ERROR_TYPE, message)
    span.set_status(StatusCode.ERROR, f"{message}: {detail}" if detail else message)


def _failed(span: otel_trace.Span) -> bool:
    """Whether ``span`` has error status already (agl's spans keep it as ``status_code``)."""
    code = getattr(span, "status_code", None)
    if code is None:
        code = getattr(getattr(span, "status", None), "status_code", None)
    return code is StatusCode.ERROR
