"""The OpenAI Agents SDK adapter, end to end: the real SDK and ``openai`` client against agl's fake OpenAI
server, spans read back from real rollouts (``Trainer.dev`` into SQLite, or a rollout scope and a list sink).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.metadata
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Tuple

import pytest

agents = pytest.importorskip("agents")

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_trace_processors,
    set_tracing_disabled,
)
from agents.tracing import AgentSpanData, TracingProcessor, get_trace_provider
from openai import AsyncOpenAI
from opentelemetry import trace as otel_trace

import agl
from agl import semconv
from agl._util.safety import internal_error_count
from agl.integrations.openai_agents import OpenAIAgentsInstrumentor
from agl.integrations.openai_agents._processor import AglTracingProcessor
from agl.lightningrl.agent_match import agent_name_of, select_llm_calls
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply, assert_tool_reward_credited
from agl.tracing.context import rollout_scope
from agl.types import Span

pytestmark = pytest.mark.framework("openai_agents")

QUESTION = "What is 2 plus 3?"
# Some tests need SDK features newer than the oldest line (requirements-oldest.txt) has.
SDK_VERSION = tuple(int(part) for part in importlib.metadata.version("openai-agents").split(".")[:2])


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@function_tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


@function_tool(failure_error_function=None)
def divide_strict(a: float, b: float) -> float:
    """Divide a by b; errors reach the caller."""
    return a / b


class UserProcessor(TracingProcessor):
    """The user's own processor (an exporter, say): agl must leave it registered and working."""

    def __init__(self) -> None:
        self.agents_seen: List[str] = []

    def on_trace_start(self, trace: Any) -> None:
        pass

    def on_trace_end(self, trace: Any) -> None:
        pass

    def on_span_start(self, span: Any) -> None:
        pass

    def on_span_end(self, span: Any) -> None:
        if isinstance(span.span_data, AgentSpanData):
            self.agents_seen.append(span.span_data.name)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


def _processors() -> Tuple[Any, ...]:
    """The SDK's registered processors (the default provider keeps them in a tuple)."""
    return get_trace_provider()._multi_processor._processors


def _open_mirrors() -> int:
    """SDK spans agl still tracks: every one must be gone once runs end (no leak per run)."""
    return sum(len(p._mirrors) for p in _processors() if isinstance(p, AglTracingProcessor))


@pytest.fixture(autouse=True)
def sdk(fake_openai: FakeOpenAIServer) -> Iterator[UserProcessor]:
    """The SDK configured as a user would: tracing on (nox sets OPENAI_AGENTS_DISABLE_TRACING), the SDK's
    exporter to api.openai.com replaced by the user's own processor (no traffic leaves the machine), the
    default client on the fake server."""
    before = _processors()
    user = UserProcessor()
    set_trace_processors([user])
    set_tracing_disabled(False)
    set_default_openai_api("responses")
    client = AsyncOpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    yield user
    set_trace_processors(list(before))


@pytest.fixture
def instrumented() -> Iterator[None]:
    agl.uninstrument()
    assert agl.instrument(frameworks=["openai_agents"]) == ["openai", "thread_pools", "openai_agents"]
    yield
    agl.uninstrument()


def _rollout_id() -> str:
    return f"ro-{uuid.uuid4().hex[:8]}"


def _calculator(**kwargs: Any) -> Agent:
    return Agent(name="calculator", instructions="Use the tools.", tools=[add], **kwargs)


def _own_model(base_url: str, api: str = "responses") -> Any:
    """A model with its own client: runs on different event loops (threads) must not share a connection pool."""
    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    if api == "responses":
        return OpenAIResponsesModel(model="fake-model", openai_client=client)
    return OpenAIChatCompletionsModel(model="fake-model", openai_client=client)


async def _drain(agent: Agent, question: str) -> Any:
    result = Runner.run_streamed(agent, question)
    async for _ in result.stream_events():
        pass
    return result


def _run(agent: Agent, question: str, mode: str) -> Any:
    if mode == "run_sync":
        return Runner.run_sync(agent, question).final_output
    if mode == "run_streamed":
        return asyncio.run(_drain(agent, question)).final_output
    return asyncio.run(Runner.run(agent, question)).final_output


def _of_kind(spans: List[Span], kind: str) -> List[Span]:
    return [s for s in spans if s.kind == kind]


def _instructions(span: Span) -> str:
    """Which agent asked, read from the request itself (Responses API: instructions; chat: system message)."""
    sent = json.loads(span.attributes[semconv.INPUT_MESSAGES])
    return sent["instructions"] if isinstance(sent, dict) else sent[0]["content"]


def _air(spans: List[Span]) -> Dict[str, Dict[str, float]]:
    """LightningRL's AIR step rewards (default weights) of a rollout's llm calls, by span id."""
    from agl.lightningrl.air import AIRConfig, air_rewards
    from agl.lightningrl.links import CallLinks
    from agl.lightningrl.tree import build_tree

    return air_rewards(CallLinks(build_tree(spans)), [s.span_id for s in _of_kind(spans, "llm")], AIRConfig())


