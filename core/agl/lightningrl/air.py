"""Automatic Intermediate Rewarding (AIR): rewards from system signals, added to the call that caused them.

The trace already says whether what a call asked for worked; AIR turns that into per-call rewards, with
weights from :class:`AIRConfig`, recorded in ``Transition.step_rewards`` under these names:

- ``air.tool_ok`` / ``air.tool_error``: per tool span that ended without error / with error status (the
  tool raised), credited to the call that caused the tool (see :mod:`agl.lightningrl.links`); a tool that
  failed on arguments that did not parse is not also a ``tool_error`` (one mistake, one penalty, whether
  the framework runs such a tool, as the OpenAI Agents SDK does, or not, as LangGraph), and a tool span
  right under a tool span of the same name (``@agl.tool`` under ``@function_tool``) is the same call.
  Which failed tool span ran an unparsed call: the one whose ``gen_ai.tool.call.id`` is that call's id;
  a failed tool span with no call id (``@agl.tool`` in plain Python; the Agents SDK with
  ``trace_include_sensitive_data=False``) takes an unparsed call of its own calling llm call with the same
  tool name, one to one in call order (each unparsed call excuses at most one failed tool span, so of two
  failing ``add`` spans and one unparsed ``add`` call, one is still a ``tool_error``). A tool call run
  more than once (several tool spans with one ``gen_ai.tool.call.id`` from one calling call: a retry, e.g.
  LangChain's ``ToolRetryMiddleware``, or LangGraph re-running a tools node when a graph resumes after an
  interrupt) counts once, by its last run: what the model was told. A tool interrupted before it finished
  (cancelled with its run, a rollout timeout, or beside a sibling whose failure ended the run: error type
  ``CancelledError``, or marked ``agl.span.stopped``) counts as neither: it says nothing of the call;
- ``air.args_valid`` / ``air.args_invalid``: per tool call in the call's output message whose arguments
  do / do not parse as a JSON object;
- ``air.format_ok`` / ``air.format_miss``: the call's text content does / does not match
  ``AIRConfig.format`` (``re.search``); a call with no text (only tool calls) is not checked.

A call's AIR reward for one name is ``weight * count`` (two tools that raised: ``2 * tool_error``). Names
with weight 0 are not recorded. The tool -> call rule is in :mod:`agl.lightningrl.links`: the tool call
id in the call's output message, else the previous call of the same agent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterable, List, Mapping, Optional, Pattern, Set, Tuple, Union

from agl import semconv
from agl.checks import is_finite_number
from agl.lightningrl.links import CallLinks, tool_calls_of
from agl.types import Span


@dataclass(frozen=True)
class AIRConfig:
    """Weights of the AIR signals. Defaults penalise failures only, so tool use is not paid for by itself."""

    tool_ok: float = 0.0
    tool_error: float = -0.1
    args_valid: float = 0.0
    args_invalid: float = -0.1
    format: Union[str, Pattern[str], None] = None  # a regex the call's text must contain; None: no check
    format_ok: float = 0.0
    format_miss: float = -0.1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "format":
                if value is not None and not isinstance(value, (str, re.Pattern)):
                    raise TypeError(f"AIRConfig.format must be a regex string or None, got {type(value).__name__}")
                if isinstance(value, str):
                    try:
                        object.__setattr__(self, "format", re.compile(value))
                    except re.error as exc:
                        raise ValueError(
                            f"AIRConfig.format {value!r} is not a valid regular expression: {exc}"
                        ) from None
            elif not is_finite_number(value):
                raise ValueError(f"AIRConfig.{f.name} must be a finite number, got {value!r}")

    @classmethod
    def from_config(cls, value: Union[None, AIRConfig, Mapping[str, Any]]) -> Optional[AIRConfig]:
        """None (AIR off), an AIRConfig, or a dict of its fields (``{}``: AIR on with the defaults)."""
        if value is None or isinstance(value, AIRConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"air must be None, a dict or an AIRConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown AIR setting(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


def air_rewards(links: CallLinks, calls: Iterable[str], config: AIRConfig) -> Dict[str, Dict[str, float]]:
    """``{llm span id: {air name: reward}}`` for the given calls (the selected ones) of one attempt."""
    wanted = set(calls)
    out: Dict[str, Dict[str, float]] = {}

    def add(call: str, name: str, weight: float) -> None:
        if weight:
            named = out.setdefault(call, {})
            named[name] = named.get(name, 0.0) + weight

    checked = _checked_tool_calls(links, wanted)
    # Tool calls whose arguments did not parse: some frameworks still run (and fail) the tool, others do not;
    # that failure is the same mistake, already counted once as air.args_invalid.
    unparsed = _UnparsedCalls(checked)
    callers = _counted_tools(links)
    last_runs = _last_runs(links, callers)
    for span in links.ordered:
        if span.kind == "tool":
            if span.span_id not in callers:
                continue
            caller = callers[span.span_id]
            if caller in wanted and span.span_id in last_runs and not _interrupted(span):
                if span.status == "error" and unparsed.excuse(span, caller):
                    continue
                if span.status == "error":
                    add(caller, "air.tool_error", config.tool_error)
                else:
                    add(caller, "air.tool_ok", config.tool_ok)
        elif span.kind == "llm" and span.span_id in wanted:
            for _, parses in checked[span.span_id]:
                if parses:
                    add(span.span_id, "air.args_valid", config.args_valid)
                else:
                    add(span.span_id, "air.args_invalid", config.args_invalid)
            text = links.message(span).get("content")
            if config.format is not None and isinstance(text, str) and text:
                if re.search(config.format, text):
                    add(span.span_id, "air.format_ok", config.format_ok)
                else:
                    add(span.span_id, "air.format_miss", config.format_miss)
    return out


ToolCalls = Dict[str, List[Tuple[Dict[str, Any], bool]]]
"""``{llm span id: [(tool call, whether its arguments parse)]}``, calls in output order."""


def _checked_tool_calls(links: CallLinks, wanted: Set[str]) -> ToolCalls:
    """The tool calls of each selected call, each with whether its arguments parse (each parsed once)."""
    return {
        span.span_id: [
            (call, _arguments_parse((call.get("function") or {}).get("arguments")))
            for call in tool_calls_of(links.message(span))
        ]
        for span in links.ordered
        if span.kind == "llm" and span.span_id in wanted
    }


class _UnparsedCalls:
    """The selected calls' tool calls whose arguments did not parse, each to excuse one failed tool span."""

    def __init__(self, checked: ToolCalls) -> None:
        self.ids: Set[str] = set()
        self.pending: Dict[str, List[Tuple[Optional[str], Any]]] = {}  # llm span id -> [(call id, tool name)]
        for span_id, calls in checked.items():
            for call, parses in calls:
                if not parses:
                    function = call.get("function") or {}
                    call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else None
                    if call_id is not None:
                        self.ids.add(call_id)
                    self.pending.setdefault(span_id, []).append((call_id, function.get("name")))

    def excuse(self, tool: Span, caller: str) -> bool:
        """Whether the failed tool span ran an unparsed call: by its call id, or, without one, by tool name
        among its caller's unparsed calls not yet matched (the match is used up)."""
        pending = self.pending.get(caller, [])
        call_id = tool.attributes.get(semconv.TOOL_CALL_ID)
        if call_id:
            if call_id not in self.ids:
                return False
            self.pending[caller] = [entry for entry in pending if entry[0] != call_id]  # not matched by name too
            return True
        name = tool.attributes.get(semconv.TOOL_NAME)
        for index, (_, call_name) in enumerate(pending):
            if call_name == name:
                del pending[index]
                return True
        return False


