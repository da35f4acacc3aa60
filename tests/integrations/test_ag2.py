"""AG2 adapter: real AG2 (1.x ``import ag2`` or classic ``import autogen``, whichever line is installed: the
two share the ``ag2`` distribution name), the real ``openai`` client and agl's fake OpenAI server; spans are
read from a real store after real rollouts."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Dict, Iterator, List, Optional

import pytest

try:
    importlib.metadata.version("ag2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("ag2 is not installed", allow_module_level=True)

from agl.instrumentation.base import requirement_problem

CLASSIC = requirement_problem("ag2<1") is None
pytest.importorskip("autogen" if CLASSIC else "ag2")

import agl
from agl import semconv
from agl._util.safety import internal_error_count
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.integrations.ag2 import AG2Instrumentor
from agl.lightningrl.agent_match import select_llm_calls
from agl.lightningrl.air import AIRConfig, air_rewards
from agl.lightningrl.links import CallLinks
from agl.lightningrl.tree import build_tree
from agl.store import SqliteLightningStore
from agl.testing import FakeReply, assert_tool_reward_credited
from agl.tracing.context import rollout_scope
from agl.types import Span

pytestmark = pytest.mark.framework("ag2")

QUESTION = "What is 2 plus 3?"


# -- shared fixtures and span helpers ----------------------------------------------------------------------
@pytest.fixture
def ag2_instrumentor() -> Iterator[AG2Instrumentor]:
    """The OpenAI layer (llm spans) and a fresh AG2 instrumentor; both undone afterwards."""
    agl.uninstrument()  # a test elsewhere may have left agl.instrument() on
    openai_layer = OpenAIInstrumentor()
    assert openai_layer.instrument()
    inst = AG2Instrumentor()
    assert inst.instrument()
    yield inst
    inst.uninstrument()
    openai_layer.uninstrument()


def dev(agent: Any, tasks: List[Dict[str, Any]], fake_openai: Any, tmp_path: Any) -> Dict[str, List[Span]]:
    """Run ``tasks`` through ``Trainer.dev`` (thread runners, SQLite store): task id -> its spans."""
    trainer = agl.Trainer(
        store=str(tmp_path / "ag2.db"),
        runner_mode="thread",
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake-model")},
        progress=False,
    )
    rows = trainer.dev(agent, tasks, print_table=False)
    assert [r.status for r in rows] == ["succeeded"] * len(tasks)
    store = SqliteLightningStore(tmp_path / "ag2.db")
    try:
        return {r.task_id: store.query_spans(r.rollout_id) for r in rows}
    finally:
        store.close()


def of_kind(spans: List[Span], kind: str) -> List[Span]:
    return sorted((s for s in spans if s.kind == kind), key=lambda s: s.sequence_id)


def enclosing_agent(span: Span, spans: List[Span]) -> Optional[str]:
    by_id = {s.span_id: s for s in spans}
    parent = by_id.get(span.parent_id or "")
    while parent is not None and parent.kind != "agent":
        parent = by_id.get(parent.parent_id or "")
    return None if parent is None else parent.attributes[semconv.AGENT_NAME]


def generation_requests(fake_openai: Any) -> List[Dict[str, Any]]:
    return [r for r in fake_openai.requests if r["path"].endswith(("/chat/completions", "/responses"))]


def assert_llm_spans_match_requests(spans: List[Span], requests: List[Dict[str, Any]], api: str, stream: bool) -> None:
    """Exactly one llm span per HTTP request, each with the server's token ids."""
    llm = of_kind(spans, "llm")
    assert len(llm) == len(requests) > 0
    assert all(r["body"].get("stream", False) is stream for r in requests)
    for span in llm:
        assert span.attributes[semconv.LLM_API] == api
        assert span.attributes[semconv.LLM_STREAM] is stream
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]


def tool_messages(request: Dict[str, Any]) -> Dict[str, str]:
    """call id -> the tool result a chat.completions request sent the model."""
    return {m["tool_call_id"]: m["content"] for m in request["body"]["messages"] if m["role"] == "tool"}


def air_per_call(spans: List[Span]) -> List[Dict[str, float]]:
    """AIR's rewards (default weights) for each llm span, in order: what LightningRL would add to each call."""
    calls = [s.span_id for s in of_kind(spans, "llm")]
    rewards = air_rewards(CallLinks(build_tree(spans)), calls, AIRConfig())
    return [rewards.get(call, {}) for call in calls]


