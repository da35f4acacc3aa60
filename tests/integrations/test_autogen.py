"""AutoGen agentchat adapter: real AutoGen agents and teams, the real ``openai`` client underneath, agl's fake
OpenAI server as the model, spans collected through real rollouts (Trainer.dev + SQLite, or rollout scopes
with a list sink)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest
import wrapt

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

import openai
from autogen_agentchat.agents import AssistantAgent, BaseChatAgent, UserProxyAgent
from autogen_agentchat.base import Response
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import BaseChatMessage, TextMessage
from autogen_agentchat.teams import BaseGroupChat, RoundRobinGroupChat, SelectorGroupChat
from autogen_agentchat.teams._group_chat._selector_group_chat import SelectorGroupChatManager
from autogen_core import (
    AgentId,
    CancellationToken,
    MessageContext,
    RoutedAgent,
    SingleThreadedAgentRuntime,
    TopicId,
    TypeSubscription,
    message_handler,
)
from autogen_core._single_threaded_agent_runtime import PublishMessageEnvelope, SendMessageEnvelope
from autogen_core.models import UserMessage
from autogen_core.tools import BaseTool, FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient
from opentelemetry import trace as otel_trace

import agl
import agl.instrumentation
from agl import semconv
from agl.integrations.autogen import AutoGenInstrumentor
from agl.lightningrl.agent_match import agent_name_of, select_llm_calls
from agl.store import SqliteLightningStore
from agl.testing import FakeReply, assert_tool_reward_credited
from agl.types import Span

MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}
WRITER_PROMPT = "You are the writer. Compute with the add tool."
CHECKER_PROMPT = "You are the checker. Check the writer's result."


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    raise ZeroDivisionError(f"cannot divide {a} by zero")


class Summarizer(BaseChatAgent):
    """A custom agent (not an AssistantAgent) that asks its model once: it gets an agent span too."""

    def __init__(self, name: str, model_client: OpenAIChatCompletionClient) -> None:
        super().__init__(name, "Summarizes the conversation in one line.")
        self._client = model_client

    @property
    def produced_message_types(self) -> Sequence[type[BaseChatMessage]]:
        return (TextMessage,)

    async def on_messages(self, messages: Sequence[BaseChatMessage], cancellation_token: CancellationToken) -> Response:
        text = " ".join(str(m.content) for m in messages)
        result = await self._client.create([UserMessage(content=f"Summarize: {text}", source="user")])
        return Response(chat_message=TextMessage(content=str(result.content), source=self.name))

    async def on_reset(self, cancellation_token: CancellationToken) -> None:
        return None


# -- fixtures and helpers ----------------------------------------------------------------------------------


@pytest.fixture
def instrumented() -> Iterator[None]:
    agl.instrumentation.uninstrument()  # another test may have left agl.instrument() on
    assert agl.instrument(frameworks=["autogen"]) == ["openai", "thread_pools", "autogen"]
    yield
    agl.instrumentation.uninstrument()


def model_client(base_url: str) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(
        model="fake-model", base_url=base_url, api_key="x", model_info=MODEL_INFO, max_retries=0
    )


def run_in_rollout(coroutine: Any) -> str:
    """Run an AutoGen coroutine in a fresh rollout (as the runner does); returns the rollout id."""
    rollout_id = f"ro-{uuid.uuid4().hex[:8]}"
    with agl.rollout_scope(rollout_id, "at-1"):
        asyncio.run(coroutine)
    return rollout_id


def of_kind(spans: Sequence[Span], kind: str) -> List[Span]:
    return [s for s in spans if s.kind == kind]


def agent_names(spans: Sequence[Span]) -> List[str]:
    return [s.attributes[semconv.AGENT_NAME] for s in of_kind(spans, "agent")]


def first_message(span: Span) -> str:
    return json.loads(span.attributes[semconv.INPUT_MESSAGES])[0]["content"]


def assert_llm_spans_complete(spans: Sequence[Span], requests: Sequence[Dict[str, Any]]) -> List[Span]:
    """Exactly one llm span per HTTP request, each with the server's token ids."""
    llm = of_kind(spans, "llm")
    assert len(llm) == len(requests) > 0
    for span in llm:
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]
    return llm


