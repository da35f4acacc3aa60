"""AIR counts a tool that failed on arguments that did not parse once (``air.args_invalid``), not also as
``air.tool_error``, also when the tool span records no call id: ``@agl.tool`` in plain Python never does,
nor does the Agents SDK with ``trace_include_sensitive_data=False``. Such a span is matched by tool name
against its calling llm call's unparsed tool calls, one to one."""

from __future__ import annotations

import json

import pytest
from lrl_tool_calls import tool_calling
from openai import OpenAI

import agl
from agl.instrumentation.framework import agent_span
from agl.lightningrl.air import AIRConfig, air_rewards
from agl.lightningrl.links import CallLinks
from agl.lightningrl.synthetic import TraceBuilder
from agl.lightningrl.tree import build_tree
from agl.testing import FakeReply

BROKEN = '{"a": 2, "b'


def air_of(spans, calls, config=None):
    return air_rewards(CallLinks(build_tree(spans)), [c.span_id for c in calls], config or AIRConfig())


def test_plain_agl_tool_failing_on_unparsed_arguments_counts_once(fake_openai, sink, instrumented) -> None:
    """The probe's plain-Python agent: the model's argument string goes to an ``@agl.tool`` that fails to
    parse it; the call is penalised once, as args_invalid."""
    client = OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    fake_openai.script(FakeReply(tool_calls=[{"name": "add", "arguments": BROKEN}]), FakeReply(content="no idea"))

    @agl.tool
    def add(arguments: str) -> int:
        args = json.loads(arguments)
        return args["a"] + args["b"]

    with agl.rollout_scope("ro-air", "at-1"):
        with agent_span("calc", "test"):
            messages = [{"role": "user", "content": "add 2 3"}]
            first = client.chat.completions.create(model="m", messages=messages)
            for call in first.choices[0].message.tool_calls:
                with pytest.raises(json.JSONDecodeError):
                    add(call.function.arguments)
            client.chat.completions.create(model="m", messages=messages)
    spans = sink.of("ro-air")
    [tool] = [s for s in spans if s.kind == "tool"]
    assert tool.status == "error" and agl.semconv.TOOL_CALL_ID not in tool.attributes  # what @agl.tool records
    llm = [s for s in spans if s.kind == "llm"]
    assert air_of(spans, llm) == {llm[0].span_id: {"air.args_invalid": -0.1}}


def test_failed_tool_without_call_id_is_matched_by_name_one_to_one() -> None:
    """Two unparsed ``add`` calls excuse two failed ``add`` spans; a third failed ``add`` (the valid call's)
    and a failed ``mul`` (no unparsed ``mul`` call) are tool errors."""
    b = TraceBuilder()
    call = tool_calling(
        b,
        ("c1", "add", BROKEN),
        ("c2", "add", "[1, 2]"),
        ("c3", "add", '{"a": 1, "b": 2}'),
        ("c4", "mul", '{"a": 1, "b": 2}'),
    )
    for _ in range(3):
        b.tool("add", error=True)
    b.tool("mul", error=True)
    out = air_of(b.finish(), [call])
    assert out == {call.span_id: pytest.approx({"air.args_invalid": -0.2, "air.tool_error": -0.2})}


def test_name_match_stays_within_the_calling_llm_call() -> None:
    """A failed tool without id is excused only by its own caller's unparsed calls, not an earlier call's."""
    b = TraceBuilder()
    first = tool_calling(b, ("c1", "add", BROKEN))
    b.tool("add", error=True)  # the unparsed call it ran: excused
    second = tool_calling(b, ("c2", "add", '{"a": 1}'), response=[3])
    b.tool("add", error=True)  # a valid call that failed: a tool error of the second call
    out = air_of(b.finish(), [first, second])
    assert out == {first.span_id: {"air.args_invalid": -0.1}, second.span_id: {"air.tool_error": -0.1}}


def test_call_id_match_uses_up_the_unparsed_call() -> None:
    """A span matched by call id is not matched again by name: a second failed ``add`` without id is an error."""
    b = TraceBuilder()
    call = tool_calling(b, ("c1", "add", BROKEN), ("c2", "add", '{"a": 1}'))
    b.tool("add", call_id="c1", error=True)
    b.tool("add", error=True)
    out = air_of(b.finish(), [call])
    assert out == {call.span_id: pytest.approx({"air.args_invalid": -0.1, "air.tool_error": -0.1})}


def test_successful_tool_without_id_does_not_use_up_an_unparsed_call() -> None:
    b = TraceBuilder()
    call = tool_calling(b, ("c1", "add", '{"a": 1}'), ("c2", "add", BROKEN))
    b.tool("add")  # the valid call, fine
    b.tool("add", error=True)  # the unparsed one
    out = air_of(b.finish(), [call], AIRConfig(tool_ok=0.5))
    assert out == {call.span_id: pytest.approx({"air.tool_ok": 0.5, "air.args_invalid": -0.1})}
