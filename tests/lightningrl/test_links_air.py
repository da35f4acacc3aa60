"""Step rewards and Automatic Intermediate Rewards reach the call that caused them: real emitters and
instrumentation against the local fake server, and synthetic traces for each linkage rule."""

from __future__ import annotations

import pytest
from lrl_tool_calls import tool_calling
from openai import OpenAI

import agl
from agl import semconv
from agl.instrumentation.framework import agent_span, start_agent_span
from agl.lightningrl.air import AIRConfig, air_rewards
from agl.lightningrl.links import CallLinks
from agl.lightningrl.synthetic import TraceBuilder
from agl.lightningrl.tree import build_tree
from agl.tracing.context_keys import register_parent_resolver, unregister_parent_resolver
from agl.tracing.tracer import get_tracer


def links_of(spans) -> CallLinks:
    return CallLinks(build_tree(spans))


# --- real emitters: the linkage survives an adapter that parents llm spans to its own agent span ------------


def test_operation_rewards_reach_calls_parented_elsewhere(fake_openai, sink, instrumented) -> None:
    """LangGraph-style: the node's agent span is never current; the model run the framework opens for each
    call is a child of the node (not of the operation around the call), and a resolver reports it, so the
    llm span is under the model run, not below the operation in the tree; the operation id links them."""
    client = OpenAI(base_url=fake_openai.base_url, api_key="x")
    running = []

    def ask(text):
        running.append(get_tracer().start_span("chat_model", "chain", parent=node))  # opened by the framework
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
        finally:
            running.pop().end()

    with agl.rollout_scope("ro-link", "at-1"):
        with agent_span("team", "test"):
            node = start_agent_span("writer", "test")
            resolver = lambda: running[-1] if running else node  # noqa: E731 - a one-line callable handed on
            register_parent_resolver(resolver)
            try:
                with agl.operation("draft"):
                    ask("one")
                    agl.emit_reward(0.5)
                with agl.operation("pair"):
                    ask("two")
                    ask("three")
                    agl.emit_reward({"quality": 1.0})
                agl.emit_reward(0.25)  # outside any operation: the episode's, not a step reward
            finally:
                unregister_parent_resolver(resolver)
                node.end()
    spans = sink.of("ro-link")
    llm = [s for s in spans if s.kind == "llm"]
    operations = [s for s in spans if s.name == semconv.SPAN_OPERATION]
    model_runs = {s.span_id: s for s in spans if s.name == "chat_model"}
    assert all(model_runs[s.parent_id].parent_id == format(node.get_span_context().span_id, "016x") for s in llm)
    assert all(o.parent_id == format(node.get_span_context().span_id, "016x") for o in operations)  # in the node
    assert [s.attributes[semconv.OPERATION_SPAN_ID] for s in llm] == [
        operations[0].span_id,
        operations[1].span_id,
        operations[1].span_id,
    ]
    rewards = [s for s in spans if s.kind == "reward"]
    assert [r.attributes[semconv.REWARD_SCOPE] for r in rewards] == ["step", "step", "episode"]

    step = links_of(spans).step_rewards()
    assert step.by_call == {
        llm[0].span_id: {"primary": 0.5},
        llm[1].span_id: {"quality": 0.5},  # one reward over the operation's two calls: r / 2 each
        llm[2].span_id: {"quality": 0.5},
    }
    assert step.unattributed == 0