def dev(agent: Any, fake_openai: Any, tmp_path: Any, tasks: List[Dict[str, Any]]) -> List[List[Span]]:
    """Run ``agent`` on ``tasks`` with Trainer.dev (thread runner, SQLite); the spans of each rollout."""
    db = tmp_path / "autogen.db"
    trainer = agl.Trainer(
        store=str(db),
        runner_mode="thread",
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake-model")},
        progress=False,
    )
    rows = trainer.dev(agent, tasks, print_table=False)
    assert all(row.status == "succeeded" for row in rows), [row.error for row in rows]
    store = SqliteLightningStore(db)
    try:
        return [store.query_spans(row.rollout_id) for row in rows]
    finally:
        store.close()


# -- a single agent ----------------------------------------------------------------------------------------


@agl.rollout
async def calculator_rollout(task: Dict[str, Any], llm: agl.LLM) -> float:
    client = model_client(llm.get_base_url())
    agent = AssistantAgent("calculator", model_client=client, tools=[add], reflect_on_tool_use=True)
    result = await agent.run(task=task["question"])
    return 1.0 if str(task["answer"]) in str(result.messages[-1].content) else 0.0


def test_tool_round_trip_nests_llm_calls_under_the_agent_span(fake_openai, instrumented, tmp_path):
    (spans,) = dev(calculator_rollout, fake_openai, tmp_path, [{"question": "What is 2 plus 3?", "answer": 5}])
    by_id = {s.span_id: s for s in spans}
    (agent,) = of_kind(spans, "agent")[1:]  # [0] is the runner's root span
    assert agent.attributes[semconv.AGENT_NAME] == "calculator" and agent.name == "invoke_agent calculator"
    assert by_id[agent.parent_id].name == "agl.rollout"

    first, reflection = assert_llm_spans_complete(spans, fake_openai.requests)
    assert [agent_name_of(s, by_id) for s in (first, reflection)] == ["calculator", "calculator"]
    (tool,) = of_kind(spans, "tool")
    assert tool.parent_id == agent.span_id and tool.status != "error"
    (call,) = json.loads(first.attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"]
    assert tool.attributes[semconv.TOOL_NAME] == "add"
    assert tool.attributes[semconv.TOOL_CALL_ID] == call["id"]
    assert json.loads(tool.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == "5.0"
    assert first.sequence_id < tool.sequence_id < reflection.sequence_id  # the model saw the result after
    assert "The answer is 5.0" in json.loads(reflection.attributes[semconv.OUTPUT_MESSAGES])[0]["content"]


def test_streamed_model_calls_are_one_llm_span_each(fake_openai, instrumented, sink):
    async def main() -> None:
        client = model_client(fake_openai.base_url)
        agent = AssistantAgent(
            "streamer", model_client=client, tools=[add], reflect_on_tool_use=True, model_client_stream=True
        )
        chunks = [m async for m in agent.run_stream(task="What is 4 plus 5?")]
        assert "The answer is 9.0." in str(chunks[-1].messages[-1].content)

    spans = sink.of(run_in_rollout(main()))
    llm = assert_llm_spans_complete(spans, fake_openai.requests)
    assert all(r["body"].get("stream") is True for r in fake_openai.requests)
    assert all(s.attributes[semconv.LLM_STREAM] is True for s in llm)
    assert agent_names(spans) == ["streamer"]
    (agent,) = of_kind(spans, "agent")
    assert all(s.parent_id == agent.span_id for s in llm + of_kind(spans, "tool"))
    (tool,) = of_kind(spans, "tool")
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == "9.0"
    assert "The answer is 9.0." in fake_openai.tokenizer.decode(llm[-1].attributes[semconv.RESPONSE_TOKEN_IDS])


def test_structured_output_is_an_llm_span_of_its_agent(fake_openai, instrumented, sink):
    """``output_content_type`` makes AutoGen call ``beta.chat.completions.parse``, not ``create``: before
    openai 1.92 a class of its own (the oldest line runs it), since then the plain one."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    async def main() -> None:
        client = OpenAIChatCompletionClient(
            model="fake-model",
            base_url=fake_openai.base_url,
            api_key="x",
            max_retries=0,
            model_info={**MODEL_INFO, "json_output": True, "structured_output": True},
        )
        agent = AssistantAgent("solver", model_client=client, output_content_type=Answer)
        result = await agent.run(task="What is 6 times 7?")
        assert result.messages[-1].content == Answer(value=42)

    fake_openai.script(FakeReply(content='{"value": 42}'))
    spans = sink.of(run_in_rollout(main()))
    (llm,) = of_kind(spans, "llm")
    (agent,) = of_kind(spans, "agent")
    assert agent.attributes[semconv.AGENT_NAME] == "solver" and llm.parent_id == agent.span_id
    assert llm.attributes[semconv.RESPONSE_TOKEN_IDS] and llm.attributes[semconv.PROMPT_TOKEN_IDS]
    assert fake_openai.requests[-1]["body"]["response_format"]["type"] == "json_schema"


def test_a_tool_that_raises_gets_error_status_and_the_model_sees_the_error(fake_openai, instrumented, sink):
    async def main() -> None:
        agent = AssistantAgent("divider", model_client=model_client(fake_openai.base_url), tools=[divide])
        result = await agent.run(task="What is 6 divided by 0?")
        assert result.messages[-1].source == "divider"  # AutoGen handed the error to the model and went on

    spans = sink.of(run_in_rollout(main()))
    assert_llm_spans_complete(spans, fake_openai.requests)
    (tool,) = of_kind(spans, "tool")
    assert tool.status == "error" and tool.attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"
    assert "cannot divide 6.0 by zero" in tool.error
    assert "cannot divide 6.0 by zero" in tool.attributes[semconv.TOOL_CALL_RESULT]  # what the model read
    (agent,) = of_kind(spans, "agent")
    assert agent.status != "error"


def test_a_call_of_a_tool_the_agent_lacks_is_an_error_tool_span_without_exception(fake_openai, instrumented, sink):
    """The model names a tool the agent was not given: AutoGen answers an error result without running
    anything (no exception exists). The tool span still fails, with AutoGen's text as the error."""
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "multiply", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="6")
    )

    async def main() -> None:
        agent = AssistantAgent("calc", model_client=model_client(fake_openai.base_url), tools=[add])
        await agent.run(task="What is 2 times 3?")

    spans = sink.of(run_in_rollout(main()))
    assert_llm_spans_complete(spans, fake_openai.requests)
    (tool,) = of_kind(spans, "tool")
    assert tool.attributes[semconv.TOOL_NAME] == "multiply"
    assert tool.status == "error" and tool.attributes[semconv.ERROR_TYPE] == "_OTHER"  # OTel: no type known
    assert "multiply" in tool.error and tool.error == tool.attributes[semconv.TOOL_CALL_RESULT]
    assert tool.parent_id == of_kind(spans, "agent")[0].span_id


