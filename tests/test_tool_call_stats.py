"""LLM calls per rollout and tool-call validity (agl.algorithm.tool_calls), the columns TorchGRPO adds per
step and per evaluation for agents that call tools."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from agl import semconv
from agl.algorithm.tool_calls import ToolCallStats
from agl.types import Span


def _span(n: int, kind: Any, attributes: Dict[str, Any], parent: Optional[int] = None, status: Any = "ok") -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=n,
        trace_id="t",
        span_id=f"s{n}",
        parent_id=f"s{parent}" if parent is not None else None,
        name=kind,
        kind=kind,
        start_time=n,
        end_time=n + 1,
        status=status,
        attributes=attributes,
    )


def _llm(n: int, content: Optional[str] = None, calls: int = 0) -> Span:
    message: Dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"c{n}-{i}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            for i in range(calls)
        ]
    return _span(n, "llm", {semconv.OUTPUT_MESSAGES: json.dumps([message])})


def _tool(n: int, parent: Optional[int] = None, status: str = "ok", stopped: bool = False) -> Span:
    attributes: Dict[str, Any] = {semconv.TOOL_NAME: "add", **({semconv.SPAN_STOPPED: True} if stopped else {})}
    return _span(n, "tool", attributes, parent, status)


def test_validity_counts_unparsed_blocks_and_failed_tools_as_tried_but_not_run() -> None:
    one: List[Span] = [
        _llm(0, calls=2),  # two parsed calls: one ran, one raised
        _tool(1),
        _tool(2, status="error"),
        _llm(3, content="The answer is 3."),
    ]
    two: List[Span] = [
        _llm(0, content='<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>'),  # did not parse
        _llm(1, calls=1),
        _tool(2),
        _tool(3, parent=2),  # the same call recorded twice (@agl.tool under @function_tool): counts once
        _llm(4, calls=1),
        _tool(5, stopped=True),  # cut short with its run: says nothing of the call
    ]
    stats = ToolCallStats.of([one, two])
    assert (stats.rollouts, stats.llm_calls, stats.tool_calls, stats.tool_calls_ran) == (2, 5, 5, 2)
    assert stats.columns() == {"llm_calls_per_rollout": 2.5, "tool_call_validity": 0.4}


def test_no_tool_call_tried_gives_no_validity_column() -> None:
    """An agent without tools (the main job) gets its calls per rollout, and no validity of 0% or 100%."""
    stats = ToolCallStats.of([[_llm(0, content="2 + 3"), _llm(1, content="The answer is 5.")]])
    assert stats.validity is None
    assert stats.columns() == {"llm_calls_per_rollout": 2.0}
    assert ToolCallStats().columns() == {}