def counts(spans: List[Span]) -> Dict[str, int]:
    result: Dict[str, int] = {}
    for span in spans:
        result[span.kind] = result.get(span.kind, 0) + 1
    return result


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def failing_add(a: float, b: float) -> float:
    """Add two numbers."""
    raise ValueError("the adder is broken")


def graded_add(a: float, b: float) -> float:
    """Add two numbers (and grade the call)."""
    agl.emit_reward(0.5)
    return a + b


def run_concurrent_rollouts(
    questions: Dict[str, str], sync_run: Callable[[str], Any], async_run: Callable[[str], Awaitable[Any]]
) -> None:
    """All at once: the first two rollouts on pool threads (``agl.submit`` carries each one's context
    there), the others as asyncio tasks of one loop on this thread."""
    items = list(questions.items())
    threaded, tasked = items[:2], items[2:]
    barrier = threading.Barrier(len(threaded))

    def on_thread(question: str) -> Any:
        barrier.wait(10)
        return sync_run(question)

    async def in_task(rollout_id: str, question: str) -> Any:
        with rollout_scope(rollout_id, "at-1"):
            return await async_run(question)

    async def tasks() -> None:
        await asyncio.gather(*(in_task(rollout_id, question) for rollout_id, question in tasked))

    with ThreadPoolExecutor(len(threaded)) as pool:
        futures = []
        for rollout_id, question in threaded:
            with rollout_scope(rollout_id, "at-1"):
                futures.append(agl.submit(pool, on_thread, question))
        asyncio.run(tasks())
        for future in futures:
            future.result(30)


def four_questions() -> Dict[str, str]:
    """rollout id (ending in n) -> "What is n plus n+10?"."""
    return {f"ro-{uuid.uuid4().hex[:6]}-{n}": f"What is {n} plus {n + 10}?" for n in range(4)}