def scored_add(a: float, b: float) -> float:
    """Add two numbers (and grade the call)."""
    agl.emit_reward(0.5)
    return a + b


def test_a_reward_emitted_in_a_tool_is_a_step_reward_for_the_call_that_asked_for_it(fake_openai, instrumented, sink):
    """AutoGen's own OpenTelemetry tracing opens a span inside agl's tool span (with no SDK installed, a
    NonRecordingSpan sharing its context): the reward is still known to be emitted in the tool."""
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "scored_add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5")
    )

    async def main() -> None:
        agent = AssistantAgent("calc", model_client=model_client(fake_openai.base_url), tools=[scored_add])
        await agent.run(task="What is 2 plus 3?")

    assert_tool_reward_credited(sink.of(run_in_rollout(main())), 0.5)


def test_sync_functions_autogen_runs_in_its_thread_pool_stay_in_the_rollout(fake_openai, instrumented, sink):
    """AutoGen runs sync tool functions and sync user-input functions with ``run_in_executor``, which drops
    contextvars; a model call made there (an expert tool, a simulated user) must stay in the rollout."""

    def ask(model: str, question: str) -> str:
        with openai.OpenAI(base_url=fake_openai.base_url, api_key="x") as client:
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}])
        return reply.choices[0].message.content or ""

    def consult(question: str) -> str:
        """Ask an expert model."""
        return ask("expert", question)

    async def main() -> None:
        await AssistantAgent("asker", model_client=model_client(fake_openai.base_url), tools=[consult]).run(
            task="Is 7 prime?"
        )
        await UserProxyAgent("user", input_func=lambda prompt: ask("user-sim", "Reply as the user.")).run(task="Hi")

    spans = sink.of(run_in_rollout(main()))
    llm = assert_llm_spans_complete(spans, fake_openai.requests)
    by_model = {s.attributes[semconv.REQUEST_MODEL]: s for s in llm}
    (tool,) = of_kind(spans, "tool")
    assert by_model["expert"].parent_id == tool.span_id
    assert tool.attributes[semconv.TOOL_CALL_RESULT] == "FAKE: Is 7 prime?"
    assert [s.span_id for s in select_llm_calls(spans, "^user$")] == [by_model["user-sim"].span_id]