# -- every entry point, both APIs, plain and streamed --------------------------------------------------------
@pytest.mark.parametrize("mode", ["run", "run_sync", "run_streamed"])
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_a_run_becomes_agent_llm_and_tool_spans(api: str, mode: str, fake_openai, instrumented, sink) -> None:
    set_default_openai_api(api)
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        output = _run(_calculator(), QUESTION, mode)

    assert output == "The answer is 5.0."
    path = "/v1/responses" if api == "responses" else "/v1/chat/completions"
    assert [r["path"] for r in fake_openai.requests] == [path, path]
    spans = sink.of(rollout_id)
    by_id = {s.span_id: s for s in spans}
    (workflow,) = [s for s in spans if s.parent_id is None]
    assert workflow.kind == "chain" and workflow.name == "workflow Agent workflow"
    (agent,) = _of_kind(spans, "agent")
    assert agent.name == "invoke_agent calculator" and agent.attributes[semconv.AGENT_NAME] == "calculator"
    assert agent.parent_id == workflow.span_id
    assert semconv.SPAN_STOPPED not in agent.attributes and semconv.SPAN_STOPPED not in workflow.attributes
    llm = _of_kind(spans, "llm")
    assert len(llm) == len(fake_openai.requests)  # exactly one llm span per HTTP request
    for span in llm:
        assert span.parent_id == agent.span_id
        assert span.attributes[semconv.LLM_STREAM] is (mode == "run_streamed")
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]
    (tool,) = _of_kind(spans, "tool")
    assert agent_name_of(tool, by_id) == "calculator" and tool.status != "error"
    assert tool.attributes[semconv.TOOL_NAME] == "add"
    assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == 5.0
    call_id = tool.attributes[semconv.TOOL_CALL_ID]
    assert call_id in json.dumps(fake_openai.requests[1]["body"])  # the id the model's call carried
    assert llm[0].sequence_id < tool.sequence_id < llm[1].sequence_id
    assert _open_mirrors() == 0


def test_streamed_responses_calls_carry_token_ids(fake_openai, instrumented, sink) -> None:
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        _run(_calculator(), QUESTION, "run_streamed")
    llm = _of_kind(sink.of(rollout_id), "llm")
    assert len(llm) == 2
    assert all(s.attributes.get(semconv.RESPONSE_TOKEN_IDS) for s in llm)


# -- THE KEY ONE: two agents, one tool; agent_match picks one agent's calls ----------------------------------
def test_agent_match_selects_exactly_the_chosen_agents_calls(tmp_path, fake_openai, instrumented) -> None:
    @agl.rollout
    async def helpdesk(task: Dict[str, Any], llm: agl.LLM) -> float:
        model = _own_model(llm.get_base_url())
        math_agent = Agent(name="math_agent", instructions="Add with the tool.", tools=[add], model=model)
        triage = Agent(name="triage_agent", instructions="Route to math_agent.", handoffs=[math_agent], model=model)
        result = await Runner.run(triage, task["question"])
        return 1.0 if str(task["answer"]) in result.final_output else 0.0

    tasks = [{"question": "What is 2 plus 3?", "answer": 5}, {"question": "What is 4 plus 5?", "answer": 9}]
    for task in tasks:
        a, b = (int(n) for n in task["question"][8:-1].split(" plus "))
        fake_openai.script(
            FakeReply(tool_calls=[{"name": "transfer_to_math_agent", "arguments": {}}]),
            FakeReply(tool_calls=[{"name": "add", "arguments": {"a": a, "b": b}}]),
            FakeReply(content=f"It is {task['answer']}."),
        )
    db = tmp_path / "x.db"
    trainer = agl.Trainer(
        store=str(db),
        runner_mode="thread",
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake-model")},
        progress=False,
    )
    rows = trainer.dev(helpdesk, tasks, print_table=False)

    assert [r.status for r in rows] == ["succeeded", "succeeded"] and [r.reward for r in rows] == [1.0, 1.0]
    store = SqliteLightningStore(db)
    llm_total = 0
    for row, task in zip(rows, tasks):
        spans = store.query_spans(row.rollout_id)
        llm = _of_kind(spans, "llm")
        llm_total += len(llm)
        math_calls = select_llm_calls(spans, "^math_agent$")
        triage_calls = select_llm_calls(spans, "^triage")
        assert [_instructions(s) for s in math_calls] == ["Add with the tool.", "Add with the tool."]
        assert [_instructions(s) for s in triage_calls] == ["Route to math_agent."]
        assert select_llm_calls(spans, "^helpdesk$") == []  # none falls through to the rollout's root
        assert all(s.attributes[semconv.RESPONSE_TOKEN_IDS] for s in llm)
        by_id = {s.span_id: s for s in spans}
        assert [s.attributes[semconv.AGENT_NAME] for s in _of_kind(spans, "agent")] == [
            "helpdesk",
            "triage_agent",
            "math_agent",
        ]
        (handoff,) = [s for s in spans if s.name.startswith("handoff")]
        assert handoff.name == "handoff triage_agent -> math_agent"
        assert agent_name_of(handoff, by_id) == "triage_agent"
        (tool,) = _of_kind(spans, "tool")
        assert agent_name_of(tool, by_id) == "math_agent"
        assert tool.attributes[semconv.TOOL_CALL_RESULT] == task["answer"]
    assert llm_total == len(fake_openai.requests) == 6
    store.close()