# ==========================================================================================================
# AG2 1.x: Agent, OpenAIConfig / OpenAIResponsesConfig, await agent.ask(...)
# ==========================================================================================================
if not CLASSIC:
    from ag2 import Agent, TaskConfig
    from ag2.config.openai import OpenAIConfig, OpenAIResponsesConfig
    from ag2.middleware import BaseMiddleware

    def make_config(base_url: str, api: str = "chat.completions", stream: bool = False) -> Any:
        config = OpenAIConfig if api == "chat.completions" else OpenAIResponsesConfig
        return config(model="fake-model", base_url=base_url, api_key="x", streaming=stream)

    async def ask_calculator(base_url: str, question: str = QUESTION, **config: Any) -> str:
        agent = Agent("calculator", "Use the tools.", config=make_config(base_url, **config), tools=[add])
        return (await agent.ask(question)).body or ""

    class TestAG2:
        @pytest.mark.parametrize("api", ["chat.completions", "responses"])
        @pytest.mark.parametrize("stream", [False, True])
        def test_agent_with_tool_in_a_rollout(self, api, stream, fake_openai, ag2_instrumentor, tmp_path):
            @agl.rollout
            async def calc(task, llm):
                answer = await ask_calculator(llm.get_base_url(), task["question"], api=api, stream=stream)
                return 1.0 if "5" in answer else 0.0

            (spans,) = dev(calc, [{"id": "t", "question": QUESTION}], fake_openai, tmp_path).values()
            assert_llm_spans_match_requests(spans, generation_requests(fake_openai), api, stream)
            (agent,) = of_kind(spans, "agent")[1:]  # [0] is the runner's root span
            assert agent.attributes[semconv.AGENT_NAME] == "calculator"
            assert agent.attributes[semconv.FRAMEWORK] == "ag2"
            assert {enclosing_agent(s, spans) for s in of_kind(spans, "llm")} == {"calculator"}
            (tool,) = of_kind(spans, "tool")
            assert enclosing_agent(tool, spans) == "calculator"
            assert tool.attributes[semconv.TOOL_NAME] == "add"
            assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
            assert tool.attributes[semconv.TOOL_CALL_RESULT] == "5.0"
            assert tool.attributes[semconv.TOOL_CALL_ID].startswith("call_")
            assert tool.status != "error"
            (reward,) = of_kind(spans, "reward")
            assert reward.attributes[semconv.REWARD_VALUE] == 1.0

        def test_a_raising_tool_makes_an_error_span(self, fake_openai, ag2_instrumentor, sink):
            agent = Agent("calculator", config=make_config(fake_openai.base_url), tools=[failing_add])
            with rollout_scope("ro-ag2-error", "at-1"):
                reply = asyncio.run(agent.ask(QUESTION))
            assert "the adder is broken" in (reply.body or "")  # AG2 told the model; the run went on
            spans = sink.of("ro-ag2-error")
            (tool,) = of_kind(spans, "tool")
            assert tool.status == "error"
            assert tool.attributes[semconv.ERROR_TYPE] == "ValueError"
            assert "the adder is broken" in (tool.error or "")
            # the result is the text the model read (AG2 sends it the traceback), as in agl's other adapters
            told = tool_messages(generation_requests(fake_openai)[1])[tool.attributes[semconv.TOOL_CALL_ID]]
            assert "the adder is broken" in told and tool.attributes[semconv.TOOL_CALL_RESULT] == told
            assert len(of_kind(spans, "llm")) == 2

        def test_a_reward_emitted_in_a_tool_is_a_step_reward(self, fake_openai, ag2_instrumentor, sink):
            fake_openai.script(
                FakeReply(tool_calls=[{"name": "graded_add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5")
            )
            agent = Agent("calculator", config=make_config(fake_openai.base_url), tools=[graded_add])
            with rollout_scope("ro-ag2-reward", "at-1"):
                asyncio.run(agent.ask(QUESTION))
            assert_tool_reward_credited(sink.of("ro-ag2-reward"), 0.5)

        def test_agent_match_selects_the_calls_of_one_of_two_agents(self, fake_openai, ag2_instrumentor, tmp_path):
            """THE KEY ONE: a planner (no tools) hands over to a calculator (one tool) in one rollout."""

            @agl.rollout
            async def two_agents(task, llm):
                base_url = llm.get_base_url()
                planner = Agent("planner", "Restate the question.", config=make_config(base_url))
                plan = (await planner.ask(task["question"])).body or ""
                assert plan.startswith("FAKE:")
                await ask_calculator(base_url, task["question"])
                return 1.0

            (spans,) = dev(two_agents, [{"id": "t", "question": QUESTION}], fake_openai, tmp_path).values()
            assert len(of_kind(spans, "llm")) == len(generation_requests(fake_openai)) == 3
            planner_calls = select_llm_calls(spans, "^planner$")
            calculator_calls = select_llm_calls(spans, "^calculator$")
            assert len(planner_calls) == 1 and len(calculator_calls) == 2
            assert semconv.TOOL_DEFINITIONS not in planner_calls[0].attributes
            assert all(semconv.TOOL_DEFINITIONS in s.attributes for s in calculator_calls)
            assert select_llm_calls(spans, "^two_agents$") == []  # no call is left to the root agent
            assert {s.span_id for s in planner_calls + calculator_calls} == {s.span_id for s in of_kind(spans, "llm")}

        def test_agent_match_with_a_sub_agent_called_as_a_tool(self, fake_openai, ag2_instrumentor, sink):
            """A delegated agent's calls belong to it (its nearest agent span), not to the agent that called it."""
            adder = Agent("adder", "Use the tools.", config=make_config(fake_openai.base_url), tools=[add])
            boss = Agent(
                "boss",
                "Delegate.",
                config=make_config(fake_openai.base_url),
                tools=[adder.as_tool(description="Adds.")],
            )
            with rollout_scope("ro-ag2-nested", "at-1"):
                assert "5" in (asyncio.run(boss.ask(QUESTION)).body or "")
            spans = sink.of("ro-ag2-nested")
            assert len(of_kind(spans, "llm")) == len(generation_requests(fake_openai)) == 4

            def offered(selected: List[Span]) -> List[List[str]]:
                return [
                    [t["function"]["name"] for t in json.loads(s.attributes[semconv.TOOL_DEFINITIONS])]
                    for s in selected
                ]

            assert offered(select_llm_calls(spans, "^adder$")) == [["add"], ["add"]]
            boss_tool = offered(select_llm_calls(spans, "^boss$"))
            assert len(boss_tool) == 2 and "add" not in boss_tool[0]
            delegation, add_tool = of_kind(spans, "tool")
            assert enclosing_agent(delegation, spans) == "boss" and enclosing_agent(add_tool, spans) == "adder"
            assert delegation.status != "error"  # the sub-agent's turn succeeded

        def test_a_call_of_a_tool_the_agent_lacks_is_an_error_tool_span_that_air_penalises(
            self, fake_openai, ag2_instrumentor, sink
        ):
            """AG2 answers a call of a tool the agent lacks with ``ToolNotFoundError`` from a stream subscriber
            that runs no middleware. The call still gets a failed tool span (as in agl's other adapters), so AIR
            gives its llm call air.tool_error; the tool that did run in the same response keeps its one span."""
            fake_openai.script(
                FakeReply(
                    tool_calls=[
                        {"name": "multiply", "arguments": {"a": 2, "b": 3}},
                        {"name": "add", "arguments": {"a": 2, "b": 3}},
                    ]
                ),
                FakeReply(content="5"),
            )
            agent = Agent("calculator", config=make_config(fake_openai.base_url), tools=[add])
            with rollout_scope("ro-ag2-unknown", "at-1"):
                asyncio.run(agent.ask(QUESTION))
            spans = sink.of("ro-ag2-unknown")
            told = tool_messages(generation_requests(fake_openai)[1])  # what AG2 told the model, per call id
            (missing,) = [s for s in of_kind(spans, "tool") if s.attributes[semconv.TOOL_NAME] == "multiply"]
            (ran,) = [s for s in of_kind(spans, "tool") if s.attributes[semconv.TOOL_NAME] == "add"]
            assert missing.name == "execute_tool multiply"
            assert json.loads(missing.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
            assert missing.status == "error" and missing.attributes[semconv.ERROR_TYPE] == "_OTHER"
            message = told[missing.attributes[semconv.TOOL_CALL_ID]]
            assert "ToolNotFoundError" in message
            assert missing.error == missing.attributes[semconv.TOOL_CALL_RESULT] == message
            assert enclosing_agent(missing, spans) == "calculator"
            assert ran.status != "error" and told[ran.attributes[semconv.TOOL_CALL_ID]] == "5.0"
            assert air_per_call(spans)[0]["air.tool_error"] == AIRConfig().tool_error

        @pytest.mark.parametrize("delegation", ["as_tool", "subtask"])
        def test_a_failed_sub_agent_fails_its_delegation_tool_span(
            self, delegation, fake_openai, ag2_instrumentor, sink
        ):
            """A delegation whose sub-agent fails returns AG2's failure text ("Sub-task 'adder' failed: ..." /
            "Error: ...") as a normal result; AG2 also reports it with ``TaskFailed``, so the delegating tool
            span fails and AIR gives air.tool_error, not air.tool_ok. A tool still running beside it when AG2
            reports the failure (on the stream the two share) stays a success."""

            async def add_slowly(a: float, b: float) -> float:
                """Add two numbers."""
                await asyncio.sleep(0.5)  # still running when the sub-agent's failure is reported
                return a + b

            base_url = fake_openai.base_url
            if delegation == "as_tool":
                adder = Agent("adder", "Use the tools.", config=make_config(base_url), tools=[add])
                tools: List[Any] = [add_slowly, adder.as_tool(description="Adds.")]
                call = {"name": "task_adder", "arguments": {"objective": QUESTION}}
                boss = Agent("boss", "Delegate.", config=make_config(base_url), tools=tools)
            else:
                call = {"name": "run_subtask", "arguments": {"task": QUESTION}}
                boss = Agent("boss", "Delegate.", config=make_config(base_url), tools=[add_slowly], tasks=TaskConfig())
            fake_openai.script(
                FakeReply(tool_calls=[call, {"name": "add_slowly", "arguments": {"a": 2, "b": 3}}]),
                FakeReply(status_code=400, error_message="bad"),  # the sub-agent's only model call
                FakeReply(content="gave up"),
            )
            with rollout_scope("ro-ag2-subfail", "at-1"):
                asyncio.run(boss.ask(QUESTION))
            spans = sink.of("ro-ag2-subfail")
            told = tool_messages(generation_requests(fake_openai)[2])
            (failed,) = [s for s in of_kind(spans, "tool") if s.attributes[semconv.TOOL_NAME] == call["name"]]
            (ran,) = [s for s in of_kind(spans, "tool") if s.attributes[semconv.TOOL_NAME] == "add_slowly"]
            message = told[failed.attributes[semconv.TOOL_CALL_ID]]
            assert "Error code: 400" in message
            assert failed.status == "error" and failed.attributes[semconv.ERROR_TYPE] == "_OTHER"
            assert failed.error == failed.attributes[semconv.TOOL_CALL_RESULT] == message
            assert ran.status != "error" and enclosing_agent(ran, spans) == "boss"
            sub_agent = next(s for s in of_kind(spans, "agent") if s.parent_id == failed.span_id)
            assert sub_agent.status == "error"
            boss_first_call = select_llm_calls(spans, "^boss$")[0].span_id
            boss_rewards = air_per_call(spans)[[s.span_id for s in of_kind(spans, "llm")].index(boss_first_call)]
            assert boss_rewards["air.tool_error"] == AIRConfig().tool_error

        def test_concurrent_rollouts_in_threads_and_tasks_stay_apart(self, fake_openai, ag2_instrumentor, sink):
            questions = four_questions()
            run_concurrent_rollouts(
                questions,
                lambda question: asyncio.run(ask_calculator(fake_openai.base_url, question)),
                lambda question: ask_calculator(fake_openai.base_url, question),
            )
            for rollout_id, question in questions.items():
                spans = sink.of(rollout_id)
                assert counts(spans) == {"agent": 1, "llm": 2, "tool": 1}
                n = int(rollout_id[-1])
                (tool,) = of_kind(spans, "tool")
                assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": n, "b": n + 10}
                for llm in of_kind(spans, "llm"):
                    assert question in llm.attributes[semconv.INPUT_MESSAGES]
                    assert enclosing_agent(llm, spans) == "calculator"

        def test_uninstrument_restores_ag2_and_keeps_user_middleware(self, fake_openai, ag2_instrumentor, sink):
            seen: List[str] = []

            class UserMiddleware(BaseMiddleware):
                async def on_turn(self, call_next, event, context):
                    seen.append("turn")
                    return await call_next(event, context)

            from ag2.tools import executor

            ag2_instrumentor.uninstrument()
            original = Agent.__dict__["_turn_scope"]
            original_execute_call = executor._execute_call
            assert ag2_instrumentor.instrument()
            assert Agent.__dict__["_turn_scope"] is not original
            assert executor._execute_call is not original_execute_call
            agent = Agent(
                "calculator", config=make_config(fake_openai.base_url), tools=[add], middleware=[UserMiddleware]
            )
            before = list(agent._middleware)
            ag2_instrumentor.uninstrument()
            assert Agent.__dict__["_turn_scope"] is original
            assert executor._execute_call is original_execute_call
            with rollout_scope("ro-ag2-off", "at-1"):
                assert "5" in (asyncio.run(agent.ask(QUESTION)).body or "")
            assert seen == ["turn"]
            assert agent._middleware == before
            assert counts(sink.of("ro-ag2-off")) == {"llm": 2}  # the OpenAI layer only

        def test_instrumenting_twice_equals_once(self, fake_openai, ag2_instrumentor, sink):
            assert ag2_instrumentor.instrument()
            with rollout_scope("ro-ag2-twice", "at-1"):
                asyncio.run(ask_calculator(fake_openai.base_url))
            assert counts(sink.of("ro-ag2-twice")) == {"agent": 1, "llm": 2, "tool": 1}

        def test_an_agl_failure_never_reaches_the_agent(self, fake_openai, ag2_instrumentor, sink, monkeypatch):
            from agl.integrations.ag2 import _middleware

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("agl bug")

            monkeypatch.setattr(_middleware, "agent_span", broken)
            monkeypatch.setattr(_middleware, "tool_span", broken)
            errors = internal_error_count()
            with rollout_scope("ro-ag2-bug", "at-1"):
                assert "5" in asyncio.run(ask_calculator(fake_openai.base_url))
            assert internal_error_count() == errors + 2
            assert counts(sink.of("ro-ag2-bug")) == {"llm": 2}


# ==========================================================================================================
# AG2 classic (ag2 < 1): ConversableAgent / AssistantAgent / UserProxyAgent, initiate_chat
# ==========================================================================================================
if CLASSIC:
    from autogen import AssistantAgent, ConversableAgent, LLMConfig, UserProxyAgent
    from autogen.oai.client import OpenAIWrapper

    def llm_config(base_url: str, api: str = "chat.completions", stream: bool = False) -> Any:
        entry = {"model": "fake-model", "api_key": "x", "base_url": base_url}
        entry["api_type"] = "openai" if api == "chat.completions" else "responses"
        if stream:
            entry["stream"] = True
        return LLMConfig(entry)

    CLASSIC_TARGETS = [
        "generate_reply",
        "a_generate_reply",
        "execute_function",
        "a_execute_function",
        "initiate_chat",
        "a_initiate_chat",
        "_reflection_with_llm",
        "_run_async_in_thread",
    ]

    def calculator_pair(base_url: str, tool: Callable[..., float] = add, **config: Any) -> Any:
        """An assistant that calls ``add`` and a user proxy that executes it (no LLM of its own)."""
        assistant = AssistantAgent(
            "calculator", llm_config=llm_config(base_url, **config), system_message="Use the tools."
        )
        user = UserProxyAgent("user", human_input_mode="NEVER", code_execution_config=False, llm_config=False)
        assistant.register_for_llm(name="add", description="Add two numbers.")(tool)
        user.register_for_execution(name="add")(tool)
        return assistant, user

    def chat(base_url: str, question: str = QUESTION, **config: Any) -> Any:
        assistant, user = calculator_pair(base_url, **config)
        return user.initiate_chat(assistant, message=question, max_turns=2, silent=True)

    async def a_chat(base_url: str, question: str = QUESTION) -> Any:
        assistant, user = calculator_pair(base_url)
        return await user.a_initiate_chat(assistant, message=question, max_turns=2, silent=True)

    def assert_calculator_tree(spans: List[Span]) -> None:
        """initiate_chat (chain) > calculator (llm: tool call) > user (tool) > calculator (llm: answer)."""
        (chain,) = of_kind(spans, "chain")
        assert chain.name == "initiate_chat user -> calculator"
        agents = [s for s in of_kind(spans, "agent") if s.attributes.get(semconv.FRAMEWORK) == "ag2"]
        assert [a.attributes[semconv.AGENT_NAME] for a in agents] == ["calculator", "user", "calculator"]
        assert all(a.parent_id == chain.span_id for a in agents)
        assert [enclosing_agent(s, spans) for s in of_kind(spans, "llm")] == ["calculator", "calculator"]
        (tool,) = of_kind(spans, "tool")
        assert enclosing_agent(tool, spans) == "user"
        assert tool.attributes[semconv.TOOL_NAME] == "add"
        assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
        assert tool.attributes[semconv.TOOL_CALL_RESULT] == "5.0"
        assert tool.attributes[semconv.TOOL_CALL_ID].startswith("call_")

    class TestAG2Classic:
        @pytest.mark.parametrize(
            "api,stream", [("chat.completions", False), ("chat.completions", True), ("responses", False)]
        )  # AG2 classic itself cannot stream the Responses API
        def test_assistant_and_user_proxy_in_a_rollout(self, api, stream, fake_openai, ag2_instrumentor, tmp_path):
            @agl.rollout
            def calc(task, llm):
                result = chat(llm.get_base_url(), task["question"], api=api, stream=stream)
                return 1.0 if "5" in result.summary else 0.0

            (spans,) = dev(calc, [{"id": "t", "question": QUESTION}], fake_openai, tmp_path).values()
            assert_llm_spans_match_requests(spans, generation_requests(fake_openai), api, stream)
            assert_calculator_tree(spans)
            (reward,) = of_kind(spans, "reward")
            assert reward.attributes[semconv.REWARD_VALUE] == 1.0

        def test_async_chat_keeps_model_calls_under_the_agent(self, fake_openai, ag2_instrumentor, sink):
            """a_generate_oai_reply calls the model on an executor thread: the adapter hands the context over."""
            with rollout_scope("ro-classic-async", "at-1"):
                asyncio.run(a_chat(fake_openai.base_url))
            spans = sink.of("ro-classic-async")
            assert len(of_kind(spans, "llm")) == len(generation_requests(fake_openai)) == 2
            assert_calculator_tree(spans)

        def test_concurrent_rollouts_sharing_one_agent_keep_their_own_calls(self, fake_openai, sink):
            """A module-level assistant, each rollout's a_initiate_chat a task: once the loop's executor was
            full, the context handoff (one offer per agent, the latest) sent calls into other rollouts."""
            rollouts = [f"ro-shared-{i}" for i in range(12)]
            fake_openai.script(*[FakeReply(content=f"reply {i}", delay=0.2) for i in range(len(rollouts))])
            agl.uninstrument()
            agl.instrument(frameworks=["ag2"])  # as users run it: the thread-pool hook too
            try:
                config = llm_config(fake_openai.base_url)
                solver = ConversableAgent("solver", llm_config=config, human_input_mode="NEVER")

                async def one(rollout_id: str) -> None:
                    user = ConversableAgent(f"user-{rollout_id}", llm_config=False, human_input_mode="NEVER")
                    with rollout_scope(rollout_id, "at-1"):
                        await user.a_initiate_chat(solver, message=f"hello from {rollout_id}", max_turns=1, silent=True)

                async def all_of_them() -> None:
                    await asyncio.gather(*(one(r) for r in rollouts))

                asyncio.run(all_of_them())
            finally:
                agl.uninstrument()
            for rollout_id in rollouts:
                spans = sink.of(rollout_id)
                (llm,) = of_kind(spans, "llm")
                assert json.loads(llm.attributes[semconv.INPUT_MESSAGES])[-1]["content"] == f"hello from {rollout_id}"
                assert enclosing_agent(llm, spans) == "solver"

        def test_async_tool_in_a_sync_chat_stays_in_the_rollout(self, fake_openai, ag2_instrumentor, sink):
            """An async tool in a sync chat runs on a loop in a new thread (``_run_async_in_thread``)."""

            async def async_add(a: float, b: float) -> float:
                """Add two numbers."""
                return a + b

            assistant, user = calculator_pair(fake_openai.base_url, tool=async_add)
            with rollout_scope("ro-classic-async-tool", "at-1"):
                user.initiate_chat(assistant, message=QUESTION, max_turns=2, silent=True)
            assert_calculator_tree(sink.of("ro-classic-async-tool"))

        def test_a_reflection_summary_belongs_to_the_summarizing_agent(self, fake_openai, ag2_instrumentor, sink):
            assistant, user = calculator_pair(fake_openai.base_url)
            fake_openai.script(
                FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),
                FakeReply(content="It is 5."),
                FakeReply(content="Summary: 2 plus 3 is 5."),
            )
            with rollout_scope("ro-classic-summary", "at-1"):
                result = user.initiate_chat(
                    assistant, message=QUESTION, max_turns=2, silent=True, summary_method="reflection_with_llm"
                )
            assert result.summary == "Summary: 2 plus 3 is 5."
            spans = sink.of("ro-classic-summary")
            summary = of_kind(spans, "llm")[-1]
            assert "Summary" in summary.attributes[semconv.OUTPUT_MESSAGES]
            assert enclosing_agent(summary, spans) == "calculator"  # the recipient's client summarizes

        def test_a_raising_tool_makes_an_error_span_with_the_text_the_model_read(
            self, fake_openai, ag2_instrumentor, sink
        ):
            """AG2 classic catches the tool's exception and tells the model ``Error: ...``: that text was only the
            span's error, with no result, unlike every other adapter's failed tool. It is both now, and the
            error type is OpenTelemetry's ``_OTHER`` (AG2 keeps no exception to name), as in those adapters."""
            assistant, user = calculator_pair(fake_openai.base_url, tool=failing_add)
            with rollout_scope("ro-classic-error", "at-1"):
                user.initiate_chat(assistant, message=QUESTION, max_turns=2, silent=True)
            spans = sink.of("ro-classic-error")
            (tool,) = of_kind(spans, "tool")
            told = tool_messages(generation_requests(fake_openai)[1])[tool.attributes[semconv.TOOL_CALL_ID]]
            assert "the adder is broken" in told
            assert tool.status == "error" and tool.attributes[semconv.ERROR_TYPE] == "_OTHER"
            assert tool.error == tool.attributes[semconv.TOOL_CALL_RESULT] == told
            assert air_per_call(spans)[0]["air.tool_error"] == AIRConfig().tool_error

        def test_a_reward_emitted_in_a_tool_is_a_step_reward(self, fake_openai, ag2_instrumentor, sink):
            fake_openai.script(
                FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5")
            )
            assistant, user = calculator_pair(fake_openai.base_url, tool=graded_add)
            with rollout_scope("ro-classic-reward", "at-1"):
                user.initiate_chat(assistant, message=QUESTION, max_turns=2, silent=True)
            assert_tool_reward_credited(sink.of("ro-classic-reward"), 0.5)

        def test_agent_match_selects_the_calls_of_one_of_two_agents(self, fake_openai, ag2_instrumentor, tmp_path):
            """THE KEY ONE: a solver (calls the tool) and a reviewer (runs it, then comments) both use the model."""
            fake_openai.script(
                FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),  # solver
                FakeReply(content="The sum is 5."),  # solver, after the reviewer ran the tool
                FakeReply(content="Reviewed: correct."),  # reviewer
                FakeReply(content="Thanks."),  # solver
            )

            @agl.rollout
            def review(task, llm):
                config = llm_config(llm.get_base_url())
                solver = AssistantAgent("solver", llm_config=config, system_message="Use the tools.")
                reviewer = ConversableAgent("reviewer", llm_config=config, human_input_mode="NEVER")
                solver.register_for_llm(name="add", description="Add two numbers.")(add)
                reviewer.register_for_execution(name="add")(add)
                reviewer.initiate_chat(solver, message=task["question"], max_turns=3, silent=True)
                return 1.0

            (spans,) = dev(review, [{"id": "t", "question": QUESTION}], fake_openai, tmp_path).values()
            assert len(of_kind(spans, "llm")) == len(generation_requests(fake_openai)) == 4

            def said(selected: List[Span]) -> List[Any]:
                return [json.loads(s.attributes[semconv.OUTPUT_MESSAGES])[0].get("content") for s in selected]

            assert said(select_llm_calls(spans, "^solver$")) == [None, "The sum is 5.", "Thanks."]
            assert said(select_llm_calls(spans, "^reviewer$")) == ["Reviewed: correct."]
            assert select_llm_calls(spans, "^review$") == []  # nothing is left to the rollout's root agent
            (tool,) = of_kind(spans, "tool")
            assert enclosing_agent(tool, spans) == "reviewer"

        def test_concurrent_rollouts_in_threads_and_tasks_stay_apart(self, fake_openai, ag2_instrumentor, sink):
            questions = four_questions()
            run_concurrent_rollouts(
                questions,
                lambda question: chat(fake_openai.base_url, question),
                lambda question: a_chat(fake_openai.base_url, question),
            )
            for rollout_id, question in questions.items():
                spans = sink.of(rollout_id)
                assert counts(spans) == {"chain": 1, "agent": 3, "llm": 2, "tool": 1}
                n = int(rollout_id[-1])
                (tool,) = of_kind(spans, "tool")
                assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": n, "b": n + 10}
                for llm in of_kind(spans, "llm"):
                    assert question in llm.attributes[semconv.INPUT_MESSAGES]
                    assert enclosing_agent(llm, spans) == "calculator"

        def test_uninstrument_restores_autogen_and_keeps_user_hooks(self, fake_openai, ag2_instrumentor, sink):
            targets = [(ConversableAgent, name) for name in CLASSIC_TARGETS] + [(OpenAIWrapper, "create")]
            ag2_instrumentor.uninstrument()
            originals = {(owner, name): owner.__dict__[name] for owner, name in targets}
            assert ag2_instrumentor.instrument()
            assert all(owner.__dict__[name] is not original for (owner, name), original in originals.items())
            assistant, user = calculator_pair(fake_openai.base_url)
            seen: List[int] = []
            assistant.register_hook("process_all_messages_before_reply", lambda messages: seen.append(1) or messages)
            replies_before = list(assistant._reply_func_list)
            ag2_instrumentor.uninstrument()
            assert all(owner.__dict__[name] is original for (owner, name), original in originals.items())
            with rollout_scope("ro-classic-off", "at-1"):
                user.initiate_chat(assistant, message=QUESTION, max_turns=2, silent=True)
            assert seen == [1, 1]
            assert assistant._reply_func_list == replies_before
            assert counts(sink.of("ro-classic-off")) == {"llm": 2}  # the OpenAI layer only

        def test_instrumenting_twice_equals_once(self, fake_openai, ag2_instrumentor, sink):
            assert ag2_instrumentor.instrument()
            with rollout_scope("ro-classic-twice", "at-1"):
                chat(fake_openai.base_url)
            assert counts(sink.of("ro-classic-twice")) == {"chain": 1, "agent": 3, "llm": 2, "tool": 1}

        def test_an_agl_failure_never_reaches_the_agents(self, fake_openai, ag2_instrumentor, sink, monkeypatch):
            from agl.integrations.ag2 import _wrappers

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("agl bug")

            monkeypatch.setattr(_wrappers, "agent_span", broken)
            monkeypatch.setattr(_wrappers, "tool_span", broken)
            errors = internal_error_count()
            with rollout_scope("ro-classic-bug", "at-1"):
                assert "5" in chat(fake_openai.base_url).summary
            assert internal_error_count() == errors + 4  # 3 replies, 1 tool
            assert counts(sink.of("ro-classic-bug")) == {"chain": 1, "llm": 2}


@pytest.mark.skipif(CLASSIC, reason="the example is written for AG2 1.x (import ag2)")
def test_the_example_runs_as_its_docstring_says(dev_example) -> None:
    dev_example("ag2_agent.py:ag2_calc_agent", "^calculator$")