def test_responses_api_agent(fake_openai, instrumented, sink):
    agents = pytest.importorskip("autogen_ext.agents.openai")
    if not hasattr(agents, "OpenAIAgent"):
        pytest.skip("OpenAIAgent (Responses API) arrived in autogen-ext 0.6")

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x")
        agent = agents.OpenAIAgent(
            name="responder", description="answers", client=client, model="fake-model", instructions="Be brief."
        )
        result = await agent.run(task="Say hi")
        assert result.messages[-1].content == "FAKE: Say hi"

    spans = sink.of(run_in_rollout(main()))
    (llm,) = assert_llm_spans_complete(spans, fake_openai.requests)
    assert fake_openai.requests[0]["path"].endswith("/responses")
    assert llm.attributes[semconv.LLM_API] == "responses"
    (agent,) = of_kind(spans, "agent")
    assert agent.attributes[semconv.AGENT_NAME] == "responder" and llm.parent_id == agent.span_id


def test_a_stream_left_early_neither_leaks_its_span_nor_stays_open(fake_openai, instrumented, sink):
    """The agent span is current only while AutoGen's generator runs, never in the consumer's code; a
    stream closed early ends its span without error, and one abandoned (closed by the event loop at
    shutdown, in another context) still ends it."""

    async def leave_early(agent: AssistantAgent, close: bool) -> None:
        before = otel_trace.get_current_span()
        stream = agent.run_stream(task="Tell me a long story.")
        async for _ in stream:
            assert otel_trace.get_current_span() is before
            break
        if close:
            await stream.aclose()

    async def main() -> None:
        client = model_client(fake_openai.base_url)
        await leave_early(AssistantAgent("closed", model_client=client), close=True)
        await leave_early(AssistantAgent("abandoned", model_client=client), close=False)

    spans = sink.of(run_in_rollout(main()))
    closed, abandoned = of_kind(spans, "agent")
    assert closed.attributes[semconv.AGENT_NAME] == "closed" and closed.status != "error"
    assert abandoned.attributes[semconv.AGENT_NAME] == "abandoned"  # ended, or it would not be stored
    assert fake_openai.requests == []  # both stopped before asking the model


def test_a_failing_model_call_marks_the_agent_span(fake_openai, instrumented, sink):
    fake_openai.script(FakeReply(status_code=400, error_message="bad request"))

    async def main() -> None:
        agent = AssistantAgent("failing", model_client=model_client(fake_openai.base_url))
        with pytest.raises(openai.BadRequestError):
            await agent.on_messages([TextMessage(content="hi", source="user")], CancellationToken())

    spans = sink.of(run_in_rollout(main()))
    (llm,) = of_kind(spans, "llm")
    (agent,) = of_kind(spans, "agent")
    assert llm.parent_id == agent.span_id
    assert agent.status == llm.status == "error" and agent.attributes[semconv.ERROR_TYPE] == "BadRequestError"


# -- teams: agent_match selects one agent's calls ----------------------------------------------------------


@agl.rollout
async def writer_checker_rollout(task: Dict[str, Any], llm: agl.LLM) -> float:
    client = model_client(llm.get_base_url())
    writer = AssistantAgent("writer", model_client=client, tools=[add], system_message=WRITER_PROMPT)
    checker = AssistantAgent("checker", model_client=client, system_message=CHECKER_PROMPT)
    team = RoundRobinGroupChat([writer, checker], termination_condition=MaxMessageTermination(5))
    result = await team.run(task=task["question"])
    return 1.0 if str(task["answer"]) in str(result.messages[-1].content) else 0.0


def test_agent_match_selects_exactly_the_calls_of_one_team_member(fake_openai, instrumented, tmp_path):
    (spans,) = dev(writer_checker_rollout, fake_openai, tmp_path, [{"question": "What is 20 plus 22?", "answer": 42}])
    llm = assert_llm_spans_complete(spans, fake_openai.requests)
    writer_calls = [s.span_id for s in llm if first_message(s) == WRITER_PROMPT]
    checker_calls = [s.span_id for s in llm if first_message(s) == CHECKER_PROMPT]
    assert len(writer_calls) == 2 and len(checker_calls) == 2 and len(llm) == 4

    assert [s.span_id for s in select_llm_calls(spans, "^writer$")] == writer_calls
    assert [s.span_id for s in select_llm_calls(spans, "^checker$")] == checker_calls
    assert select_llm_calls(spans, "^writer_checker_rollout$") == []  # nothing left to the root span

    by_id = {s.span_id: s for s in spans}
    (team,) = of_kind(spans, "chain")
    assert team.name == "invoke_team RoundRobinGroupChat" and by_id[team.parent_id].name == "agl.rollout"
    turns = of_kind(spans, "agent")[1:]
    assert [s.attributes[semconv.AGENT_NAME] for s in turns] == ["writer", "checker", "writer", "checker"]
    assert all(s.parent_id == team.span_id for s in turns)
    tools = of_kind(spans, "tool")
    assert {by_id[t.parent_id].attributes[semconv.AGENT_NAME] for t in tools} == {"writer"} and len(tools) == 2