def test_the_adapter_hooked_on_its_own_still_gets_its_llm_calls_recorded_by_the_trainer(tmp_path, fake_openai) -> None:
    """OpenInference-style, the user hooks only the adapter class the docs name. It records agent and tool
    spans; the LLM calls come from the OpenAI-client layer, which nothing hooked, and the Trainer, seeing
    something instrumented, did not step in: 0 llm calls, nothing to train on, without a word."""
    from agl.instrumentation.base import is_hooked

    agl.uninstrument()
    adapter = OpenAIAgentsInstrumentor()
    assert adapter.instrument()

    @agl.rollout
    async def calculator(task: Dict[str, Any], llm: agl.LLM) -> float:
        result = await Runner.run(_calculator(model=_own_model(llm.get_base_url())), task["question"])
        return 1.0 if "5" in result.final_output else 0.0

    fake_openai.script(FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5"))
    db = tmp_path / "x.db"
    trainer = agl.Trainer(
        store=str(db),
        runner_mode="thread",
        progress=False,
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake-model")},
    )
    try:
        (row,) = trainer.dev(calculator, [{"question": "What is 2 plus 3?"}], print_table=False)
        assert row.llm_calls == 2 and row.reward == 1.0
        with SqliteLightningStore(db) as store:
            spans = store.query_spans(row.rollout_id)
        assert [_instructions(s) for s in select_llm_calls(spans, "^calculator$")] == ["Use the tools."] * 2
        assert all(s.attributes[semconv.RESPONSE_TOKEN_IDS] for s in _of_kind(spans, "llm"))
        assert not is_hooked("openai") and adapter.is_instrumented, "the run unhooked only what it hooked"
    finally:
        adapter.uninstrument()


def test_an_agent_used_as_a_tool_nests_under_the_tool_span(fake_openai, instrumented, sink) -> None:
    math_agent = Agent(name="math_agent", instructions="Add with the tool.", tools=[add])
    orchestrator = Agent(
        name="orchestrator",
        instructions="Ask the math agent.",
        tools=[math_agent.as_tool(tool_name="ask_math", tool_description="Ask the math agent.")],
    )
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        Runner.run_sync(orchestrator, QUESTION)

    spans = sink.of(rollout_id)
    by_id = {s.span_id: s for s in spans}
    assert len(_of_kind(spans, "llm")) == len(fake_openai.requests) == 4
    assert [_instructions(s) for s in select_llm_calls(spans, "^math_agent$")] == ["Add with the tool."] * 2
    assert [_instructions(s) for s in select_llm_calls(spans, "^orchestrator$")] == ["Ask the math agent."] * 2
    (nested,) = [s for s in _of_kind(spans, "agent") if s.attributes[semconv.AGENT_NAME] == "math_agent"]
    assert by_id[nested.parent_id].attributes[semconv.TOOL_NAME] == "ask_math"


def test_a_guardrail_agent_is_its_own_agent_inside_the_guardrail_span(fake_openai, instrumented, sink) -> None:
    checker = Agent(name="checker", instructions="Is this arithmetic?")

    @agents.input_guardrail
    async def arithmetic_only(ctx: Any, agent: Agent, text: Any) -> agents.GuardrailFunctionOutput:
        verdict = await Runner.run(checker, text, context=ctx.context)
        return agents.GuardrailFunctionOutput(output_info=verdict.final_output, tripwire_triggered=False)

    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        Runner.run_sync(_calculator(input_guardrails=[arithmetic_only]), QUESTION)

    spans = sink.of(rollout_id)
    by_id = {s.span_id: s for s in spans}
    (guardrail,) = [s for s in spans if s.name == "guardrail arithmetic_only"]
    assert guardrail.attributes["openai_agents.guardrail.triggered"] is False
    (checker_call,) = select_llm_calls(spans, "^checker$")
    assert _instructions(checker_call) == "Is this arithmetic?"
    assert by_id[by_id[checker_call.parent_id].parent_id].span_id == guardrail.span_id
    assert len(select_llm_calls(spans, "^calculator$")) == 2
    assert len(_of_kind(spans, "llm")) == len(fake_openai.requests) == 3


# -- tools that fail -------------------------------------------------------------------------------------------
@function_tool
def graded_add(a: float, b: float) -> float:
    """Add two numbers (and grade the call)."""
    agl.emit_reward(0.5)
    return a + b


@pytest.mark.parametrize("mode", ["run", "run_streamed"])
def test_a_reward_emitted_in_a_tool_is_a_step_reward_for_the_call_that_asked_for_it(
    mode: str, fake_openai, instrumented, sink
) -> None:
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "graded_add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5")
    )
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        assert _run(Agent(name="calculator", tools=[graded_add]), QUESTION, mode) == "5"
    assert_tool_reward_credited(sink.of(rollout_id), 0.5)


def test_a_tool_that_raises_is_an_error_span_and_the_run_goes_on(fake_openai, instrumented, sink) -> None:
    rollout_id = _rollout_id()
    agent = Agent(name="divider", instructions="Divide.", tools=[divide])
    with rollout_scope(rollout_id, "at-1"):
        output = Runner.run_sync(agent, "What is 4 divided by 0?").final_output

    spans = sink.of(rollout_id)
    (tool,) = _of_kind(spans, "tool")
    assert tool.status == "error" and "Error running tool" in tool.error
    assert tool.attributes[semconv.ERROR_TYPE]
    assert tool.attributes[semconv.TOOL_CALL_RESULT] in output  # what the model was told
    (agent,) = _of_kind(spans, "agent")
    assert agent.status != "error"  # the SDK handled the failure: the agent went on


def test_a_tool_call_with_broken_arguments_costs_one_air_penalty(fake_openai, instrumented, sink) -> None:
    """The SDK runs (and fails) a tool whose arguments do not parse; LangGraph does not run it. AIR counted
    the SDK's failed tool as a second penalty for the same mistake (args_invalid and tool_error)."""
    fake_openai.script(
        FakeReply(tool_calls=[{"id": "c1", "name": "add", "arguments": '{"a": 1, "b":'}]),
        FakeReply(tool_calls=[{"id": "c2", "name": "divide", "arguments": {"a": 4, "b": 0}}]),
        FakeReply(content="I could not."),
    )
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        Runner.run_sync(Agent(name="calculator", tools=[add, divide]), QUESTION)

    spans = sink.of(rollout_id)
    assert [t.status for t in _of_kind(spans, "tool")] == ["error", "error"]  # the SDK ran both, both failed
    first, second, _ = sorted(_of_kind(spans, "llm"), key=lambda s: s.sequence_id)
    out = _air(spans)
    assert out[first.span_id] == pytest.approx({"air.args_invalid": -0.1})
    assert out[second.span_id] == pytest.approx({"air.tool_error": -0.1})  # a tool that raised on good arguments


