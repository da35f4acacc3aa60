"""The LangChain + LangGraph adapter, end to end: real LangChain/LangGraph, the real ``openai`` client under
``ChatOpenAI``, agl's fake OpenAI server, spans read back from a real rollout (SQLite store or the tracer's
sink). The span tree is what is asserted: which agent each llm span belongs to decides what LightningRL
trains on."""

from __future__ import annotations

import asyncio
import json
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable, Dict, Iterator, List, Optional, Sequence

import openai
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

from langchain_core.callbacks import BaseCallbackHandler, CallbackManager
from langchain_core.callbacks.base import BaseCallbackManager
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import InjectedToolCallId, StructuredTool, ToolException, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

import agl
import agl.instrumentation
from agl import semconv
from agl._util.safety import internal_error_count
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.integrations.langchain import LangChainInstrumentor
from agl.integrations.langchain._handler import AglCallbackHandler
from agl.lightningrl.agent_match import agent_name_of, select_llm_calls
from agl.lightningrl.air import AIRConfig, air_rewards
from agl.lightningrl.links import CallLinks
from agl.lightningrl.tree import build_tree
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply, assert_tool_reward_credited
from agl.tracing import context_keys
from agl.tracing.tracer import get_tracer
from agl.types import Span

with warnings.catch_warnings():  # LangGraph 1.x deprecates it in favour of langchain.agents.create_agent
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")

GENERATION_PATHS = ("/chat/completions", "/responses")


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


# -- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture
def instrumented() -> Iterator[LangChainInstrumentor]:
    agl.instrumentation.uninstrument()  # a test elsewhere may have left agl.instrument() on
    openai_inst, langchain_inst = OpenAIInstrumentor(), LangChainInstrumentor()
    assert openai_inst.instrument() and langchain_inst.instrument()
    yield langchain_inst
    langchain_inst.uninstrument()
    openai_inst.uninstrument()


def model(base_url: str, **options: Any) -> ChatOpenAI:
    # A fresh async HTTP client per model: langchain-openai caches a default one per base URL, which breaks
    # once the event loop it was first used on (one asyncio.run per async rollout) is closed.
    return ChatOpenAI(
        base_url=base_url,
        api_key="x",
        model="fake-model",
        max_retries=0,
        http_async_client=openai.DefaultAsyncHttpxClient(),
        **options,
    )


def langchain_create_agent() -> Callable[..., Any]:
    """``langchain.agents.create_agent`` (LangChain 1.x); skips the test where this LangChain has none."""
    agents_module = pytest.importorskip("langchain.agents")
    if not hasattr(agents_module, "create_agent"):
        pytest.skip("langchain.agents.create_agent needs langchain>=1.0")
    return agents_module.create_agent


def run_dev(tmp_path: Any, fake_openai: FakeOpenAIServer, agent: Any, tasks: Sequence[Dict[str, Any]]) -> List[Any]:
    """Run ``agent`` on ``tasks`` through Trainer.dev; (summary row, spans from SQLite) per task."""
    db = tmp_path / f"{uuid.uuid4().hex[:6]}.db"
    trainer = agl.Trainer(
        store=str(db),
        runner_mode="thread",
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake-model")},
        progress=False,
    )
    rows = trainer.dev(agent, list(tasks), print_table=False)
    store = SqliteLightningStore(db)
    try:
        return [(row, store.query_spans(row.rollout_id)) for row in rows]
    finally:
        store.close()


def generation_requests(fake_openai: FakeOpenAIServer) -> List[Dict[str, Any]]:
    return [r for r in fake_openai.requests if r["path"].endswith(GENERATION_PATHS)]


def of_kind(spans: Sequence[Span], kind: str) -> List[Span]:
    return sorted((s for s in spans if s.kind == kind), key=lambda s: s.sequence_id)


def agent_of(span: Span, spans: Sequence[Span]) -> Optional[str]:
    return agent_name_of(span, {s.span_id: s for s in spans})


def last_input_text(span: Span) -> str:
    """The last message the model was sent, in either API's format."""
    sent = json.loads(span.attributes[semconv.INPUT_MESSAGES])
    messages = sent["input"] if isinstance(sent, dict) else sent
    content = messages[-1].get("content") or messages[-1].get("output") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def air_per_call(spans: Sequence[Span]) -> List[Dict[str, float]]:
    """AIR's rewards (default weights) for each llm span, in order: what LightningRL would add to each call."""
    calls = [s.span_id for s in of_kind(spans, "llm")]
    rewards = air_rewards(CallLinks(build_tree(spans)), calls, AIRConfig())
    return [rewards.get(call, {}) for call in calls]