def test_selector_and_custom_agents_get_their_own_agent_spans(fake_openai, instrumented, sink):
    fake_openai.script(FakeReply(content="writer"))  # the selector's choice; the rest is the default policy

    async def main() -> None:
        client = model_client(fake_openai.base_url)
        writer = AssistantAgent("writer", model_client=client, system_message=WRITER_PROMPT)
        summarizer = Summarizer("summarizer", client)
        team = SelectorGroupChat(
            [writer, summarizer], model_client=client, termination_condition=MaxMessageTermination(3)
        )
        await team.run(task="Write 1 plus 1.")

    spans = sink.of(run_in_rollout(main()))
    llm = assert_llm_spans_complete(spans, fake_openai.requests)
    # The second selection has one candidate left and asks no model, but it is still the manager's turn.
    assert agent_names(spans) == ["SelectorGroupChatManager", "writer", "SelectorGroupChatManager", "summarizer"]
    by_agent = {name: select_llm_calls(spans, f"^{name}$") for name in set(agent_names(spans))}
    assert {name: len(calls) for name, calls in by_agent.items()} == {
        "SelectorGroupChatManager": 1,
        "writer": 1,
        "summarizer": 1,
    }
    assert "writer" in first_message(by_agent["SelectorGroupChatManager"][0])  # the selector prompt lists roles
    assert first_message(by_agent["writer"][0]) == WRITER_PROMPT
    assert first_message(by_agent["summarizer"][0]).startswith("Summarize:")
    assert sorted(s.span_id for calls in by_agent.values() for s in calls) == sorted(s.span_id for s in llm)


# -- a runtime kept across rollouts -------------------------------------------------------------------------


@dataclass
class Question:
    text: str


@dataclass
class Note:
    text: str


class Solver(RoutedAgent):
    """A core agent: answers a question with its model, then publishes a note on it (a message a handler sends)."""

    def __init__(self, client: OpenAIChatCompletionClient) -> None:
        super().__init__("Answers questions.")
        self._client = client

    @message_handler
    async def on_question(self, message: Question, ctx: MessageContext) -> str:
        result = await self._client.create([UserMessage(content=f"Answer: {message.text}", source="user")])
        await self.publish_message(Note(message.text), TopicId("notes", self.id.key))
        return str(result.content)


class NoteTaker(RoutedAgent):
    """A core agent subscribed to the notes: asks its model once per note, then says the note is taken."""

    def __init__(self, client: OpenAIChatCompletionClient, taken: Dict[str, asyncio.Future[None]]) -> None:
        super().__init__("Takes notes.")
        self._client = client
        self._taken = taken

    @message_handler
    async def on_note(self, message: Note, ctx: MessageContext) -> None:
        await self._client.create([UserMessage(content=f"Note: {message.text}", source="user")])
        self._taken[message.text].set_result(None)


class KeptRuntime:
    """A runtime made and started by the first rollout and kept for the next ones, as a user keeps one at module
    level. The runner keeps its event loop across rollouts, so the runtime's loop task, and the tasks it makes
    for each message, carry on in the context of the first rollout."""

    def __init__(self) -> None:
        self.runtime: Optional[SingleThreadedAgentRuntime] = None
        self.taken: Dict[str, asyncio.Future[None]] = {}  # by question: the note on it was taken

    async def get(self, base_url: str) -> SingleThreadedAgentRuntime:
        if self.runtime is None:
            runtime = SingleThreadedAgentRuntime()
            client = model_client(base_url)
            await Solver.register(runtime, "solver", lambda: Solver(client))
            await NoteTaker.register(runtime, "note_taker", lambda: NoteTaker(client, self.taken))
            await runtime.add_subscription(TypeSubscription(topic_type="notes", agent_type="note_taker"))
            runtime.start()
            self.runtime = runtime
        return self.runtime


QUESTIONS = [{"question": f"What is {n} plus {n}?", "answer": 2 * n} for n in (3, 5, 7)]


def rollout_root(span: Span, by_id: Dict[str, Span]) -> Span:
    """The top of ``span``'s parent chain among its rollout's spans (a parent stored elsewhere: KeyError)."""
    while span.parent_id is not None:
        span = by_id[span.parent_id]
    return span


