"""The kit every framework adapter is built from, so no two integrations carry copies of the same code.

- :class:`PatchSet`: wrapt patches that are applied once and restored exactly (the original function
  object goes back on the class), for frameworks whose extension points are not enough.
- :func:`agent_span` / :func:`tool_span` (current, context managers) and :func:`start_agent_span` /
  :func:`start_tool_span` (not current, explicit parent; for callback-style frameworks) make spans with
  the attributes LightningRL reads: ``gen_ai.agent.name`` on agent spans, tool name / call id /
  arguments / result / error on tool spans, ``agl.framework`` on both.
- :func:`finish_tool` records a tool's result or exception on its span and ends it.

Adapters never make ``llm`` spans: the OpenAI-client layer makes exactly one per request, nested in the
agent span that is current (or resolved, see :mod:`agl.tracing.context_keys`).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import wrapt
from opentelemetry import trace as otel_trace

from agl import semconv
from agl.tracing.encoding import tool_value
from agl.tracing.tracer import encode_attribute, get_tracer, record_exception


class PatchSet:
    """wrapt patches on ``module.Class.attr`` that can all be undone, restoring the exact originals."""

    def __init__(self) -> None:
        self._applied: List[Tuple[Any, str, Any]] = []

    def wrap(self, module: str, name: str, wrapper: Callable[..., Any]) -> bool:
        """Wrap ``module.name`` (``name`` may be ``Class.method``). False if it does not exist (old version)."""
        try:
            owner: Any = importlib.import_module(module)
            *path, attr = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        except (ImportError, AttributeError, KeyError):
            return False
        wrapt.wrap_function_wrapper(owner, attr, wrapper)
        self._applied.append((owner, attr, original))
        return True

    def restore(self) -> None:
        for owner, attr, original in reversed(self._applied):
            setattr(owner, attr, original)
        self._applied.clear()

    def __len__(self) -> int:
        return len(self._applied)


def _agent_attributes(name: str, framework: str, extra: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    attrs: Dict[str, Any] = {
        semconv.AGENT_NAME: name,
        semconv.OPERATION_NAME: "invoke_agent",
        semconv.FRAMEWORK: framework,
    }
    if extra:
        attrs.update(extra)
    return attrs


def _tool_attributes(
    name: str, framework: str, call_id: Optional[str], extra: Optional[Mapping[str, Any]]
) -> Dict[str, Any]:
    attrs: Dict[str, Any] = {
        semconv.TOOL_NAME: name,
        semconv.OPERATION_NAME: "execute_tool",
        semconv.FRAMEWORK: framework,
    }
    if call_id:
        attrs[semconv.TOOL_CALL_ID] = call_id
    if extra:
        attrs.update(extra)
    return attrs


def _chain_attributes(framework: str, extra: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    attrs: Dict[str, Any] = {semconv.FRAMEWORK: framework}
    if extra:
        attrs.update(extra)
    return attrs


@contextlib.contextmanager
def agent_span(name: str, framework: str, attributes: Optional[Mapping[str, Any]] = None) -> Iterator[otel_trace.Span]:
    """The current span while an agent (node, role) works; LLM calls inside belong to it."""
    with get_tracer().span(f"invoke_agent {name}", "agent", _agent_attributes(name, framework, attributes)) as span:
        yield span


def start_agent_span(
    name: str,
    framework: str,
    *,
    parent: Optional[otel_trace.Span] = None,
    attributes: Optional[Mapping[str, Any]] = None,
    start_time: Optional[int] = None,
) -> otel_trace.Span:
    """An agent span that is not made current (end it yourself); ``parent`` links it explicitly."""
    return get_tracer().start_span(
        f"invoke_agent {name}",
        "agent",
        _agent_attributes(name, framework, attributes),
        parent=parent,
        start_time=start_time,
    )


@contextlib.contextmanager
def tool_span(
    name: str,
    framework: str,
    arguments: Any = None,
    *,
    call_id: Optional[str] = None,
    attributes: Optional[Mapping[str, Any]] = None,
) -> Iterator[otel_trace.Span]:
    """The current span while a tool runs. An exception marks it as an error and propagates;
    record the result with ``set_tool_result``."""
    tracer = get_tracer()
    with tracer.span(f"execute_tool {name}", "tool", _tool_attributes(name, framework, call_id, attributes)) as span:
        if arguments is not None:
            tracer.set_deferred(span, {semconv.TOOL_CALL_ARGUMENTS: arguments})
        yield span


def start_tool_span(
    name: str,
    framework: str,
    arguments: Any = None,
    *,
    call_id: Optional[str] = None,
    parent: Optional[otel_trace.Span] = None,
    attributes: Optional[Mapping[str, Any]] = None,
    start_time: Optional[int] = None,
) -> otel_trace.Span:
    """A tool span that is not made current; finish it with :func:`finish_tool`."""
    tracer = get_tracer()
    span = tracer.start_span(
        f"execute_tool {name}",
        "tool",
        _tool_attributes(name, framework, call_id, attributes),
        parent=parent,
        start_time=start_time,
    )
    if arguments is not None:
        # A container is encoded now, not when the span ends: a tool that changes a nested argument in place
        # would otherwise change what is stored as the call's arguments (tools are few, the cost is small).
        arguments = tool_value(arguments)
        if isinstance(arguments, (dict, list, tuple)):
            arguments = encode_attribute(arguments)
        tracer.set_deferred(span, {semconv.TOOL_CALL_ARGUMENTS: arguments})
    return span


@contextlib.contextmanager
def chain_span(name: str, framework: str, attributes: Optional[Mapping[str, Any]] = None) -> Iterator[otel_trace.Span]:
    """The current span while a step that groups others runs (a team run, a task, a crew kickoff)."""
    with get_tracer().span(name, "chain", _chain_attributes(framework, attributes)) as span:
        yield span


def start_chain_span(
    name: str,
    framework: str,
    *,
    parent: Optional[otel_trace.Span] = None,
    attributes: Optional[Mapping[str, Any]] = None,
    start_time: Optional[int] = None,
) -> otel_trace.Span:
    """A ``chain`` span (a step that groups others) that is not made current."""
    return get_tracer().start_span(
        name, "chain", _chain_attributes(framework, attributes), parent=parent, start_time=start_time
    )


def mark_as_agent(span: otel_trace.Span, name: str, framework: str) -> None:
    """Turn a started span into an agent span, for agents a framework reveals only after they started."""
    span.update_name(f"invoke_agent {name}")
    span.set_attributes({semconv.SPAN_KIND: "agent", **_agent_attributes(name, framework, None)})


def set_tool_result(span: otel_trace.Span, result: Any) -> None:
    get_tracer().set_deferred(span, {semconv.TOOL_CALL_RESULT: tool_value(result)})


def finish_tool(
    span: otel_trace.Span, result: Any = None, error: Optional[BaseException] = None, *, end_time: Optional[int] = None
) -> None:
    """Record the tool's result (or the exception it raised: error status) and end its span."""
    if error is not None:
        record_exception(span, error)
    elif result is not None:
        set_tool_result(span, result)
    span.end(end_time=end_time)


def finish_span(
    span: otel_trace.Span, error: Optional[BaseException] = None, *, end_time: Optional[int] = None
) -> None:
    """End an agent/chain span started with ``start_*``, marking it failed if ``error`` is given."""
    if error is not None:
        record_exception(span, error)
    span.end(end_time=end_time)