def _interrupted(tool: Span) -> bool:
    """Cut short by its caller, not failed or finished on its own (module docstring)."""
    attributes = tool.attributes
    return bool(attributes.get(semconv.SPAN_STOPPED)) or attributes.get(semconv.ERROR_TYPE) == "CancelledError"


def _counted_tools(links: CallLinks) -> Dict[str, Optional[str]]:
    """``{tool span id: the call that caused it}`` for the tool spans AIR counts: all but inner records."""
    return {
        span.span_id: links.caller_of_tool(span)
        for span in links.ordered
        if span.kind == "tool" and not _inner_record_of_its_parent(links, span)
    }


def _last_runs(links: CallLinks, callers: Dict[str, Optional[str]]) -> Set[str]:
    """The tool spans that count: of the runs of one tool call (one call id from one calling call), the last
    in call order; every tool span without a call id."""
    last: Dict[Any, str] = {}
    for span in links.ordered:
        if span.span_id in callers:
            call_id = span.attributes.get(semconv.TOOL_CALL_ID)
            key = (callers[span.span_id], call_id) if isinstance(call_id, str) and call_id else span.span_id
            last[key] = span.span_id
    return set(last.values())


def _inner_record_of_its_parent(links: CallLinks, tool: Span) -> bool:
    """A tool span right under a tool span of the same name is one call recorded twice (``@agl.tool`` under
    a framework's own tool decorator, e.g. ``@function_tool``): counted once, at the outer one."""
    parent = links.tree.parent(tool.span_id)
    return (
        parent is not None
        and parent.kind == "tool"
        and parent.attributes.get(semconv.TOOL_NAME) == tool.attributes.get(semconv.TOOL_NAME)
    )


def _arguments_parse(arguments: Any) -> bool:
    """Tool call arguments as the model wrote them (a JSON string) decode to a JSON object."""
    if isinstance(arguments, dict):  # already decoded by whoever recorded it
        return True
    if not isinstance(arguments, str):
        return False
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