def assert_each_rollout_holds_its_own_calls(
    rollouts: List[List[Span]], requests: List[Dict[str, Any]], calls: int
) -> None:
    """Every model request is one llm span, stored in the rollout that asked: its question is in the prompt, no
    other rollout's is."""
    assert [len(of_kind(spans, "llm")) for spans in rollouts] == [calls] * len(rollouts)
    assert sum(len(of_kind(spans, "llm")) for spans in rollouts) == len(requests)
    for spans, task in zip(rollouts, QUESTIONS):
        for llm in of_kind(spans, "llm"):
            prompt = llm.attributes[semconv.INPUT_MESSAGES]
            assert [other["question"] in prompt for other in QUESTIONS] == [other is task for other in QUESTIONS]


def assert_under_the_rollout_root(rollouts: List[List[Span]]) -> None:
    """Each llm span's parent chain stays in its rollout and ends at the runner's root span."""
    for spans in rollouts:
        by_id = {s.span_id: s for s in spans}
        assert all(rollout_root(llm, by_id).name == "agl.rollout" for llm in of_kind(spans, "llm"))


async def ask(kept: KeptRuntime, base_url: str, question: str) -> str:
    """Send the question to the kept runtime's solver; return its answer once the note on it is taken too."""
    runtime = await kept.get(base_url)
    taken = kept.taken[question] = asyncio.get_running_loop().create_future()
    answer = await runtime.send_message(Question(question), AgentId("solver", "default"))
    await asyncio.wait_for(taken, timeout=10)
    return answer


def test_a_runtime_kept_across_rollouts_records_each_message_in_the_rollout_that_sent_it(
    fake_openai, instrumented, tmp_path
):
    """Before, what the runtime's handlers did for the second and later rollouts ran in the first rollout's
    (ended) context, and was not stored at all."""
    kept = KeptRuntime()

    @agl.rollout
    async def ask_kept_runtime(task: Dict[str, Any], llm: agl.LLM) -> float:
        answer = await ask(kept, llm.get_base_url(), task["question"])
        return 1.0 if task["question"] in answer else 0.0

    rollouts = dev(ask_kept_runtime, fake_openai, tmp_path, QUESTIONS)
    # The solver's call (sent by the rollout) and the note taker's (published by the solver's handler).
    assert_each_rollout_holds_its_own_calls(rollouts, fake_openai.requests, calls=2)
    assert_under_the_rollout_root(rollouts)
    for spans in rollouts:
        (root,) = of_kind(spans, "agent")  # core agents are no agentchat agents: no agent spans of their own
        assert all(s.parent_id == root.span_id for s in of_kind(spans, "llm"))


def test_a_team_on_a_runtime_kept_across_rollouts_records_each_run_in_its_rollout(fake_openai, instrumented, tmp_path):
    """A team given the user's runtime (``runtime=``) does not start it: before, its participants' turns of the
    second and later rollouts were lost, and even the first rollout's were not under its team span."""
    kept: Dict[str, SingleThreadedAgentRuntime] = {}

    @agl.rollout
    async def team_on_kept_runtime(task: Dict[str, Any], llm: agl.LLM) -> float:
        if not kept:
            kept["runtime"] = SingleThreadedAgentRuntime()
            kept["runtime"].start()
        client = model_client(llm.get_base_url())
        writer = AssistantAgent("writer", model_client=client, tools=[add], system_message=WRITER_PROMPT)
        checker = AssistantAgent("checker", model_client=client, system_message=CHECKER_PROMPT)
        team = RoundRobinGroupChat(
            [writer, checker], termination_condition=MaxMessageTermination(3), runtime=kept["runtime"]
        )
        result = await team.run(task=task["question"])
        return 1.0 if str(task["answer"]) in str(result.messages[-1].content) else 0.0

    rollouts = dev(team_on_kept_runtime, fake_openai, tmp_path, QUESTIONS)
    assert_each_rollout_holds_its_own_calls(rollouts, fake_openai.requests, calls=2)
    assert_under_the_rollout_root(rollouts)
    for spans in rollouts:
        by_id = {s.span_id: s for s in spans}
        (team,) = of_kind(spans, "chain")
        assert by_id[team.parent_id].name == "agl.rollout"
        turns = of_kind(spans, "agent")[1:]
        assert [s.attributes[semconv.AGENT_NAME] for s in turns] == ["writer", "checker"]
        assert all(s.parent_id == team.span_id for s in turns)
        assert [agent_name_of(s, by_id) for s in of_kind(spans, "llm")] == ["writer", "checker"]
        (tool,) = of_kind(spans, "tool")
        assert by_id[tool.parent_id].attributes[semconv.AGENT_NAME] == "writer"