@pytest.mark.skipif(SDK_VERSION < (0, 9), reason="function_tool(timeout=...) is new in openai-agents 0.9")
def test_a_tool_that_timed_out_is_an_error_span_and_an_air_tool_error(fake_openai, instrumented, sink) -> None:
    """``@function_tool(timeout=...)`` answers a timeout with a message to the model (the default
    ``timeout_behavior="error_as_result"``) and puts no error on its span: the call was recorded as a tool
    that worked, and AIR saw no failure."""
    from agents.tool import default_tool_timeout_error_message

    @function_tool(timeout=0.05)
    async def slow(a: float) -> float:
        """Think for a long time."""
        await asyncio.sleep(2)
        return a

    fake_openai.script(FakeReply(tool_calls=[{"name": "slow", "arguments": {"a": 1}}]), FakeReply(content="Too slow."))
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        assert _run(Agent(name="waiter", tools=[slow]), QUESTION, "run") == "Too slow."

    spans = sink.of(rollout_id)
    (tool,) = _of_kind(spans, "tool")
    message = default_tool_timeout_error_message(tool_name="slow", timeout_seconds=0.05)
    assert (
        tool.status == "error" and tool.error == message and tool.attributes[semconv.ERROR_TYPE] == "ToolTimeoutError"
    )
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == message  # what the model was told
    (agent,) = _of_kind(spans, "agent")
    assert agent.status != "error"  # the SDK handled it: the run went on
    first = min(_of_kind(spans, "llm"), key=lambda s: s.sequence_id)
    assert _air(spans) == {first.span_id: pytest.approx({"air.tool_error": -0.1})}


def test_a_tool_that_returns_timeout_like_text_is_not_a_timeout(fake_openai, instrumented, sink) -> None:
    """Only the SDK's exact message, naming this very tool, counts."""

    @function_tool
    def echo(text: str) -> str:
        """Echo the text."""
        return text

    said = "Tool 'other' timed out after 1 seconds."
    fake_openai.script(FakeReply(tool_calls=[{"name": "echo", "arguments": {"text": said}}]), FakeReply(content="ok"))
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        _run(Agent(name="echoer", tools=[echo]), QUESTION, "run")
    (tool,) = _of_kind(sink.of(rollout_id), "tool")
    assert tool.status != "error" and tool.attributes[semconv.TOOL_CALL_RESULT] == said


@function_tool
@agl.tool
def recorded_twice_divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def test_a_tool_recorded_by_both_agl_tool_and_function_tool_costs_one_air_penalty(
    fake_openai, instrumented, sink
) -> None:
    """@function_tool over @agl.tool (the README advertises @agl.tool) makes two nested tool spans for one
    call; AIR counted a failure of it twice."""
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "recorded_twice_divide", "arguments": {"a": 4, "b": 0}}]),
        FakeReply(content="I could not."),
    )
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        Runner.run_sync(Agent(name="calculator", tools=[recorded_twice_divide]), QUESTION)

    spans = sink.of(rollout_id)
    outer, inner = sorted(_of_kind(spans, "tool"), key=lambda s: s.start_time)
    assert inner.parent_id == outer.span_id and outer.status == inner.status == "error"
    first = min(_of_kind(spans, "llm"), key=lambda s: s.sequence_id)
    assert _air(spans) == {first.span_id: pytest.approx({"air.tool_error": -0.1})}


def test_a_tool_error_that_ends_the_run_still_ends_every_span(fake_openai, instrumented, sink) -> None:
    rollout_id = _rollout_id()
    agent = Agent(name="divider", instructions="Divide.", tools=[divide_strict])
    with rollout_scope(rollout_id, "at-1"), pytest.raises(Exception, match="division by zero"):
        Runner.run_sync(agent, "What is 4 divided by 0?")

    spans = sink.of(rollout_id)  # only ended spans reach the store
    assert sorted(s.kind for s in spans) == ["agent", "chain", "llm", "tool"]
    (tool,) = _of_kind(spans, "tool")
    assert tool.status == "error" and "division by zero" in tool.error
    assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN  # nothing left attached