def assert_one_tree(spans: Sequence[Span]) -> None:
    """All spans of a rollout hang under one root: no span was parented into another rollout."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]
    assert [r.name for r in roots] == [roots[0].name] and len(roots) == 1, [r.name for r in roots]


def two_node_graph(base_url: str, streaming: bool = False) -> Any:
    """``write_query`` calls the model with a tool until the tool answered; ``rewrite_query`` then calls it
    once more. Two differently named LLM nodes and one tool node."""
    llm = model(base_url, streaming=streaming)

    def write_query(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [llm.bind_tools([add]).invoke(state["messages"])]}

    def rewrite_query(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"] + [HumanMessage("rewrite the query")])]}

    def after_write(state: MessagesState) -> str:
        return "tools" if state["messages"][-1].tool_calls else "rewrite_query"

    graph = StateGraph(MessagesState)
    graph.add_node("write_query", write_query)
    graph.add_node("tools", ToolNode([add]))
    graph.add_node("rewrite_query", rewrite_query)
    graph.add_edge(START, "write_query")
    graph.add_conditional_edges("write_query", after_write, ["tools", "rewrite_query"])
    graph.add_edge("tools", "write_query")
    graph.add_edge("rewrite_query", END)
    return graph.compile()


# -- the key one: agent_match selects exactly one node's LLM calls ---------------------------------------------
def test_agent_match_selects_exactly_the_calls_of_the_chosen_node(tmp_path, fake_openai, instrumented):
    @agl.rollout
    def sql_app(task, llm):
        out = two_node_graph(llm.get_base_url()).invoke({"messages": [HumanMessage(task["question"])]})
        return 1.0 if "5" in out["messages"][-3].content else 0.0

    ((row, spans),) = run_dev(tmp_path, fake_openai, sql_app, [{"question": "What is 2 plus 3?"}])
    assert row.status == "succeeded" and row.reward == 1.0
    llm_spans = of_kind(spans, "llm")
    assert len(llm_spans) == len(generation_requests(fake_openai)) == 3

    write = select_llm_calls(spans, "^write")
    rewrite = select_llm_calls(spans, "^rewrite")
    assert [last_input_text(s) for s in write] == ["What is 2 plus 3?", "5.0"]  # question, then tool result
    assert [last_input_text(s) for s in rewrite] == ["rewrite the query"]
    assert {s.span_id for s in write} | {s.span_id for s in rewrite} == {s.span_id for s in llm_spans}
    assert len(select_llm_calls(spans, "write")) == 3  # re.search: "write" is also in "rewrite_query"
    assert select_llm_calls(spans, "^tools$") == []

    agents = [s.attributes[semconv.AGENT_NAME] for s in of_kind(spans, "agent")]
    assert agents == ["sql_app", "write_query", "tools", "write_query", "rewrite_query"]
    assert all(s.attributes[semconv.FRAMEWORK] == "langchain" for s in of_kind(spans, "agent")[1:])
    (tool_span,) = of_kind(spans, "tool")
    assert agent_of(tool_span, spans) == "tools"
    assert json.loads(tool_span.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == "5.0"
    requested = json.loads(llm_spans[0].attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"][0]["id"]
    assert tool_span.attributes[semconv.TOOL_CALL_ID] == requested
    (graph_span,) = of_kind(spans, "chain")  # LangGraph's plumbing (__start__, routing, writes) is not spanned
    assert graph_span.name == "LangGraph"
    assert_one_tree(spans)


def test_agent_lightning_code_passing_get_langchain_handler_records_each_call_once(tmp_path, fake_openai, instrumented):
    """Agent Lightning's SQL agent (the seeds' tutorial) passes ``callbacks=[self.tracer.get_langchain_handler()]``:
    with agl that was an AttributeError in every rollout. The handler is the one agl already adds, so the run
    records exactly what it records without it."""

    class SqlAgent(agl.LitAgent):
        def rollout(self, task, resources, rollout):
            graph = two_node_graph(resources["main_llm"].get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
            out = graph.invoke(
                {"messages": [HumanMessage(task["question"])]},
                {"callbacks": [self.tracer.get_langchain_handler()], "recursion_limit": 100},
            )
            return 1.0 if "5" in out["messages"][-3].content else 0.0

    ((row, spans),) = run_dev(tmp_path, fake_openai, SqlAgent(), [{"question": "What is 2 plus 3?"}])
    assert row.status == "succeeded" and row.reward == 1.0
    assert len(of_kind(spans, "llm")) == len(generation_requests(fake_openai)) == 3
    assert len(of_kind(spans, "tool")) == 1
    assert [s.attributes[semconv.AGENT_NAME] for s in of_kind(spans, "agent")][1:] == [
        "write_query",
        "tools",
        "write_query",
        "rewrite_query",
    ]
    assert_one_tree(spans)


def test_get_langchain_handler_without_instrumentation_says_what_to_do():
    agl.instrumentation.uninstrument()
    with pytest.raises(RuntimeError, match=r"call agl.instrument\(\)"):
        get_tracer().get_langchain_handler()


# -- a prebuilt agent: chat completions and Responses, plain and streamed, sync and async -----------------------
MODES = {
    "invoke": False,  # whether the model request is streamed
    "ainvoke": False,
    "stream": True,  # graph.stream(stream_mode="messages") makes the chat model stream
    "astream": True,  # ChatOpenAI(streaming=True)
}


def _responses_supported() -> bool:
    return "use_responses_api" in ChatOpenAI.model_fields


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("mode", list(MODES))
def test_react_agent_spans(tmp_path, fake_openai, instrumented, api, mode):
    if api == "responses" and not _responses_supported():
        pytest.skip("this langchain-openai has no Responses API support")
    options: Dict[str, Any] = {"use_responses_api": True} if api == "responses" else {}
    if mode == "astream":
        options["streaming"] = True

    async def run_async(graph: Any, state: Dict[str, Any]) -> Any:
        if mode == "ainvoke":
            return await graph.ainvoke(state)
        last = None
        async for chunk in graph.astream(state, stream_mode="values"):
            last = chunk
        return last

    def run(graph: Any, state: Dict[str, Any]) -> Any:
        if mode == "invoke":
            return graph.invoke(state)
        if mode == "stream":
            return list(graph.stream(state, stream_mode="messages"))
        return asyncio.run(run_async(graph, state))

    @agl.rollout
    def calculator(task, llm):
        graph = create_react_agent(model(llm.get_base_url(), **options), [add])
        run(graph, {"messages": [HumanMessage(task["question"])]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, calculator, [{"question": "What is 4 plus 9?"}])
    assert row.status == "succeeded", row.error
    requests = generation_requests(fake_openai)
    expected_path = "/responses" if api == "responses" else "/chat/completions"
    assert [r["path"].endswith(expected_path) for r in requests] == [True, True]
    assert [bool(r["body"].get("stream")) for r in requests] == [MODES[mode]] * 2

    llm_spans = of_kind(spans, "llm")
    assert len(llm_spans) == len(requests)  # exactly one llm span per HTTP request
    for span in llm_spans:
        assert agent_of(span, spans) == "agent"  # create_react_agent's model node
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]
        assert span.attributes[semconv.LLM_STREAM] is MODES[mode]
    answer = fake_openai.tokenizer.decode(llm_spans[-1].attributes[semconv.RESPONSE_TOKEN_IDS])
    assert answer == "The answer is 13.0."
    (tool_span,) = of_kind(spans, "tool")
    assert tool_span.attributes[semconv.TOOL_NAME] == "add" and agent_of(tool_span, spans) == "tools"
    assert json.loads(tool_span.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 4, "b": 9}
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == "13.0"
    assert tool_span.attributes[semconv.TOOL_CALL_ID]
    assert tool_span.status != "error"
    assert_one_tree(spans)


def test_tool_error_marks_the_tool_span_with_the_text_the_model_was_given(tmp_path, fake_openai, instrumented):
    """ToolNode builds the error message only after the tool's run failed: the span still records it."""
    fake_openai.script(FakeReply(tool_calls=[{"name": "divide", "arguments": {"a": 1, "b": 0}}]))

    @agl.rollout
    def divider(task, llm):
        tools = ToolNode([divide], handle_tool_errors=True)  # the error goes back to the model as a message
        create_react_agent(model(llm.get_base_url()), tools).invoke({"messages": [HumanMessage(task["question"])]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, divider, [{"question": "What is 1 divided by 0?"}])
    assert row.status == "succeeded", row.error
    (tool_span,) = of_kind(spans, "tool")
    assert tool_span.status == "error"
    assert tool_span.attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"
    assert json.loads(tool_span.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 1, "b": 0}
    told = "Error: ZeroDivisionError('float division by zero')\n Please fix your mistakes."
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == told
    first, second = of_kind(spans, "llm")  # the agent went on after the failed tool, and was told this
    assert last_input_text(second) == told
    assert tool_span.end_time <= second.start_time  # ended when the tool failed, not when its node did


def test_failed_tool_calls_each_get_the_text_their_own_call_was_answered_with(tmp_path, fake_openai, instrumented):
    """langchain-core 0.3 gives tool events no call id: each failed run still finds its own call (same tool,
    parallel calls, and a call repeated in a later turn) and the error text the model was told for it."""

    @tool
    def check(n: int) -> str:
        """Check a number."""
        raise ValueError(f"no {n}")

    one, two = ({"name": "check", "arguments": {"n": n}} for n in (1, 2))
    fake_openai.script(FakeReply(tool_calls=[one, two]), FakeReply(tool_calls=[one]))

    @agl.rollout
    def checker(task, llm):
        tools = ToolNode([check], handle_tool_errors=True)
        create_react_agent(model(llm.get_base_url()), tools).invoke({"messages": [HumanMessage(task["question"])]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, checker, [{"question": "Check 1 and 2."}])
    assert row.status == "succeeded", row.error
    tool_spans = of_kind(spans, "tool")
    assert [json.loads(s.attributes[semconv.TOOL_CALL_ARGUMENTS])["n"] for s in tool_spans] in ([1, 2, 1], [2, 1, 1])
    for tool_span in tool_spans:
        n = json.loads(tool_span.attributes[semconv.TOOL_CALL_ARGUMENTS])["n"]
        assert tool_span.status == "error"
        told = f"Error: ValueError('no {n}')\n Please fix your mistakes."
        assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == told
    assert len({s.attributes[semconv.TOOL_CALL_ID] for s in tool_spans}) == 3


def test_a_tool_returning_a_command_records_the_message_the_model_reads(tmp_path, fake_openai, instrumented):
    """A tool that returns ``Command(update=...)`` (to change graph state) was recorded as the Command's
    JSON dump; the model reads the ToolMessage inside it."""

    @tool
    def set_flag(value: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Set a flag."""
        return Command(update={"messages": [ToolMessage(f"flag set to {value}", tool_call_id=tool_call_id)]})

    fake_openai.script(FakeReply(tool_calls=[{"name": "set_flag", "arguments": {"value": "on"}}]))

    @agl.rollout
    def flagger(task, llm):
        create_react_agent(model(llm.get_base_url()), [set_flag]).invoke({"messages": [HumanMessage(task["question"])]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, flagger, [{"question": "Turn the flag on."}])
    assert row.status == "succeeded", row.error
    (tool_span,) = of_kind(spans, "tool")
    assert tool_span.status != "error"
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == "flag set to on"
    first, _ = of_kind(spans, "llm")
    requested = json.loads(first.attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"][0]["id"]
    assert tool_span.attributes[semconv.TOOL_CALL_ID] == requested


def _no_weather(city: str) -> str:
    """Weather for a city."""
    raise ToolException(f"no weather service for {city}")


def _weather(city: str, days: int) -> str:
    """Weather for a city over some days."""
    return f"sunny in {city} for {days} days"


HANDLED_TOOL_ERRORS = {  # the tool, the arguments the model sends, the text LangChain answers the model with
    "handle_tool_error": (
        StructuredTool.from_function(_no_weather, name="weather", handle_tool_error=True),
        {"city": "Paris"},
        "no weather service for Paris",
    ),
    "handle_validation_error": (
        StructuredTool.from_function(_weather, name="weather", handle_validation_error="days must be a number"),
        {"city": "Paris", "days": "many"},
        "days must be a number",
    ),
}


@pytest.mark.parametrize("case", list(HANDLED_TOOL_ERRORS))
def test_a_tool_that_handles_its_own_error_is_a_failed_tool(fake_openai, instrumented, sink, case):
    """LangChain reports a handled failure through ``on_tool_end``, as a ToolMessage with status "error": the
    span is still an error, with the text the model read, so AIR penalises the call that asked for it."""
    weather, arguments, told = HANDLED_TOOL_ERRORS[case]
    fake_openai.script(FakeReply(tool_calls=[{"name": "weather", "arguments": arguments}]), FakeReply(content="sorry"))
    with agl.rollout_scope(f"ro-handled-{case}", "at-1"):
        create_react_agent(model(fake_openai.base_url), [weather]).invoke({"messages": [HumanMessage("weather?")]})
    spans = sink.of(f"ro-handled-{case}")
    (tool_span,) = of_kind(spans, "tool")
    assert tool_span.status == "error" and tool_span.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == told
    assert last_input_text(of_kind(spans, "llm")[1]) == told
    assert air_per_call(spans) == [{"air.tool_error": -0.1}, {}]


def _tool_call_limited(base_url: str) -> Any:
    """A ``create_agent`` agent allowed one tool call per run; the calls past it are answered with an error."""
    middleware = pytest.importorskip("langchain.agents.middleware")
    limit = middleware.ToolCallLimitMiddleware(run_limit=1, exit_behavior="continue")
    return langchain_create_agent()(model(base_url), [add], middleware=[limit])


# the agent, the calls the model makes (the last is answered unrun), what the model is told, the node telling it
UNRUN_TOOL_CALLS = {
    "unknown_tool_in_create_react_agent": (
        lambda base_url: create_react_agent(model(base_url), [add]),
        [("add", {"a": 1, "b": 2}), ("multiply", {"a": 3, "b": 4})],
        "Error: multiply is not a valid tool, try one of [add].",
        "tools",
    ),
    "unknown_tool_in_create_agent": (
        lambda base_url: langchain_create_agent()(model(base_url), [add]),
        [("add", {"a": 1, "b": 2}), ("multiply", {"a": 3, "b": 4})],
        "Error: multiply is not a valid tool, try one of [add].",
        "tools",
    ),
    "call_over_the_tool_call_limit": (
        _tool_call_limited,
        [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})],
        "Tool call limit exceeded. Do not make additional tool calls.",
        "ToolCallLimitMiddleware.after_model",
    ),
}


@pytest.mark.parametrize("case", list(UNRUN_TOOL_CALLS))
def test_a_call_answered_with_an_error_without_a_tool_run_is_a_failed_tool(fake_openai, instrumented, sink, case):
    """LangGraph answers a call of an unknown tool, and middleware a call it blocks, with an error ToolMessage
    and runs no tool, so LangChain reports no tool run. The call still gets an error tool span, under the node
    that answered it, so AIR penalises it; the call whose tool ran keeps its one successful span."""
    build, calls, told, node = UNRUN_TOOL_CALLS[case]
    fake_openai.script(
        FakeReply(tool_calls=[{"name": name, "arguments": arguments} for name, arguments in calls]),
        FakeReply(content="done"),
    )
    with agl.rollout_scope(f"ro-unrun-{case}", "at-1"):
        out = build(fake_openai.base_url).invoke({"messages": [HumanMessage("add")]})
    assert (told, "error") in [(m.content, m.status) for m in out["messages"] if m.type == "tool"]
    spans = sink.of(f"ro-unrun-{case}")
    assert_one_tree(spans)
    first = of_kind(spans, "llm")[0]
    requested = [c["id"] for c in json.loads(first.attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"]]
    ran, unrun = sorted(of_kind(spans, "tool"), key=lambda s: s.status == "error")  # exactly one of each
    assert (ran.status, ran.attributes[semconv.TOOL_CALL_RESULT]) == ("unset", "3.0")
    assert ran.attributes[semconv.TOOL_CALL_ID] == requested[0]
    assert unrun.status == "error" and unrun.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert unrun.attributes[semconv.TOOL_NAME] == calls[1][0]
    assert unrun.attributes[semconv.TOOL_CALL_ID] == requested[1]
    assert json.loads(unrun.attributes[semconv.TOOL_CALL_ARGUMENTS]) == calls[1][1]
    assert unrun.attributes[semconv.TOOL_CALL_RESULT] == told
    assert agent_of(unrun, spans) == node
    assert air_per_call(spans) == [{"air.tool_error": -0.1}, {}]


@tool
def graded_add(a: float, b: float) -> float:
    """Add two numbers (and grade the call)."""
    agl.emit_reward(0.5)
    return a + b


def test_a_reward_emitted_in_a_langchain_tool_is_a_step_reward_for_the_call_that_asked_for_it(
    tmp_path, fake_openai, instrumented
):
    """LangChain's tool run is never current: the emitter asks the adapter's resolver, as the tracer does."""
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "graded_add", "arguments": {"a": 1, "b": 2}}]), FakeReply(content="3")
    )

    @agl.rollout
    def grader(task, llm):
        create_react_agent(model(llm.get_base_url()), [graded_add]).invoke(
            {"messages": [HumanMessage(task["question"])]}
        )
        return 1.0

    ((row, spans),) = run_dev(tmp_path, fake_openai, grader, [{"question": "What is 1 plus 2?"}])
    assert row.status == "succeeded" and row.reward == 1.0  # the returned reward is the episode's
    assert_tool_reward_credited(spans, 0.5)


def test_node_error_marks_the_node_span(tmp_path, fake_openai, instrumented):
    def broken(state: MessagesState) -> Dict[str, Any]:
        raise RuntimeError("node failed")

    @agl.rollout
    def failing(task, llm):
        graph = StateGraph(MessagesState)
        graph.add_node("broken", broken)
        graph.add_edge(START, "broken")
        graph.compile().invoke({"messages": [HumanMessage("hi")]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, failing, [{"question": "x"}])
    assert row.status == "failed"
    node = next(s for s in of_kind(spans, "agent") if s.attributes[semconv.AGENT_NAME] == "broken")
    assert node.status == "error" and node.attributes[semconv.ERROR_TYPE] == "RuntimeError"
    assert of_kind(spans, "chain")[0].status == "error"


def test_interrupt_and_resume_are_not_errors(fake_openai, instrumented, sink, caplog):
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.types import Command, interrupt

    def ask(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [HumanMessage(f"approved: {interrupt('approve?')}")]}

    graph = StateGraph(MessagesState)
    graph.add_node("ask", ask)
    graph.add_edge(START, "ask")
    app = graph.compile(checkpointer=MemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    errors_before = internal_error_count()
    with agl.rollout_scope("ro-interrupt", "at-1"):
        app.invoke({"messages": [HumanMessage("go")]}, config)
        out = app.invoke(Command(resume="yes"), config)
    assert out["messages"][-1].content == "approved: yes"
    asks = [s for s in of_kind(sink.of("ro-interrupt"), "agent") if s.attributes[semconv.AGENT_NAME] == "ask"]
    assert len(asks) == 2 and all(s.status != "error" for s in asks)  # paused, then resumed
    assert internal_error_count() == errors_before
    assert "AglCallbackHandler" not in caplog.text  # LangChain logs handler failures, e.g. a missing on_interrupt


@tool
def book_hotel(city: str) -> str:
    """Book a hotel (a human approves it first)."""
    from langgraph.types import interrupt

    return f"booked in {city}" if interrupt(f"book a hotel in {city}?") == "yes" else "cancelled"


def test_an_interrupt_in_a_tool_is_not_a_failed_tool(fake_openai, instrumented, sink):
    """LangGraph's human-approval pattern: ``interrupt()`` inside a tool pauses the graph, and the tool runs
    again on resume. The paused run is control flow, not a tool failure that AIR would penalise."""
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.types import Command

    fake_openai.script(
        FakeReply(tool_calls=[{"name": "book_hotel", "arguments": {"city": "Paris"}}]), FakeReply(content="done")
    )
    app = create_react_agent(model(fake_openai.base_url), [book_hotel], checkpointer=MemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    with agl.rollout_scope("ro-tool-interrupt", "at-1"):
        app.invoke({"messages": [HumanMessage("a hotel in Paris")]}, config)
        out = app.invoke(Command(resume="yes"), config)
    assert out["messages"][-2].content == "booked in Paris"
    spans = sink.of("ro-tool-interrupt")
    paused, resumed = of_kind(spans, "tool")
    assert [paused.status, resumed.status] == ["unset", "unset"]
    assert semconv.ERROR_TYPE not in paused.attributes
    assert resumed.attributes[semconv.TOOL_CALL_RESULT] == "booked in Paris"
    assert air_per_call(spans) == [{}, {}]


def test_agl_operation_decorated_nodes_run_as_langgraph_nodes(fake_openai, instrumented, sink):
    """``@agl.operation`` keeps an async node a coroutine function (LangGraph awaits it; before, the graph
    failed on the coroutine the node returned) and a sync node a plain one. The spans agl opens inside a
    node (the operation, an ``@agl.tool`` call) nest under that node, though LangGraph never makes it
    current; the LLM call carries the operation's id, and the tool is credited to the call before it."""

    @agl.tool
    def count_words(text: str) -> int:
        return len(text.split())

    @agl.operation
    async def draft(state: MessagesState) -> Dict[str, Any]:
        reply = await model(fake_openai.base_url).ainvoke(state["messages"])
        count_words(reply.content)
        return {"messages": [reply]}

    @agl.operation("polish")
    def polish(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [HumanMessage(state["messages"][-1].content.upper())]}

    graph = StateGraph(MessagesState)
    graph.add_node("draft", draft)
    graph.add_node("polish", polish)
    graph.add_edge(START, "draft")
    graph.add_edge("draft", "polish")
    graph.add_edge("polish", END)
    fake_openai.script(FakeReply(content="a slogan"))
    with agl.rollout_scope("ro-operations", "at-1"):
        out = asyncio.run(graph.compile().ainvoke({"messages": [HumanMessage("write")]}))
    assert out["messages"][-1].content == "A SLOGAN"
    spans = sink.of("ro-operations")
    operations = {s.attributes[semconv.OPERATION]: s for s in spans if s.name == semconv.SPAN_OPERATION}
    assert sorted(operations) == ["draft", "polish"]
    assert {name: agent_of(span, spans) for name, span in operations.items()} == {"draft": "draft", "polish": "polish"}
    (llm,) = of_kind(spans, "llm")
    (tool_span,) = of_kind(spans, "tool")
    assert agent_of(llm, spans) == agent_of(tool_span, spans) == "draft"
    assert tool_span.parent_id == operations["draft"].span_id
    assert llm.attributes[semconv.OPERATION_SPAN_ID] == operations["draft"].span_id
    assert CallLinks(build_tree(spans)).caller_of_tool(tool_span) == llm.span_id
    assert_one_tree(spans)


# -- named agents: create_agent(name=...) (LangChain 1.x) and AgentExecutor (LangChain 0.3) ----------------------
def test_named_create_agents_own_their_llm_calls(tmp_path, fake_openai, instrumented):
    create_agent = langchain_create_agent()

    @agl.rollout
    def team(task, llm):
        researcher = create_agent(model(llm.get_base_url()), [add], name="researcher")
        writer = create_agent(model(llm.get_base_url()), [], name="writer")

        def research(state: MessagesState) -> Dict[str, Any]:
            return {"messages": researcher.invoke({"messages": state["messages"]})["messages"][-1:]}

        def write(state: MessagesState) -> Dict[str, Any]:
            return {"messages": writer.invoke({"messages": [HumanMessage("write it up")]})["messages"][-1:]}

        graph = StateGraph(MessagesState)
        graph.add_node("research", research)
        graph.add_node("write", write)
        graph.add_edge(START, "research")
        graph.add_edge("research", "write")
        graph.compile().invoke({"messages": [HumanMessage(task["question"])]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, team, [{"question": "What is 2 plus 2?"}])
    assert row.status == "succeeded", row.error
    assert [last_input_text(s) for s in select_llm_calls(spans, "^researcher$")] == ["What is 2 plus 2?", "4.0"]
    assert [last_input_text(s) for s in select_llm_calls(spans, "^writer$")] == ["write it up"]
    assert select_llm_calls(spans, "^model$") == []  # create_agent's own nodes are chain spans
    (tool_span,) = of_kind(spans, "tool")
    assert agent_of(tool_span, spans) == "researcher"
    assert {s.name for s in of_kind(spans, "chain")} >= {"LangGraph", "model", "tools"}


def test_agent_executor_is_an_agent_named_by_its_run_name(tmp_path, fake_openai, instrumented):
    agents_module = pytest.importorskip("langchain.agents")
    if not hasattr(agents_module, "AgentExecutor"):
        pytest.skip("AgentExecutor moved to langchain-classic in langchain 1.0")
    from langchain_core.prompts import ChatPromptTemplate

    @agl.rollout
    def classic(task, llm):
        prompt = ChatPromptTemplate.from_messages([("human", "{input}"), ("placeholder", "{agent_scratchpad}")])
        chat = model(llm.get_base_url())
        agent = agents_module.create_tool_calling_agent(chat, [add], prompt)
        executor = agents_module.AgentExecutor(agent=agent, tools=[add]).with_config(run_name="solver")
        executor.invoke({"input": task["question"]})

    ((row, spans),) = run_dev(tmp_path, fake_openai, classic, [{"question": "What is 3 plus 3?"}])
    assert row.status == "succeeded", row.error
    assert len(select_llm_calls(spans, "^solver$")) == len(generation_requests(fake_openai)) == 2
    (tool_span,) = of_kind(spans, "tool")
    assert agent_of(tool_span, spans) == "solver" and tool_span.attributes[semconv.TOOL_CALL_RESULT] == 6.0


# -- nodes that are chains: LangGraph runs the steps after the first outside the node's Runnable config ----------
def chain_nodes_graph(base_url: str) -> Any:
    """``writer`` is ``prompt | model``, ``critic`` is ``prompt | model | lambda``: LangGraph flattens either
    chain into the node's own sequence, so the model is a step of the node's run, not of a chain of its own."""
    from langchain_core.prompts import ChatPromptTemplate

    llm = model(base_url)

    def prompt(system: str) -> Any:
        return ChatPromptTemplate.from_messages([("system", system), ("placeholder", "{messages}")])

    graph = StateGraph(MessagesState)
    graph.add_node("writer", prompt("write") | llm)
    graph.add_node("critic", prompt("critique") | llm | (lambda message: {"messages": [message]}))
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "critic")
    graph.add_edge("critic", END)
    return graph.compile()


@pytest.mark.parametrize("nested", [False, True], ids=["top", "in_a_node_function"])
@pytest.mark.parametrize("mode", ["invoke", "ainvoke", "stream"])
def test_the_model_of_a_chain_node_is_the_nodes_call(fake_openai, instrumented, sink, mode, nested):
    """The model inside ``add_node("writer", prompt | model)`` runs with no Runnable config naming the node
    (or, when the graph runs inside another graph's node function, with that outer node's): its llm span
    must still nest under the node's agent span, or ``agent_match="^writer$"`` selects nothing."""
    app = inner = chain_nodes_graph(fake_openai.base_url)
    if nested:

        def run_inner(state: MessagesState) -> Any:
            return inner.invoke(state)

        async def arun_inner(state: MessagesState) -> Any:
            return await inner.ainvoke(state)

        outer = StateGraph(MessagesState)
        outer.add_node("outer", RunnableLambda(run_inner, afunc=arun_inner))
        outer.add_edge(START, "outer")
        outer.add_edge("outer", END)
        app = outer.compile()
    state = {"messages": [HumanMessage("a haiku about spans")]}
    rollout_id = f"ro-chain-node-{uuid.uuid4().hex[:6]}"
    with agl.rollout_scope(rollout_id, "at-1"), agl.operation("run"):
        if mode == "invoke":
            app.invoke(state)
        elif mode == "ainvoke":
            asyncio.run(app.ainvoke(state))
        else:
            assert list(app.stream(state, stream_mode="messages"))
    spans = sink.of(rollout_id)
    calls = of_kind(spans, "llm")
    assert len(calls) == len(generation_requests(fake_openai)) == 2
    assert [agent_of(s, spans) for s in calls] == ["writer", "critic"]
    assert [json.loads(s.attributes[semconv.INPUT_MESSAGES])[0]["content"] for s in calls] == ["write", "critique"]
    assert [s.attributes[semconv.LLM_STREAM] for s in calls] == [mode == "stream"] * 2
    assert [last_input_text(s) for s in select_llm_calls(spans, "^writer$")] == ["a haiku about spans"]
    assert_one_tree(spans)
    assert instrumented._handler is not None and instrumented._handler._runs == {}


# -- the functional API: @task functions are agents, like nodes ----------------------------------------------------
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
def test_functional_api_tasks_are_agents_named_after_the_task(fake_openai, instrumented, sink, mode):
    """A ``@task`` runs under the callbacks of the code that called it, so its run is tagged ``seq:step:1``
    like a step of any LCEL sequence: it is still an agent, named after the task, and the sequence inside
    ``critique`` (whose steps carry ``seq:step:N`` tags too) is not."""
    from langchain_core.prompts import ChatPromptTemplate
    from langgraph.checkpoint.memory import MemorySaver
    from langgraph.func import entrypoint, task

    llm = model(fake_openai.base_url)
    critic = ChatPromptTemplate.from_messages([("human", "critique: {essay}")]) | llm | (lambda m: m.content)

    @task
    def write_essay(topic: str) -> str:
        return llm.invoke(f"essay about {topic}").content

    @task
    async def critique(essay: str) -> str:
        return await critic.ainvoke({"essay": essay})

    @entrypoint(checkpointer=MemorySaver())
    async def workflow(topic: str) -> str:
        essay = await write_essay(topic)
        return await critique(essay)

    @task
    def critique_sync(essay: str) -> str:
        return critic.invoke({"essay": essay})

    @entrypoint(checkpointer=MemorySaver())
    def workflow_sync(topic: str) -> str:
        return critique_sync(write_essay(topic).result()).result()

    config = {"configurable": {"thread_id": "t1"}}
    rollout_id = f"ro-functional-{mode}"
    with agl.rollout_scope(rollout_id, "at-1"):
        if mode == "invoke":
            workflow_sync.invoke("cats", config)
        else:
            asyncio.run(workflow.ainvoke("cats", config))
    spans = sink.of(rollout_id)
    entry, critic_task = ("workflow_sync", "critique_sync") if mode == "invoke" else ("workflow", "critique")
    assert [s.attributes[semconv.AGENT_NAME] for s in of_kind(spans, "agent")] == [entry, "write_essay", critic_task]
    assert [last_input_text(s) for s in select_llm_calls(spans, "^write_essay$")] == ["essay about cats"]
    assert [last_input_text(s) for s in select_llm_calls(spans, f"^{critic_task}$")] == [
        "critique: FAKE: essay about cats"
    ]
    assert select_llm_calls(spans, f"^{entry}$") == []
    assert_one_tree(spans)
    assert instrumented._handler is not None and instrumented._handler._runs == {}


def chain_of_two_nodes(llm: Any, first: tuple[str, str], second: tuple[str, str]) -> Any:
    """START -> first -> second -> END; each node (name, prompt) makes one model call with its prompt."""
    graph = StateGraph(MessagesState)
    for name, prompt in (first, second):
        graph.add_node(name, lambda state, prompt=prompt: {"messages": [llm.invoke(prompt)]})
    graph.add_edge(START, first[0])
    graph.add_edge(first[0], second[0])
    graph.add_edge(second[0], END)
    return graph.compile()


def test_a_node_whose_name_starts_with_underscores_is_an_agent(fake_openai, instrumented, sink):
    """Only LangGraph's own ``__start__`` / ``__end__`` are plumbing; a user's ``__scratch`` node is a node."""
    app = chain_of_two_nodes(model(fake_openai.base_url), ("__scratch", "scratch"), ("answer", "answer"))
    with agl.rollout_scope("ro-dunder", "at-1"):
        app.invoke({"messages": [HumanMessage("go")]})
    spans = sink.of("ro-dunder")
    assert [s.attributes[semconv.AGENT_NAME] for s in of_kind(spans, "agent")] == ["__scratch", "answer"]
    assert [last_input_text(s) for s in select_llm_calls(spans, "^__scratch$")] == ["scratch"]


# -- a caller that stops reading a graph stream: not an agent error ------------------------------------------------
@pytest.mark.parametrize("mode", ["stream", "astream", "astream_events"])
def test_a_caller_leaving_a_graph_stream_early_is_no_error(fake_openai, instrumented, sink, mode):
    """Breaking out of ``stream()`` closes it (``GeneratorExit`` in the graph's run); leaving ``astream()`` or
    ``astream_events()`` also cancels the running node (``CancelledError``). The spans end without error
    status, marked as stopped by the caller, and nothing is left in the handler's table."""
    app = chain_of_two_nodes(
        model(fake_openai.base_url, streaming=True), ("a", "first one two three four"), ("b", "second")
    )
    state = {"messages": [HumanMessage("go")]}

    async def leave_early() -> None:
        if mode == "astream":
            async for _ in app.astream(state, stream_mode="messages"):
                break
        else:
            async for event in app.astream_events(state, version="v2"):
                if event["event"] == "on_chat_model_stream":
                    break

    rollout_id = f"ro-leave-{mode}"
    with agl.rollout_scope(rollout_id, "at-1"):
        if mode == "stream":
            for _ in app.stream(state, stream_mode="messages"):
                break
        else:
            asyncio.run(leave_early())
    spans = sink.of(rollout_id)
    assert [s.status for s in spans if s.status == "error"] == []
    (root,) = of_kind(spans, "chain")
    assert root.attributes[semconv.SPAN_STOPPED] is True
    (node,) = of_kind(spans, "agent")
    assert node.attributes[semconv.AGENT_NAME] == "a"
    # Whether the node was still running when the consumer left is a race (its short answer may be complete,
    # in astream's node task too): stopped or finished, it has no error status (asserted above).
    assert node.attributes.get(semconv.SPAN_STOPPED) in (True, None)
    assert instrumented._handler is not None and instrumented._handler._runs == {}
    assert instrumented._handler._failed_tools == {}


def test_runs_that_get_no_end_event_end_as_stopped_with_the_run_they_ran_in(fake_openai, instrumented, sink):
    """The event order LangChain delivered when ``asyncio.run`` ended a graph whose ``astream()`` its caller had
    left (seen in CI, 1 run in ~100): the node's end event waited in the task ``shielded`` made for it, which
    ``asyncio.run`` cancelled before it ran, so the graph's run ended (``GeneratorExit``) and the node's never
    did. Its span then stayed open (stored only when the rollout ended) and its run in the table for good.
    Driven here through LangChain's own callback managers, in that order; a late end event is ignored."""
    with agl.rollout_scope("ro-orphans", "at-1"):
        graph = CallbackManager(handlers=[]).on_chain_start(None, {"messages": []}, name="LangGraph")
        node_manager = graph.get_child("graph:step:1")
        node_manager.add_metadata({"langgraph_node": "a", "langgraph_step": 1})  # children inherit it
        node = node_manager.on_chain_start(None, {}, name="a")
        step = node.get_child("seq:step:1").on_chain_start(None, {}, name="a")
        tool = step.get_child().on_tool_start({"name": "add"}, "{}", inputs={"a": 1, "b": 2})
        graph.on_chain_error(GeneratorExit())
        node.on_chain_end({"messages": []})  # late: the span has ended already
    spans = sink.of("ro-orphans")
    assert [(s.kind, s.name, s.status) for s in spans] == [
        ("chain", "LangGraph", "unset"),
        ("agent", "invoke_agent a", "unset"),
        ("tool", "execute_tool add", "unset"),
    ]
    assert all(s.attributes[semconv.SPAN_STOPPED] is True for s in spans)
    assert spans[2].end_time <= spans[1].end_time <= spans[0].end_time  # the innermost first
    assert instrumented._handler is not None and instrumented._handler._runs == {}
    assert instrumented._handler._children == {}
    del tool


def test_model_calls_cancelled_by_a_timeout_leave_nothing_in_the_handlers_table(fake_openai, instrumented, sink):
    """``asyncio.wait_for`` around ``ainvoke`` cancels the model call: LangChain then sends no end event for
    the model's run (only the chains around it get one), and each timeout left that run in the table."""
    fake_openai.script(*[FakeReply(content="too late", delay=1.0) for _ in range(3)])
    agent = create_react_agent(model(fake_openai.base_url), [add])

    async def time_out_three_times() -> None:
        for _ in range(3):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(agent.ainvoke({"messages": [HumanMessage("go")]}), 0.2)

    with agl.rollout_scope("ro-timeouts", "at-1"):
        asyncio.run(time_out_three_times())
    assert len(of_kind(sink.of("ro-timeouts"), "llm")) == 3
    assert instrumented._handler is not None and instrumented._handler._runs == {}
    assert instrumented._handler._children == {}


# -- concurrency: rollouts in threads and asyncio tasks, LangGraph's own thread pool ----------------------------
def fan_out_graph(base_url: str) -> Any:
    """Two LLM nodes in the same step: sync LangGraph runs them on its own thread pool."""
    llm = model(base_url)

    def node(prefix: str) -> Any:
        def call(state: MessagesState) -> Dict[str, Any]:
            return {"messages": [llm.invoke(f"{prefix}: {state['messages'][0].content}")]}

        async def acall(state: MessagesState) -> Dict[str, Any]:
            return {"messages": [await llm.ainvoke(f"{prefix}: {state['messages'][0].content}")]}

        return RunnableLambda(call, afunc=acall)

    graph = StateGraph(MessagesState)
    graph.add_node("left", node("left"))
    graph.add_node("right", node("right"))
    graph.add_edge(START, "left")
    graph.add_edge(START, "right")
    return graph.compile()


def assert_rollout_isolated(spans: Sequence[Span], question: str) -> None:
    llm_spans = of_kind(spans, "llm")
    assert sorted(last_input_text(s) for s in llm_spans) == [f"left: {question}", f"right: {question}"]
    for span in llm_spans:
        assert agent_of(span, spans) == last_input_text(span).split(":")[0]  # its own node, in its rollout
    assert_one_tree(spans)


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
def test_structured_output_calls_are_llm_spans_of_their_node(fake_openai, instrumented, sink, mode):
    """``with_structured_output(method="json_schema")`` goes through ``beta.chat.completions.parse``, not
    ``create``: before openai 1.92 a class of its own (the oldest line runs it), since then the plain one."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    structured = model(fake_openai.base_url).with_structured_output(Answer, method="json_schema")

    def solve(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [HumanMessage(str(structured.invoke(state["messages"]).value))]}

    async def asolve(state: MessagesState) -> Dict[str, Any]:
        return {"messages": [HumanMessage(str((await structured.ainvoke(state["messages"])).value))]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve if mode == "invoke" else asolve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    app = graph.compile()
    fake_openai.script(FakeReply(content='{"value": 42}'))
    rollout_id = f"ro-structured-{uuid.uuid4().hex[:6]}"
    with agl.rollout_scope(rollout_id, "at-1"), agl.operation("run"):
        message = {"messages": [HumanMessage("what is 6 x 7?")]}
        result = app.invoke(message) if mode == "invoke" else asyncio.run(app.ainvoke(message))
    assert result["messages"][-1].content == "42"
    spans = sink.of(rollout_id)
    (llm,) = of_kind(spans, "llm")
    assert agent_of(llm, spans) == "solve"
    assert llm.attributes[semconv.RESPONSE_TOKEN_IDS] and llm.attributes[semconv.PROMPT_TOKEN_IDS]
    assert len(generation_requests(fake_openai)) == 1


@pytest.mark.parametrize("mode", ["invoke", "stream"])
def test_text_completion_llm_calls_are_llm_spans_of_their_node(fake_openai, instrumented, sink, mode):
    """LangChain's ``OpenAI`` LLM (not ``ChatOpenAI``) calls the legacy ``completions.create`` with a prompt."""
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=fake_openai.base_url, api_key="x", model="fake-model", max_retries=0)

    def draft(state: MessagesState) -> Dict[str, Any]:
        prompt = f"Q: {state['messages'][-1].content}\nA:"
        text = llm.invoke(prompt) if mode == "invoke" else "".join(llm.stream(prompt))
        return {"messages": [HumanMessage(text)]}

    graph = StateGraph(MessagesState)
    graph.add_node("draft", draft)
    graph.add_edge(START, "draft")
    graph.add_edge("draft", END)
    fake_openai.script(FakeReply(content="forty two"))
    rollout_id = f"ro-text-{uuid.uuid4().hex[:6]}"
    with agl.rollout_scope(rollout_id, "at-1"), agl.operation("run"):
        result = graph.compile().invoke({"messages": [HumanMessage("what is 6 x 7?")]})
    assert result["messages"][-1].content == "forty two"
    spans = sink.of(rollout_id)
    (llm_span,) = of_kind(spans, "llm")
    assert agent_of(llm_span, spans) == "draft"
    assert llm_span.attributes[semconv.LLM_API] == "completions"
    assert llm_span.attributes[semconv.LLM_PROMPT] == "Q: what is 6 x 7?\nA:"
    assert llm_span.attributes[semconv.PROMPT_TOKEN_IDS] == list(b"Q: what is 6 x 7?\nA:")
    assert llm_span.attributes[semconv.RESPONSE_TOKEN_IDS] == list(b"forty two")
    assert llm_span.attributes[semconv.LLM_STREAM] is (mode == "stream")
    (request,) = [r for r in fake_openai.requests if r["path"].endswith("/completions")]
    assert request["body"]["return_token_ids"] is True


def test_concurrent_rollouts_in_threads_keep_their_spans(fake_openai, instrumented, sink):
    fake_openai.script(*[FakeReply(delay=0.2) for _ in range(4)])  # the two rollouts overlap
    graph = fan_out_graph(fake_openai.base_url)
    ids = [f"ro-thread-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = []
        for rollout_id in ids:
            with agl.rollout_scope(rollout_id, "at-1"), agl.operation("run"):
                # agl.submit copies the rollout into the worker thread, as users hand work to their pools
                futures.append(agl.submit(pool, graph.invoke, {"messages": [HumanMessage(rollout_id)]}))
        for future in futures:
            future.result()
    for rollout_id in ids:
        assert_rollout_isolated(sink.of(rollout_id), rollout_id)


def test_concurrent_rollouts_in_asyncio_tasks_keep_their_spans(fake_openai, instrumented, sink):
    fake_openai.script(*[FakeReply(delay=0.2) for _ in range(4)])
    graph = fan_out_graph(fake_openai.base_url)

    async def rollout(rollout_id: str) -> None:
        with agl.rollout_scope(rollout_id, "at-1"), agl.operation("run"):
            await graph.ainvoke({"messages": [HumanMessage(rollout_id)]})

    async def main(ids: List[str]) -> None:
        await asyncio.gather(*(rollout(i) for i in ids))

    ids = [f"ro-async-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    asyncio.run(main(ids))
    for rollout_id in ids:
        assert_rollout_isolated(sink.of(rollout_id), rollout_id)


def test_agent_spans_opened_inside_a_node_own_their_calls(fake_openai, instrumented, sink):
    """Inside a node, an agent span of another adapter (or ``agent_span``) owns the LLM calls made in it;
    a plain span (``agl.operation``) does not take a call away from its node."""
    from agl.instrumentation.framework import agent_span

    llm = model(fake_openai.base_url)

    def plan(state: MessagesState) -> Dict[str, Any]:
        with agl.operation("inner_step"):
            first = llm.invoke("plan it")
        with agent_span("critic", "custom"):
            second = llm.invoke("critique it")
        return {"messages": [first, second]}

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_edge(START, "plan")
    with agl.rollout_scope("ro-inner", "at-1"):
        graph.compile().invoke({"messages": [HumanMessage("go")]})
    spans = sink.of("ro-inner")
    assert [last_input_text(s) for s in select_llm_calls(spans, "^plan$")] == ["plan it"]
    assert [last_input_text(s) for s in select_llm_calls(spans, "^critic$")] == ["critique it"]


def test_retriever_failed_call_and_direct_tool_runs_stay_in_their_node(fake_openai, instrumented, sink):
    """Runs that make no span of their own still keep the node's calls together: a retriever that calls a
    model (query rewriting), a model call the server refuses (the node catches the error) and a tool invoked
    directly (no tool call: its output is the raw value, not a ToolMessage). Every llm span belongs to the
    node, the refused one is an error, the tool's result is recorded, and no run is left in the handler's
    table once the graph is done."""
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    llm = model(fake_openai.base_url)

    class RewritingRetriever(BaseRetriever):
        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> List[Document]:
            rewritten = llm.invoke(f"rewrite: {query}", config={"callbacks": run_manager.get_child()})
            return [Document(page_content=rewritten.content)]

    refused: List[BaseException] = []

    def research(state: MessagesState) -> Dict[str, Any]:
        (doc,) = RewritingRetriever().invoke(state["messages"][-1].content)
        try:
            llm.invoke("this call fails")
        except openai.InternalServerError as exc:
            refused.append(exc)
        total = add.invoke({"a": 1, "b": 2})
        return {"messages": [llm.invoke(f"answer from {doc.page_content} and {total}")]}

    graph = StateGraph(MessagesState)
    graph.add_node("research", research)
    graph.add_edge(START, "research")
    fake_openai.script(
        FakeReply(content="better query"),
        FakeReply(status_code=500, error_message="overloaded"),
        FakeReply(content="3"),
    )
    with agl.rollout_scope("ro-retriever", "at-1"):
        result = graph.compile().invoke({"messages": [HumanMessage("one plus two?")]})
    assert result["messages"][-1].content == "3" and len(refused) == 1
    spans = sink.of("ro-retriever")
    assert_one_tree(spans)
    calls = of_kind(spans, "llm")
    assert [last_input_text(s) for s in calls] == [
        "rewrite: one plus two?",
        "this call fails",
        "answer from better query and 3.0",
    ]
    assert [agent_of(s, spans) for s in calls] == ["research"] * 3
    assert [s.status == "error" for s in calls] == [False, True, False]
    (tool_span,) = of_kind(spans, "tool")
    assert tool_span.attributes[semconv.TOOL_NAME] == "add"
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == 3.0  # a number stays a number (docs/semconv.md)
    assert semconv.TOOL_CALL_ID not in tool_span.attributes
    assert agent_of(tool_span, spans) == "research"
    assert instrumented._handler is not None and instrumented._handler._runs == {}


# -- instrumentor contract: idempotent, exact uninstrument, never raises ----------------------------------------
class Recorder(BaseCallbackHandler):
    """A user's own handler: must see every run whether agl is on or off."""

    def __init__(self) -> None:
        self.chains = 0

    def on_chain_start(self, *args: Any, **kwargs: Any) -> None:
        self.chains += 1


def _run_graph(base_url: str, rollout_id: str, callbacks: Optional[List[Any]] = None) -> None:
    config = {"callbacks": callbacks} if callbacks is not None else {}
    with agl.rollout_scope(rollout_id, "at-1"):
        two_node_graph(base_url).invoke({"messages": [HumanMessage("What is 1 plus 2?")]}, config)


def test_instrumenting_twice_equals_once(fake_openai, sink):
    agl.instrumentation.uninstrument()
    openai_inst, langchain_inst = OpenAIInstrumentor(), LangChainInstrumentor()
    try:
        assert openai_inst.instrument() and langchain_inst.instrument()
        _run_graph(fake_openai.base_url, "ro-once")
        assert langchain_inst.instrument() and openai_inst.instrument()
        _run_graph(fake_openai.base_url, "ro-twice")
        manager = CallbackManager(handlers=[])
        derived = [manager, manager.copy(), CallbackManager.configure(manager), manager.merge(manager)]
        for each in derived:  # child managers copy their parent's handlers: still exactly one agl handler
            assert [isinstance(h, AglCallbackHandler) for h in each.handlers] == [True]
            assert [isinstance(h, AglCallbackHandler) for h in each.inheritable_handlers] == [True]
    finally:
        langchain_inst.uninstrument()
        openai_inst.uninstrument()
    once, twice = sink.of("ro-once"), sink.of("ro-twice")
    assert len(once) == len(twice) == 9  # graph chain, 4 node agents, 1 tool, 3 llm
    assert [(s.kind, s.name) for s in once] == [(s.kind, s.name) for s in twice]


def test_uninstrument_restores_langchain_exactly(fake_openai, sink):
    agl.instrumentation.uninstrument()
    original_init = BaseCallbackManager.__dict__["__init__"]
    resolvers_before = list(context_keys._resolvers)
    openai_inst, langchain_inst = OpenAIInstrumentor(), LangChainInstrumentor()
    user_handler = Recorder()
    user_list = [user_handler]
    assert openai_inst.instrument() and langchain_inst.instrument()
    try:
        assert BaseCallbackManager.__dict__["__init__"] is not original_init
        kept = BaseCallbackManager(handlers=user_list, inheritable_handlers=user_list)  # built while hooked
        assert user_list == [user_handler]  # the caller's list is not mutated
        _run_graph(fake_openai.base_url, "ro-on", [user_handler])
        seen_on = user_handler.chains
        assert seen_on > 0 and len(sink.of("ro-on")) == 9
    finally:
        langchain_inst.uninstrument()
    try:
        assert BaseCallbackManager.__dict__["__init__"] is original_init
        assert context_keys._resolvers == resolvers_before
        assert BaseCallbackManager(handlers=[]).handlers == []
        _run_graph(fake_openai.base_url, "ro-off", [user_handler])
        assert user_handler.chains == 2 * seen_on  # the user's handler saw the same runs again
        # only the OpenAI layer's spans remain, parented by ambient context, with no LangChain spans
        assert [s.kind for s in sink.of("ro-off")] == ["llm", "llm", "llm"]
        # a manager built while hooked still holds agl's handler, but it is inert now
        (stale,) = [h for h in kept.handlers if isinstance(h, AglCallbackHandler)]
        stale.on_chain_start(None, {}, run_id=uuid.uuid4(), name="x")
        assert not stale._runs
    finally:
        openai_inst.uninstrument()


def test_a_model_called_before_instrumenting_is_traced_once_the_trainer_instruments(tmp_path, fake_openai):
    """A notebook's order: build the model, try it once, then trainer.dev (which instruments: no
    agl.instrument() line, as in Agent Lightning code). ChatOpenAI calls through the SDK's cached
    with_raw_response view, bound at the warm-up to the unhooked create: every call went unrecorded."""
    agl.instrumentation.uninstrument()
    llm = model(fake_openai.base_url)
    llm.invoke("warm up")

    @agl.rollout
    def agent(task: Dict[str, Any]) -> None:
        llm.invoke(task["question"])
        agl.emit_reward(1.0)

    ((row, spans),) = run_dev(tmp_path, fake_openai, agent, [{"question": "What is 2 + 3?"}])
    assert row.llm_calls == 1
    (span,) = of_kind(spans, "llm")
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]
    llm.invoke("after the run")  # the Trainer unhooked after dev: no token ids asked for outside it
    assert [r["body"].get("return_token_ids") for r in generation_requests(fake_openai)] == [None, True, None]


def test_out_of_range_version_warns_and_does_nothing(caplog):
    class Future(LangChainInstrumentor):
        instruments = ("langchain-core>=99",)

    original_init = BaseCallbackManager.__dict__["__init__"]
    assert Future().instrument() is False
    assert BaseCallbackManager.__dict__["__init__"] is original_init
    assert "outside the supported range" in caplog.text


def test_agl_instrument_finds_the_adapter_by_entry_point(fake_openai, sink):
    agl.instrumentation.uninstrument()
    try:
        assert "langchain" in agl.instrument(["langchain"])
        _run_graph(fake_openai.base_url, "ro-entry")
    finally:
        agl.uninstrument()
    assert {s.kind for s in sink.of("ro-entry")} == {"chain", "agent", "tool", "llm"}


def test_an_error_inside_the_adapter_never_reaches_the_agent(fake_openai, instrumented, sink, monkeypatch):
    from agl.integrations.langchain import _handler

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("adapter bug")

    monkeypatch.setattr(_handler, "start_agent_span", broken)
    before = internal_error_count("langchain.on_chain_start")
    with agl.rollout_scope("ro-broken", "at-1"):
        out = two_node_graph(fake_openai.base_url).invoke({"messages": [HumanMessage("What is 1 plus 2?")]})
    assert out["messages"][-1].content == "FAKE: rewrite the query"
    assert internal_error_count("langchain.on_chain_start") - before == 4  # one per node run
    assert len(of_kind(sink.of("ro-broken"), "llm")) == 3  # the calls are still traced


def test_the_example_runs_as_its_docstring_says(dev_example) -> None:
    dev_example("langgraph_agent.py:langgraph_calc_agent", "^(solve|check)$")


# -- thread runners share one event loop for async rollouts (agl.runtime.agent_loops) ---------------------------------
_BASE_URL: Dict[str, str] = {}


@agl.rollout
async def _chat_openai_per_rollout(task: dict) -> float:
    model = ChatOpenAI(model="fake", base_url=_BASE_URL["url"], api_key="x")  # langchain-openai shares its httpx client
    return float(bool((await model.ainvoke(task["question"])).content))


def test_chat_openai_in_async_rollouts_of_concurrent_thread_runners(tmp_path, fake_openai, instrumented) -> None:
    """Each thread runner ran its async rollouts on an event loop of its own, and langchain-openai caches one
    httpx.AsyncClient per process even for a ChatOpenAI built per rollout: its pool's asyncio locks were bound
    to one runner's loop, and other runners' rollouts failed at random ("... is bound to a different event
    loop": 1 of 8 in the async-frameworks probe, 3 of 6 inside a LangGraph graph)."""
    _BASE_URL["url"] = fake_openai.base_url
    fake_openai.script(*[FakeReply(delay=0.1 * (i % 4)) for i in range(16)])  # the rollouts overlap
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(store=store, n_runners=4, runner_mode="thread", progress=False)
    rows = trainer.dev(
        _chat_openai_per_rollout, [{"question": f"What is {i} plus 2?"} for i in range(16)], print_table=False
    )
    assert [(r.status, r.error) for r in rows] == [("succeeded", None)] * 16
    assert len({rollout.attempt.runner_id for rollout in store.query_rollouts()}) > 1, "the runners took turns"
    for row in rows:
        (llm,) = [s for s in store.query_spans(row.rollout_id) if s.kind == "llm"]
        assert llm.attributes[semconv.PROMPT_TOKEN_IDS] and llm.attributes[semconv.RESPONSE_TOKEN_IDS]