def test_rollouts_running_at_once_on_one_runtime_keep_their_calls_apart(fake_openai, instrumented, sink):
    """Rollouts as asyncio tasks sharing a runtime started outside every rollout: each message is handled in
    the rollout that sent it, even while the other rollout's messages are being handled."""
    fake_openai.script(*[FakeReply(delay=0.2)] * 4)  # slow replies make the two rollouts overlap
    kept = KeptRuntime()
    rollout_ids = [f"ro-shared-{n}" for n in range(2)]

    async def one(rollout_id: str, question: str) -> None:
        with agl.rollout_scope(rollout_id, "at-1"):
            await ask(kept, fake_openai.base_url, question)

    async def main() -> None:
        runtime = await kept.get(fake_openai.base_url)
        await asyncio.gather(*(one(r, task["question"]) for r, task in zip(rollout_ids, QUESTIONS)))
        await runtime.stop()

    asyncio.run(main())
    rollouts = [sink.of(rollout_id) for rollout_id in rollout_ids]
    assert_each_rollout_holds_its_own_calls(rollouts, fake_openai.requests, calls=2)
    (start_a, end_a), (start_b, end_b) = [
        (min(s.start_time for s in spans), max(s.end_time for s in spans)) for spans in rollouts
    ]
    assert start_a < end_b and start_b < end_a


# -- concurrency -------------------------------------------------------------------------------------------


async def solve(base_url: str, name: str, question: str) -> None:
    agent = AssistantAgent(name, model_client=model_client(base_url), tools=[add], reflect_on_tool_use=True)
    await agent.run(task=question)


def assert_rollouts_kept_apart(sink: Any, rollouts: Dict[str, str]) -> None:
    """Each rollout holds its own agent, tool and llm spans only, and the two ran at the same time."""
    windows = []
    for rollout_id, number in rollouts.items():
        spans = sink.of(rollout_id)
        (agent,) = of_kind(spans, "agent")
        assert agent.attributes[semconv.AGENT_NAME] == f"agent_{number}"
        assert len(of_kind(spans, "llm")) == 2 and len(of_kind(spans, "tool")) == 1
        assert all(number in s.attributes[semconv.INPUT_MESSAGES] for s in of_kind(spans, "llm"))
        assert all(s.parent_id == agent.span_id for s in spans if s is not agent)
        windows.append((agent.start_time, agent.end_time))
    (start_a, end_a), (start_b, end_b) = windows
    assert start_a < end_b and start_b < end_a