def test_reward_emitted_inside_a_tool_is_a_step_reward_for_the_call_that_caused_it(fake_openai, sink, instrumented):
    client = OpenAI(base_url=fake_openai.base_url, api_key="x")

    @agl.tool
    def lookup(q: str) -> str:
        agl.emit_reward(-1.0)
        return q

    with agl.rollout_scope("ro-tool", "at-1"):
        with agent_span("team", "test"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            lookup("x")
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
    spans = sink.of("ro-tool")
    [reward] = [s for s in spans if s.kind == "reward"]
    assert reward.attributes[semconv.REWARD_SCOPE] == "step"
    first_call = next(s for s in spans if s.kind == "llm")
    assert links_of(spans).step_rewards().by_call == {first_call.span_id: {"primary": -1.0}}


# --- synthetic traces: each rule ---------------------------------------------------------------------------


def test_tool_linked_by_call_id_across_agents_else_by_the_agents_previous_call() -> None:
    b = TraceBuilder()
    with b.agent("checker"):
        asking = b.llm([1], [2], tool_calls=[{"id": "c1", "name": "count", "arguments": "{}"}])
    with b.agent("tools"):  # LangGraph's ToolNode runs the tool in another node
        by_id = b.tool("count", call_id="c1")
        unknown_id = b.tool("count", call_id="nope")  # no call asked for it, no call in this agent
    with b.agent("writer"):
        writer_call = b.llm([1], [3])
        plain = b.tool("save")  # @agl.tool: no call id
    links = links_of(b.finish())
    assert links.caller_of_tool(by_id) == asking.span_id
    assert links.caller_of_tool(unknown_id) is None
    assert links.caller_of_tool(plain) == writer_call.span_id


def test_reward_under_an_llm_span_goes_to_that_call() -> None:
    b = TraceBuilder()
    b.llm([1], [2])
    with b.chain("chat m") as streaming:  # made an llm span below: a call still open, as while streaming
        b.reward(0.3)
    spans = [s.model_copy(update={"kind": "llm"}) if s.span_id == streaming else s for s in b.finish()]
    assert links_of(spans).step_rewards().by_call == {streaming: {"primary": 0.3}}


def test_nested_operations_and_lost_operation_spans() -> None:
    b = TraceBuilder()
    with b.operation("outer") as outer:
        with b.operation("inner") as inner:
            a = b.llm([1], [2], operation=inner)
        c = b.llm([1], [3], operation=outer)
        b.reward(1.0, operation=outer)  # the outer operation covers the inner one's call too
    with b.operation("lost") as lost:
        d = b.llm([1], [4], operation=lost)
    b.reward(0.8, operation=lost)  # emitted after the operation span is gone from the store
    b.reward(0.1)  # step scope, but linked to nothing
    b.reward(9.0, scope="episode")
    spans = [s for s in b.finish() if s.span_id != lost]
    for s in spans:
        if s.kind == "reward" and s.attributes.get(semconv.OPERATION_SPAN_ID) == lost:
            s.parent_id = None  # its parent span was lost with the operation
    step = links_of(spans).step_rewards()
    # the lost operation's id is not in the tree: its reward cannot be linked
    assert step.by_call == {a.span_id: {"primary": 0.5}, c.span_id: {"primary": 0.5}}
    assert step.unattributed == 2
    assert d.span_id not in step.by_call


def test_reward_linked_by_operation_id_when_its_parent_is_not_the_operation() -> None:
    b = TraceBuilder()
    with b.operation("op") as op:
        call = b.llm([1], [2], operation=op)
    b.reward(0.7, operation=op)  # parent: the root agent (e.g. a framework span that was current)
    assert links_of(b.finish()).step_rewards().by_call == {call.span_id: {"primary": 0.7}}


# --- AIR ----------------------------------------------------------------------------------------------------


def air_trace():
    b = TraceBuilder()
    calls = {}
    calls["tools"] = tool_calling(
        b, ("ok", "t", '{"a": 1}'), ("bad", "t", '{"a": '), ("list", "t", "[1]"), ("boom", "t", '{"a": 0}')
    )
    b.tool("t", call_id="ok")
    b.tool("t", call_id="bad", error=True)  # run on arguments that did not parse (the Agents SDK does): counted
    b.tool("t", call_id="list", error=True)  # once, as args_invalid, not also as tool_error
    b.tool("t", call_id="boom", error=True)
    calls["answer"] = b.llm([1], [3], content="ANSWER: 42")
    calls["chat"] = b.llm([1], [4], content="I think it is 42")
    return b.finish(), calls


def test_air_signals_and_weights() -> None:
    spans, calls = air_trace()
    config = AIRConfig(
        tool_ok=0.2,
        tool_error=-0.5,
        args_valid=0.1,
        args_invalid=-0.3,
        format=r"^ANSWER: \d+$",
        format_ok=1.0,
        format_miss=-1.0,
    )
    out = air_rewards(links_of(spans), [c.span_id for c in calls.values()], config)
    assert out[calls["tools"].span_id] == pytest.approx(
        {"air.tool_ok": 0.2, "air.tool_error": -0.5, "air.args_valid": 0.2, "air.args_invalid": -0.6}
    )  # no text content: no format check
    assert out[calls["answer"].span_id] == {"air.format_ok": 1.0}
    assert out[calls["chat"].span_id] == {"air.format_miss": -1.0}


def test_air_defaults_only_penalise_and_only_selected_calls_get_rewards() -> None:
    spans, calls = air_trace()
    out = air_rewards(links_of(spans), [calls["tools"].span_id], AIRConfig())
    assert out == {calls["tools"].span_id: pytest.approx({"air.tool_error": -0.1, "air.args_invalid": -0.2})}


def test_air_config_validation() -> None:
    assert AIRConfig.from_config(None) is None
    assert AIRConfig.from_config({}) == AIRConfig()
    assert AIRConfig.from_config({"format": "x"}).format.pattern == "x"
    with pytest.raises(ValueError, match="unknown AIR setting"):
        AIRConfig.from_config({"tool_okay": 1.0})
    with pytest.raises(ValueError, match="finite number"):
        AIRConfig(tool_ok=float("nan"))
    with pytest.raises(ValueError, match="finite number"):
        AIRConfig(tool_error=-(10**400))  # an int too large for a float: was OverflowError
    with pytest.raises(ValueError, match="not a valid regular expression"):
        AIRConfig(format="(")
    with pytest.raises(TypeError):
        AIRConfig.from_config(["tool_ok"])  # type: ignore[arg-type]


def test_a_tool_call_run_more_than_once_counts_once_by_its_last_run() -> None:
    """A retried tool (error, then success: the model saw the success) and a tools node replayed on resume
    (the same call's tool run twice) each count once, as their last run; the same call id from another
    calling call (a server that numbers calls per answer) is another call."""
    b = TraceBuilder()
    first = tool_calling(b, ("call_0", "fetch", "{}"), ("call_1", "add", '{"a": 1}'))
    b.tool("fetch", call_id="call_0", error=True)  # a transient failure, retried
    b.tool("fetch", call_id="call_0")
    b.tool("add", call_id="call_1", error=True)
    b.tool("add", call_id="call_1", error=True)  # replayed after an interrupt: the same failure, once
    second = tool_calling(b, ("call_0", "fetch", "{}"), response=[3])
    b.tool("fetch", call_id="call_0", error=True)
    out = air_rewards(links_of(b.finish()), [first.span_id, second.span_id], AIRConfig(tool_ok=0.5))
    assert out == {
        first.span_id: pytest.approx({"air.tool_ok": 0.5, "air.tool_error": -0.1}),
        second.span_id: {"air.tool_error": -0.1},
    }


def test_a_tool_interrupted_by_its_caller_says_nothing_of_the_call() -> None:
    """A tool cancelled with its run (CancelledError), or stopped by its caller (agl.span.stopped), was not
    judged by its result: it was a tool_error (OpenAI Agents SDK, @agl.tool) or a tool_ok (LangChain)."""
    b = TraceBuilder()
    call = tool_calling(b, ("c1", "slow", "{}"), ("c2", "slow", "{}"), ("c3", "fast", "{}"))
    b.tool("slow", call_id="c1", error=True, error_type="CancelledError")
    b.tool("slow", call_id="c2", stopped=True)
    b.tool("fast", call_id="c3", error=True)
    out = air_rewards(links_of(b.finish()), [call.span_id], AIRConfig(tool_ok=0.5))
    assert out == {call.span_id: {"air.tool_error": -0.1}}