@function_tool
async def slow_lookup(query: str) -> str:
    """Look something up, slowly."""
    await asyncio.sleep(5)
    return f"found {query}"


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_a_tool_cancelled_with_its_run_is_a_failed_call_with_its_arguments_and_call_id(
    api: str, fake_openai, instrumented, sink
) -> None:
    """``asyncio.wait_for`` around ``Runner.run`` (a rollout timeout does the same): the SDK ends its trace
    before the function span of the tool it was running, with no error on it. The span was ended at trace
    end as a tool that worked, without the arguments and call id the SDK only delivered after."""
    set_default_openai_api(api)
    fake_openai.script(FakeReply(tool_calls=[{"id": "call-slow", "name": "slow_lookup", "arguments": {"query": "pi"}}]))
    rollout_id = _rollout_id()

    async def scenario() -> None:
        with rollout_scope(rollout_id, "at-1"):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(Runner.run(Agent(name="searcher", tools=[slow_lookup]), QUESTION), 0.5)

    asyncio.run(scenario())

    spans = sink.of(rollout_id)
    (tool,) = _of_kind(spans, "tool")
    assert tool.status == "error" and tool.attributes[semconv.ERROR_TYPE] == "CancelledError"
    assert "cancelled before the tool finished" in tool.error
    assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"query": "pi"}
    assert tool.attributes[semconv.TOOL_CALL_ID] == "call-slow"
    assert semconv.TOOL_CALL_RESULT not in tool.attributes
    (agent,) = _of_kind(spans, "agent")
    (workflow,) = [s for s in spans if s.parent_id is None]
    for stopped in (agent, workflow):  # stopped by its caller: not a failure (as LangChain's adapter records it)
        assert stopped.status != "error" and stopped.attributes[semconv.SPAN_STOPPED] is True
    (llm,) = _of_kind(spans, "llm")
    assert _air(spans) == {}  # interrupted, not failed on its own: AIR does not judge the call by it
    assert _open_mirrors() == 0
    assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN


def test_a_run_cancelled_during_a_model_request_is_stopped_not_failed(fake_openai, instrumented, sink) -> None:
    """No tool was running, so nothing was left open: the agent span and the workflow chain, which the SDK ends
    with no error as the cancellation leaves them, were stored as a run that finished."""
    fake_openai.script(FakeReply(content="Too late.", delay=5))
    rollout_id = _rollout_id()

    async def scenario() -> None:
        with rollout_scope(rollout_id, "at-1"), pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(Runner.run(_calculator(), QUESTION), 0.5)

    asyncio.run(scenario())

    spans = sink.of(rollout_id)
    (agent,) = _of_kind(spans, "agent")
    (workflow,) = [s for s in spans if s.parent_id is None]
    for stopped in (agent, workflow):
        assert stopped.status != "error" and stopped.attributes[semconv.SPAN_STOPPED] is True
    assert _open_mirrors() == 0


@pytest.mark.parametrize("handled", [ValueError("earlier"), asyncio.CancelledError()])
def test_a_run_started_while_its_caller_handles_an_exception_is_not_ended_by_it(
    handled: BaseException, fake_openai, instrumented, sink
) -> None:
    """A fallback run in an ``except`` block: the caller's exception is still the one being handled as the SDK
    ends each span, yet it is not the run's; read as the run's, it would fail or stop a run that finished."""
    rollout_id = _rollout_id()

    async def scenario() -> str:
        try:
            raise handled
        except (ValueError, asyncio.CancelledError):
            with rollout_scope(rollout_id, "at-1"):
                return (await Runner.run(_calculator(), QUESTION)).final_output

    assert asyncio.run(scenario()) == "The answer is 5.0."
    spans = sink.of(rollout_id)
    assert sorted(s.kind for s in spans) == ["agent", "chain", "llm", "llm", "tool"]
    for span in spans:
        assert span.status != "error" and semconv.SPAN_STOPPED not in span.attributes


def test_a_tool_the_sdk_cancels_beside_a_failing_one_is_a_failed_call(fake_openai, instrumented, sink) -> None:
    """Parallel calls: a strict tool raises, so the SDK cancels its sibling, and ends that sibling's span
    with no error. It was stored as a call that worked, with no result. The agent span fails with the SDK's
    generic error, which older SDKs (0.5) did not put on it, marking it stopped instead: they left the
    sibling running."""
    fake_openai.script(
        FakeReply(
            tool_calls=[
                {"id": "call-slow", "name": "slow_lookup", "arguments": {"query": "pi"}},
                {"id": "call-div", "name": "divide_strict", "arguments": {"a": 1, "b": 0}},
            ]
        )
    )
    rollout_id = _rollout_id()
    agent = Agent(name="calculator", tools=[slow_lookup, divide_strict])
    with rollout_scope(rollout_id, "at-1"), pytest.raises(Exception, match="division by zero"):
        Runner.run_sync(agent, QUESTION)

    spans = sink.of(rollout_id)
    tools = {t.attributes[semconv.TOOL_NAME]: t for t in _of_kind(spans, "tool")}
    assert "division by zero" in tools["divide_strict"].error
    cancelled = tools["slow_lookup"]
    assert cancelled.status == "error" and cancelled.attributes[semconv.ERROR_TYPE] == "CancelledError"
    assert cancelled.attributes[semconv.TOOL_CALL_ID] == "call-slow"
    assert json.loads(cancelled.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"query": "pi"}
    (agent_span,) = _of_kind(spans, "agent")
    assert agent_span.status == "error"  # the run failed: its error, not a stopped mark
    assert agent_span.attributes[semconv.ERROR_TYPE] == "Error in agent run" and "division by zero" in agent_span.error
    assert semconv.SPAN_STOPPED not in agent_span.attributes
    (workflow,) = [s for s in spans if s.parent_id is None]
    assert semconv.SPAN_STOPPED not in workflow.attributes
    assert _open_mirrors() == 0


@agents.input_guardrail
async def refuse_everything(ctx: Any, agent: Agent, text: Any) -> agents.GuardrailFunctionOutput:
    return agents.GuardrailFunctionOutput(output_info="no", tripwire_triggered=True)