def test_concurrent_rollouts_in_threads_keep_their_spans(fake_openai, instrumented, sink):
    fake_openai.script(*[FakeReply(delay=0.2)] * 4)  # slow replies make the two rollouts overlap
    rollouts = {f"ro-thread-{n}": n for n in ("111", "222")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = []
        for rollout_id, number in rollouts.items():
            with agl.rollout_scope(rollout_id, "at-1"):
                question = f"What is {number} plus 1?"
                futures.append(agl.submit(pool, asyncio.run, solve(fake_openai.base_url, f"agent_{number}", question)))
        for future in futures:
            future.result()
    assert_rollouts_kept_apart(sink, rollouts)


def test_concurrent_rollouts_as_asyncio_tasks_keep_their_spans(fake_openai, instrumented, sink):
    fake_openai.script(*[FakeReply(delay=0.2)] * 4)
    rollouts = {f"ro-task-{n}": n for n in ("333", "444")}

    async def one(rollout_id: str, number: str) -> None:
        with agl.rollout_scope(rollout_id, "at-1"):
            await solve(fake_openai.base_url, f"agent_{number}", f"What is {number} plus 1?")

    async def main() -> None:
        await asyncio.gather(*(one(rollout_id, number) for rollout_id, number in rollouts.items()))

    asyncio.run(main())
    assert_rollouts_kept_apart(sink, rollouts)


# -- instrument / uninstrument -----------------------------------------------------------------------------

PATCHED = [
    (BaseChatAgent, "run"),
    (BaseChatAgent, "run_stream"),
    (BaseChatAgent, "on_messages_stream"),
    (AssistantAgent, "on_messages"),
    (AssistantAgent, "on_messages_stream"),
    (AssistantAgent, "_execute_tool_call"),
    (Summarizer, "on_messages"),
    (BaseGroupChat, "run_stream"),
    (SelectorGroupChatManager, "select_speaker"),
    (BaseTool, "run_json"),
    (FunctionTool, "run"),
    (UserProxyAgent, "_get_input"),
    (SendMessageEnvelope, "__init__"),
    (PublishMessageEnvelope, "__init__"),
    (SingleThreadedAgentRuntime, "_process_send"),
    (SingleThreadedAgentRuntime, "_process_publish"),
]


async def one_tool_turn(base_url: str) -> None:
    agent = AssistantAgent("calculator", model_client=model_client(base_url), tools=[add])
    await agent.run(task="What is 1 plus 2?")


def span_kinds(spans: Sequence[Span]) -> List[str]:
    return sorted(s.kind for s in spans)


def test_uninstrument_restores_autogen_exactly_and_keeps_the_users_own_wrappers(fake_openai, sink):
    agl.instrumentation.uninstrument()
    calls: List[str] = []

    def users_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(instance.name)
        return wrapped(*args, **kwargs)

    pristine = AssistantAgent.__dict__["on_messages"]
    wrapt.wrap_function_wrapper(AssistantAgent, "on_messages", users_wrapper)  # e.g. another tracer's
    try:
        originals = {(cls, attr): cls.__dict__[attr] for cls, attr in PATCHED}
        assert agl.instrument(frameworks=["autogen"]) == ["openai", "thread_pools", "autogen"]
        assert all(cls.__dict__[attr] is not originals[cls, attr] for cls, attr in PATCHED)
        assert span_kinds(sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))) == ["agent", "llm", "tool"]

        agl.uninstrument(frameworks=["autogen"])
        assert all(cls.__dict__[attr] is originals[cls, attr] for cls, attr in PATCHED)
        # The OpenAI layer is still on: the request is still an llm span, but nothing else of ours is left.
        assert span_kinds(sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))) == ["llm"]
        assert calls == ["calculator", "calculator"]  # the user's wrapper ran both times
    finally:
        AssistantAgent.on_messages = pristine
        agl.instrumentation.uninstrument()


def test_instrumenting_twice_equals_once(fake_openai, instrumented, sink):
    once = sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))
    assert span_kinds(once) == ["agent", "llm", "tool"]
    wrapped_once = {(cls, attr): cls.__dict__[attr] for cls, attr in PATCHED}
    assert agl.instrument(frameworks=["autogen"]) == ["openai", "thread_pools", "autogen"]
    assert all(cls.__dict__[attr] is wrapped_once[cls, attr] for cls, attr in PATCHED)  # no wrapper on a wrapper
    twice = sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))
    assert span_kinds(twice) == span_kinds(once)


def test_outside_the_supported_range_it_warns_once_and_patches_nothing(caplog):
    original = AssistantAgent.__dict__["on_messages_stream"]
    instrumentor = AutoGenInstrumentor()
    instrumentor.instruments = ("autogen-agentchat>=99",)
    with caplog.at_level(logging.WARNING, logger="agl.instrumentation"):
        assert instrumentor.instrument() is False
        assert instrumentor.instrument() is False
    assert len([r for r in caplog.records if "autogen-agentchat" in r.getMessage()]) == 1
    assert AssistantAgent.__dict__["on_messages_stream"] is original


def test_the_example_runs_as_its_docstring_says(dev_example) -> None:
    dev_example("autogen_agent.py:autogen_calc_agent", "^calculator$")


def test_a_second_autogen_instrumentor_shares_the_hooks(fake_openai, instrumented, sink):
    """agl.instrument() and a user's own AutoGenInstrumentor: before, the second stacked its wrappers on the
    first (every agent and tool span twice, and an internal error from the thread-pool hop)."""
    second = AutoGenInstrumentor()
    try:
        assert second.instrument()
        wrapped_once = {(cls, attr): cls.__dict__[attr] for cls, attr in PATCHED}
        assert span_kinds(sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))) == ["agent", "llm", "tool"]
        agl.instrumentation.uninstrument()  # agl's instance lets go; the user's still records
        agl.instrument(frameworks=[])  # the OpenAI client layer alone
        assert all(cls.__dict__[attr] is wrapped_once[cls, attr] for cls, attr in PATCHED)
        assert span_kinds(sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))) == ["agent", "llm", "tool"]
    finally:
        second.uninstrument()
    assert all(cls.__dict__[attr] is not wrapped_once[cls, attr] for cls, attr in PATCHED)  # the last let go
    assert span_kinds(sink.of(run_in_rollout(one_tool_turn(fake_openai.base_url)))) == ["llm"]
