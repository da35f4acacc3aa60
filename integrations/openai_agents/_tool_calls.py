"""Which model tool call a function span executes: the SDK's ``FunctionSpanData`` has no call id.

The call id is what links a tool's result to the assistant message that asked for it, so it is worth
recovering: when a model span of an agent ends, the tool calls in its answer are kept as *pending* for
that agent; when a function span of the same agent ends, the first pending call with the same tool name
and arguments (else the same name) is taken. Identical calls are interchangeable, so that order is exact
enough. Model answers are only in the SDK's spans with ``trace_include_sensitive_data`` on (the default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional

from agents.tracing import GenerationSpanData, ResponseSpanData


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for, as the answer spelled it."""

    name: Optional[str]
    arguments: Optional[str]
    call_id: Optional[str]


def requested_calls(span_data: Any) -> List[ToolCall]:
    """The tool calls in a finished model span: a Responses API answer or a Chat Completions one."""
    if isinstance(span_data, ResponseSpanData):
        answers: Iterable[Any] = [span_data.response] if span_data.response is not None else []
    elif isinstance(span_data, GenerationSpanData):
        answers = span_data.output or []
    else:
        return []
    return [call for answer in answers for call in _calls_in(answer)]


def take_call_id(pending: List[ToolCall], name: Optional[str], arguments: Optional[str]) -> Optional[str]:
    """Remove and return the id of the pending call a function span ran, or None if none matches."""
    for exact in (True, False):
        for index, call in enumerate(pending):
            if call.name == name and (call.arguments == arguments or not exact):
                del pending[index]
                return call.call_id
    return None


def _calls_in(answer: Any) -> Iterator[ToolCall]:
    # Responses API objects (and their dumps, which the SDK stores for streamed chat completions).
    for item in _field(answer, "output") or ():
        if _field(item, "type") == "function_call":
            yield ToolCall(_field(item, "name"), _field(item, "arguments"), _field(item, "call_id"))
    # A chat completions assistant message, dumped.
    for call in _field(answer, "tool_calls") or ():
        function = _field(call, "function")
        yield ToolCall(_field(function, "name"), _field(function, "arguments"), _field(call, "id"))


def _field(obj: Any, name: str) -> Any:
    """A field of an SDK object or of its ``model_dump()``: the SDK keeps both shapes in its spans."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)