@pytest.mark.parametrize("mode", ["run", "run_streamed"])
@pytest.mark.parametrize(
    "case, error_type",
    [("unknown tool", "Tool not found"), ("input tripwire", "Guardrail tripwire triggered")],
)
def test_a_run_that_fails_in_a_turn_fails_its_agent_span(
    case: str, error_type: str, mode: str, fake_openai, instrumented, sink
) -> None:
    """The SDK records these failures on its turn span, which agl passes through: the agent span of the
    failed run looked successful (and did fail for the same tripwire streamed, where the SDK puts the error on
    the agent span)."""
    if case == "unknown tool":
        fake_openai.script(FakeReply(tool_calls=[{"name": "no_such_tool", "arguments": {}}]))
        agent = _calculator()
    else:
        agent = _calculator(input_guardrails=[refuse_everything])
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"), pytest.raises(agents.exceptions.AgentsException):
        _run(agent, QUESTION, mode)

    spans = sink.of(rollout_id)
    (agent_span,) = _of_kind(spans, "agent")
    assert agent_span.status == "error" and agent_span.error == error_type
    assert agent_span.attributes[semconv.ERROR_TYPE] == error_type
    (workflow,) = [s for s in spans if s.parent_id is None]
    assert workflow.status != "error"  # the turn's error goes to its nearest mirrored ancestor only
    assert _open_mirrors() == 0


@pytest.mark.skipif(SDK_VERSION < (0, 14), reason="turn spans are new in openai-agents 0.14")
def test_a_turn_error_is_kept_over_the_agent_spans_later_generic_one(instrumented, sink) -> None:
    """The first error is the cause: the SDK's generic one, on the agent span after its turn failed, neither
    replaces it nor marks the span twice."""
    rollout_id = _rollout_id()

    def scenario() -> None:
        with rollout_scope(rollout_id, "at-1"), agents.trace("manual"):
            with agents.tracing.agent_span(name="manual_agent") as agent_span:
                with agents.tracing.turn_span(turn=1, agent_name="manual_agent") as turn:
                    turn.set_error(agents.tracing.SpanError(message="Tool not found", data={"tool_name": "x"}))
                with agents.tracing.turn_span(turn=2, agent_name="manual_agent") as turn:
                    turn.set_error(agents.tracing.SpanError(message="Second", data={}))
                agent_span.set_error(agents.tracing.SpanError(message="Error in agent run", data={"error": "boom"}))

    contextvars.copy_context().run(scenario)

    (agent_span,) = _of_kind(sink.of(rollout_id), "agent")
    assert agent_span.error == agent_span.attributes[semconv.ERROR_TYPE] == "Tool not found"


def test_a_model_request_the_sdk_retried_does_not_fail_the_agent(fake_openai, instrumented, sink) -> None:
    """Model spans pass through without their errors: the failed request is an error llm span already, and
    the SDK's runner-level retry (``ModelSettings(retry=...)``) recovered from it."""
    retry = pytest.importorskip("agents.retry")
    fake_openai.script(FakeReply(status_code=500, error_message="try again"), FakeReply(content="Fine."))
    settings = agents.ModelSettings(
        retry=retry.ModelRetrySettings(
            max_retries=1,
            backoff={"initial_delay": 0.01, "jitter": False},
            policy=retry.retry_policies.http_status([500]),
        )
    )
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        assert _run(Agent(name="retrier", model_settings=settings), QUESTION, "run") == "Fine."

    spans = sink.of(rollout_id)
    assert [s.status == "error" for s in sorted(_of_kind(spans, "llm"), key=lambda s: s.sequence_id)] == [True, False]
    (agent_span,) = _of_kind(spans, "agent")
    assert agent_span.status != "error"


# -- concurrency: threads and asyncio tasks keep their spans in their own rollout ----------------------------
def _assert_rollout_holds_only_its_run(spans: List[Span], question: str) -> None:
    by_id = {s.span_id: s for s in spans}
    assert len(_of_kind(spans, "agent")) == 1
    llm = _of_kind(spans, "llm")
    assert len(llm) == 2
    for span in llm + _of_kind(spans, "tool"):
        assert agent_name_of(span, by_id) == "calculator"
    for span in llm:
        assert question in span.attributes[semconv.INPUT_MESSAGES]
    assert len({s.trace_id for s in spans}) == 1


def test_concurrent_rollouts_in_threads_keep_their_spans(fake_openai, instrumented, sink) -> None:
    fake_openai.script(*[FakeReply(delay=0.2) for _ in range(4)])  # slow model: the two runs overlap
    questions = {_rollout_id(): "What is 2 plus 3?", _rollout_id(): "What is 40 plus 2?"}
    with ThreadPoolExecutor(2) as pool:
        futures = []
        for rollout_id, question in questions.items():
            with rollout_scope(rollout_id, "at-1"):
                agent = _calculator(model=_own_model(fake_openai.base_url))
                futures.append(agl.submit(pool, Runner.run_sync, agent, question))
        outputs = [f.result().final_output for f in futures]

    assert outputs == ["The answer is 5.0.", "The answer is 42.0."]
    for rollout_id, question in questions.items():
        _assert_rollout_holds_only_its_run(sink.of(rollout_id), question)


async def test_concurrent_rollouts_in_asyncio_tasks_keep_their_spans(fake_openai, instrumented, sink) -> None:
    fake_openai.script(*[FakeReply(delay=0.2) for _ in range(4)])

    async def one(rollout_id: str, question: str, streamed: bool) -> Any:
        with rollout_scope(rollout_id, "at-1"):
            if streamed:
                return (await _drain(_calculator(), question)).final_output
            return (await Runner.run(_calculator(), question)).final_output

    runs = [(_rollout_id(), "What is 2 plus 3?", False), (_rollout_id(), "What is 40 plus 2?", True)]
    outputs = await asyncio.gather(*(one(*run) for run in runs))
    assert _open_mirrors() == 0

    assert outputs == ["The answer is 5.0.", "The answer is 42.0."]
    for rollout_id, question, _ in runs:
        _assert_rollout_holds_only_its_run(sink.of(rollout_id), question)


async def test_an_abandoned_stream_leaves_the_context_clean(fake_openai, instrumented, sink, caplog) -> None:
    errors_before = internal_error_count()
    first, second = _rollout_id(), _rollout_id()
    with rollout_scope(first, "at-1"):
        result = Runner.run_streamed(_calculator(), QUESTION)
        async for _ in result.stream_events():
            result.cancel()  # the user stops reading after the first event
        with rollout_scope(second, "at-1"):
            await Runner.run(_calculator(), QUESTION)

    assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN
    assert "workflow Agent workflow" in [s.name for s in sink.of(first)]  # the cancelled run's spans ended
    assert _open_mirrors() == 0
    spans = sink.of(second)
    by_id = {s.span_id: s for s in spans}
    assert [agent_name_of(s, by_id) for s in _of_kind(spans, "llm")] == ["calculator", "calculator"]
    assert not [r for r in caplog.records if "detach" in r.getMessage()]
    assert internal_error_count() == errors_before


def test_a_span_ended_from_another_context_leaves_that_context_alone(instrumented, sink, caplog) -> None:
    """What an async generator finalized by another task does: the SDK ends the span without resetting it."""
    rollout_id = _rollout_id()

    def scenario() -> None:  # in a context of its own, so that what stays attached here is dropped after
        with rollout_scope(rollout_id, "at-1"), agents.trace("manual"):
            span = agents.tracing.agent_span(name="manual_agent")
            span.start(mark_as_current=True)
            ours = otel_trace.get_current_span()
            contextvars.copy_context().run(span.finish)  # another context ends it
            assert otel_trace.get_current_span() is ours  # this context is not changed behind its back

    with caplog.at_level(logging.WARNING):
        contextvars.copy_context().run(scenario)

    assert [s.name for s in sink.of(rollout_id)] == ["workflow manual", "invoke_agent manual_agent"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no "Failed to detach context"


def test_a_span_the_sdk_never_ends_is_ended_with_its_trace(instrumented, sink) -> None:
    rollout_id = _rollout_id()

    def scenario() -> None:
        with rollout_scope(rollout_id, "at-1"), agents.trace("manual"):
            agents.tracing.agent_span(name="forgotten").start(mark_as_current=True)

    contextvars.copy_context().run(scenario)

    workflow, forgotten = sink.of(rollout_id)
    assert [workflow.name, forgotten.name] == ["workflow manual", "invoke_agent forgotten"]
    for span in (workflow, forgotten):  # interrupted, not finished: marked stopped, not failed
        assert span.status != "error" and span.attributes[semconv.SPAN_STOPPED] is True
    assert _open_mirrors() == 0


# -- instrument / uninstrument -------------------------------------------------------------------------------
def _sdk_class_attributes() -> Dict[str, Any]:
    from agents.run import AgentRunner

    owners = (AgentRunner, Runner, agents.FunctionTool, agents.tracing.provider.DefaultTraceProvider)
    return {f"{cls.__name__}.{name}": value for cls in owners for name, value in vars(cls).items()}


def test_uninstrument_restores_the_sdk_exactly(sdk: UserProcessor, fake_openai, sink) -> None:
    classes_before = _sdk_class_attributes()
    instrumentor = OpenAIAgentsInstrumentor()
    assert instrumentor.instrument()
    late = UserProcessor()
    agents.add_trace_processor(late)  # the user adds another processor after agl's
    assert len(_processors()) == 3 and isinstance(_processors()[1], AglTracingProcessor)

    instrumentor.uninstrument()

    assert _processors() == (sdk, late)  # the same objects, in order: only agl's is gone
    assert _sdk_class_attributes() == classes_before  # nothing was patched, nothing left behind
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        Runner.run_sync(_calculator(), QUESTION)
    assert sink.of(rollout_id) == []  # no agl spans any more ...
    assert sdk.agents_seen == late.agents_seen == ["calculator"]  # ... while the user's processors still work


def test_instrumenting_twice_equals_once(fake_openai, instrumented, sink) -> None:
    assert agl.instrument(frameworks=["openai_agents"]) == ["openai", "thread_pools", "openai_agents"]
    second = OpenAIAgentsInstrumentor()  # e.g. the user's own, beside agl.instrument()'s
    assert second.instrument()
    assert sum(isinstance(p, AglTracingProcessor) for p in _processors()) == 1

    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        Runner.run_sync(_calculator(), QUESTION)
    second.uninstrument()  # it added nothing, so it removes nothing

    assert sorted(s.kind for s in sink.of(rollout_id)) == ["agent", "chain", "llm", "llm", "tool"]
    assert sum(isinstance(p, AglTracingProcessor) for p in _processors()) == 1


def test_a_second_instrumentor_keeps_recording_after_agl_uninstrument(sdk: UserProcessor, fake_openai, sink) -> None:
    """A second instance shares agl's processor: it said it was instrumented, yet once ``agl.uninstrument()``
    took the one processor out, agent and tool spans were lost without a word (and ``instrument()`` again
    could not repair it)."""
    from agl.instrumentation.base import is_hooked

    def recorded_kinds() -> List[str]:
        rollout_id = _rollout_id()
        with rollout_scope(rollout_id, "at-1"):
            Runner.run_sync(_calculator(), QUESTION)
        return sorted(s.kind for s in sink.of(rollout_id))

    agl.uninstrument()
    assert agl.instrument(frameworks=["openai_agents"])
    mine = OpenAIAgentsInstrumentor()
    assert mine.instrument() and mine.instrument()  # idempotent: still one use of the shared processor
    try:
        assert sum(isinstance(p, AglTracingProcessor) for p in _processors()) == 1
        agl.uninstrument()
        agl.instrument(frameworks=[])  # the OpenAI-client layer again, for the llm spans
        assert mine.is_instrumented and is_hooked("openai_agents")
        assert [type(p) for p in _processors()] == [UserProcessor, AglTracingProcessor]
        assert recorded_kinds() == ["agent", "chain", "llm", "llm", "tool"]
    finally:
        mine.uninstrument()
    assert _processors() == (sdk,)  # the last user took out agl's processor, and only it
    assert not is_hooked("openai_agents") and recorded_kinds() == ["llm", "llm"]
    agl.uninstrument()


def test_an_internal_error_never_reaches_the_user(monkeypatch, fake_openai, instrumented, sink) -> None:
    from agl.integrations.openai_agents import _processor

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(_processor, "start_agent_span", broken)
    errors_before = internal_error_count("openai_agents.span_start")
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        output = Runner.run_sync(_calculator(), QUESTION).final_output

    assert output == "The answer is 5.0."
    assert internal_error_count("openai_agents.span_start") > errors_before
    assert len(_of_kind(sink.of(rollout_id), "llm")) == 2  # the model calls are still recorded


def test_outside_the_supported_range_it_warns_once_and_does_nothing(monkeypatch, caplog) -> None:
    instrumentor = OpenAIAgentsInstrumentor()
    monkeypatch.setattr(instrumentor, "instruments", ("openai-agents>=99",))
    with caplog.at_level(logging.WARNING, "agl.instrumentation"):
        assert instrumentor.instrument() is False
        assert instrumentor.instrument() is False
    assert len([r for r in caplog.records if "outside the supported range" in r.getMessage()]) == 1
    assert not any(isinstance(p, AglTracingProcessor) for p in _processors())


def test_disabled_sdk_tracing_is_reported(caplog) -> None:
    set_tracing_disabled(True)
    instrumentor = OpenAIAgentsInstrumentor()
    try:
        with caplog.at_level(logging.WARNING, "agl.instrumentation"):
            assert instrumentor.instrument()
    finally:
        instrumentor.uninstrument()
        set_tracing_disabled(False)
    assert any("tracing is disabled" in r.getMessage() for r in caplog.records)


def test_set_trace_processors_after_instrument_leaves_agl_recording(fake_openai, instrumented, sink, sdk) -> None:
    """``set_trace_processors([])`` keeps traces away from api.openai.com; done at import time, after
    ``agl.instrument()``, it dropped agl's processor too and the agents' spans went missing silently."""
    set_trace_processors([])
    assert [type(p) for p in _processors()] == [AglTracingProcessor]
    set_trace_processors([sdk])
    assert [type(p) for p in _processors()] == [UserProcessor, AglTracingProcessor]
    rollout_id = _rollout_id()
    with rollout_scope(rollout_id, "at-1"):
        assert _run(_calculator(), QUESTION, "run") == "The answer is 5.0."
    spans = sink.of(rollout_id)
    assert [s.attributes[semconv.AGENT_NAME] for s in _of_kind(spans, "agent")] == ["calculator"]
    assert len(_of_kind(spans, "tool")) == 1 and sdk.agents_seen == ["calculator"]
    agl.uninstrument()  # the patch goes with agl: a replacement is the user's alone again
    assert not any(isinstance(p, AglTracingProcessor) for p in _processors())
    set_trace_processors([sdk])
    assert _processors() == (sdk,)


@pytest.mark.parametrize("how", ["set_tracing_disabled", "run_config"])
def test_an_llm_call_in_a_run_with_tracing_disabled_warns_once(
    how: str, fake_openai, instrumented, sink, caplog
) -> None:
    """Disabling the SDK's tracing after ``agl.instrument()`` (or for one run) left agl blind to the agents
    with no word: the LLM calls still came, belonging to no SDK agent, so agent_match found nothing."""
    from agents import RunConfig

    from agl.integrations.openai_agents import _registration

    _registration._Untraced.warned = False
    config = RunConfig(tracing_disabled=True) if how == "run_config" else None
    if how == "set_tracing_disabled":
        set_tracing_disabled(True)
    rollout_id = _rollout_id()
    try:
        with caplog.at_level(logging.WARNING, "agl.instrumentation"), rollout_scope(rollout_id, "at-1"):
            for _ in range(2):  # (a client per event loop)
                asyncio.run(
                    Runner.run(_calculator(model=_own_model(fake_openai.base_url)), QUESTION, run_config=config)
                )
    finally:
        set_tracing_disabled(False)
    warnings = [r.getMessage() for r in caplog.records if "tracing is disabled" in r.getMessage()]
    assert len(warnings) == 1 and "set_trace_processors([])" in warnings[0]
    spans = sink.of(rollout_id)
    assert len(_of_kind(spans, "llm")) == 4 and not _of_kind(spans, "agent")
    caplog.clear()
    with caplog.at_level(logging.WARNING, "agl.instrumentation"), rollout_scope(_rollout_id(), "at-1"):
        _registration._Untraced.warned = False
        asyncio.run(Runner.run(_calculator(model=_own_model(fake_openai.base_url)), QUESTION))  # traced: no warning
    assert not [r for r in caplog.records if "tracing is disabled" in r.getMessage()]


def test_the_example_runs_as_its_docstring_says(dev_example) -> None:
    dev_example("openai_agents_agent.py:openai_agents_calc_agent", "^calculator$")
