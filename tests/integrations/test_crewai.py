"""The CrewAI adapter against real CrewAI, the real ``openai`` client and agl's local fake OpenAI server.

CrewAI's native OpenAI provider (``LLM(model=..., provider="openai")``) sends every model request through the
``openai`` client, so each request is one ``llm`` span; the adapter adds crew/task/flow chain spans, one
agent span per agent run (named by the agent's role) and tool spans, and carries the rollout into
CrewAI's worker threads.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import json
import logging
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # CrewAI's telemetry stays offline
crewai = pytest.importorskip("crewai")

from crewai import LLM, Agent, BaseLLM, Crew, Flow, Process, Task
from crewai.flow.flow import listen, start
from crewai.tools import tool

import agl
from agl import semconv
from agl._util.safety import internal_error_count
from agl.integrations.crewai import (
    _TARGETS,
    _THREAD_HOPS,
    CrewAIInstrumentor,
    _wrappers,
    resolve_target,
)
from agl.lightningrl.agent_match import agent_name_of, select_llm_calls
from agl.lightningrl.air import AIRConfig, air_rewards
from agl.lightningrl.links import CallLinks
from agl.lightningrl.tree import build_tree
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply, assert_tool_reward_credited
from agl.tracing.context import rollout_scope
from agl.types import Span

pytestmark = [
    pytest.mark.framework("crewai"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:crewai.*"),  # CrewAI's own internal ones
]
CREWAI_VERSION = tuple(int(part) for part in importlib.metadata.version("crewai").split(".")[:2])


# -- the app under test ---------------------------------------------------------------------------------------
@tool("add")
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool("add_and_finish", result_as_answer=True)
def add_and_finish(a: int, b: int) -> int:
    """Add two integers; the sum is the agent's answer (one model request per agent run)."""
    return a + b


@tool("explode")
def explode(text: str) -> str:
    """A tool that always fails."""
    raise ValueError(f"boom: {text}")


def fake_llm(base_url: str, **options: Any) -> LLM:
    """CrewAI's native OpenAI provider (no LiteLLM); ``provider=`` because CrewAI 1.10 only routes known
    OpenAI model names given as ``openai/<model>`` to it."""
    return LLM(model="fake-model", provider="openai", base_url=base_url, api_key="x", **options)


def script_add(fake_openai: FakeOpenAIServer, a: int, b: int) -> None:
    """The model calls ``add(a, b)``, then answers with the sum.

    Scripted, not left to the fake's default policy: CrewAI 1.10 follows every native tool result with a
    user message ("Analyze the tool result...") after which the default policy would call the tool again.
    """
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "add", "arguments": {"a": a, "b": b}}]),
        FakeReply(content=f"The answer is {a + b}."),
    )


def solo_crew(llm: LLM, role: str, question: str, tools: Sequence[Any] = (add,), **agent_options: Any) -> Crew:
    agent = Agent(role=role, goal="Answer exactly.", backstory="Careful.", llm=llm, tools=list(tools), **agent_options)
    return Crew(agents=[agent], tasks=[Task(description=question, expected_output="a number", agent=agent)])


def writer_checker_crew(llm: LLM, question: str) -> Crew:
    """Two differently named agents, one tool: the multi-agent app of the agent_match acceptance test."""
    writer = Agent(role="Writer", goal="Answer.", backstory="Uses tools.", llm=llm, tools=[add])
    checker = Agent(role="Checker", goal="Check.", backstory="Reads.", llm=llm)
    return Crew(
        agents=[writer, checker],
        tasks=[
            Task(description=question, expected_output="a number", agent=writer),
            Task(description="Check the previous answer.", expected_output="ok or wrong", agent=checker),
        ],
    )


@pytest.fixture(scope="module", autouse=True)
def _crewai_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """CrewAI keeps SQLite files (task outputs, memory) under the user's data dir; tests keep theirs apart,
    also from other CrewAI versions (1.10 cannot read the table 1.15 writes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("crewai-data")))
        yield


# -- span helpers ---------------------------------------------------------------------------------------------
@pytest.fixture
def instrumented() -> Iterator[None]:
    agl.uninstrument()  # another test module may have left something on
    assert agl.instrument(["crewai"]) == ["openai", "thread_pools", "crewai"]
    yield
    agl.uninstrument()


def kind(spans: Sequence[Span], k: str) -> List[Span]:
    return [s for s in spans if s.kind == k]


def agent_of(span: Span, spans: Sequence[Span]) -> Optional[str]:
    return agent_name_of(span, {s.span_id: s for s in spans})


def ancestors(span: Span, spans: Sequence[Span]) -> List[Span]:
    index = {s.span_id: s for s in spans}
    chain = []
    while span.parent_id in index:
        span = index[span.parent_id]
        chain.append(span)
    return chain


def prompt_text(span: Span) -> str:
    return span.attributes[semconv.INPUT_MESSAGES]


def assert_llm_spans_complete(spans: Sequence[Span], n_requests: int) -> None:
    """Exactly one llm span per HTTP request, each with the server's token ids."""
    llm = kind(spans, "llm")
    assert len(llm) == n_requests
    for span in llm:
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]


def air_per_call(spans: Sequence[Span]) -> List[Dict[str, float]]:
    """AIR's rewards (default weights) for each llm span, in order: what LightningRL would add to each call."""
    calls = [s.span_id for s in kind(spans, "llm")]
    rewards = air_rewards(CallLinks(build_tree(spans)), calls, AIRConfig())
    return [rewards.get(call, {}) for call in calls]


def tool_messages(request: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The tool results a chat.completions request sent the model."""
    return [m for m in request["body"]["messages"] if m["role"] == "tool"]


def crewai_agent_names(spans: Sequence[Span]) -> List[str]:
    return [
        s.attributes[semconv.AGENT_NAME]
        for s in kind(spans, "agent")
        if s.attributes.get(semconv.FRAMEWORK) == "crewai"
    ]


# -- the acceptance test: a real rollout into SQLite, agent_match picks one agent's calls ----------------------
def test_agent_match_selects_exactly_the_writers_calls(
    tmp_path: Any, fake_openai: FakeOpenAIServer, instrumented: None
) -> None:
    @agl.rollout
    def writer_checker(task: Dict[str, Any], llm: agl.LLM) -> float:
        crew = writer_checker_crew(fake_llm(llm.get_base_url()), task["question"])
        crew.kickoff()
        return 1.0 if str(task["answer"]) in crew.tasks[0].output.raw else 0.0

    script_add(fake_openai, 2, 3)
    fake_openai.script(FakeReply(content="ok"))  # the Checker
    db = tmp_path / "crewai.db"
    trainer = agl.Trainer(
        store=str(db),
        runner_mode="thread",
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="fake-model")},
        progress=False,
    )
    (row,) = trainer.dev(writer_checker, [{"question": "What is 2 plus 3?", "answer": 5}], print_table=False)
    assert row.status == "succeeded" and row.reward == 1.0, row
    store = SqliteLightningStore(db)
    spans = store.query_spans(row.rollout_id)
    store.close()

    assert_llm_spans_complete(spans, len(fake_openai.requests))
    assert len(fake_openai.requests) == 3  # Writer: tool call, answer; Checker: answer
    assert crewai_agent_names(spans) == ["Writer", "Checker"]
    writer_calls = select_llm_calls(spans, "^Writer$")
    checker_calls = select_llm_calls(spans, "^Checker$")
    assert len(writer_calls) == 2 and len(checker_calls) == 1
    assert all(
        "What is 2 plus 3?" in prompt_text(s) and "Check the previous" not in prompt_text(s) for s in writer_calls
    )
    assert "Check the previous answer." in prompt_text(checker_calls[0])
    assert {s.span_id for s in writer_calls + checker_calls} == {s.span_id for s in kind(spans, "llm")}

    (tool_span,) = kind(spans, "tool")
    assert agent_of(tool_span, spans) == "Writer"
    assert tool_span.attributes[semconv.TOOL_NAME] == "add"
    assert json.loads(tool_span.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert tool_span.attributes[semconv.TOOL_CALL_RESULT] == 5
    requested = json.loads(writer_calls[0].attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"][0]
    assert tool_span.attributes[semconv.TOOL_CALL_ID] == requested["id"]

    (writer_span,) = [s for s in kind(spans, "agent") if s.attributes[semconv.AGENT_NAME] == "Writer"]
    chain = [s.name for s in ancestors(writer_span, spans)]
    assert chain == ["task What is 2 plus 3?", "crew crew", "agl.rollout"]


# -- tools -------------------------------------------------------------------------------------------------------
def test_a_tool_that_raises_gets_an_error_status(fake_openai: FakeOpenAIServer, instrumented: None, sink: Any) -> None:
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "explode", "arguments": {"text": "hi"}}]), FakeReply(content="Sorry.")
    )
    with rollout_scope("ro-tool-error", "at-1"):
        solo_crew(fake_llm(fake_openai.base_url), "Solver", "Say hi", tools=[explode]).kickoff()
    spans = sink.of("ro-tool-error")
    (span,) = kind(spans, "tool")
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "ValueError"
    assert span.error == "ValueError: boom: hi"
    assert span.attributes[semconv.TOOL_CALL_ID] and agent_of(span, spans) == "Solver"
    assert semconv.TOOL_CALL_RESULT not in span.attributes
    assert_llm_spans_complete(spans, len(fake_openai.requests))


def test_a_call_of_a_tool_the_agent_lacks_is_an_error_tool_span_that_air_penalises(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    """The model names a tool the agent was not given: CrewAI answers "Tool not found" without running any
    tool. The call still gets a failed tool span (as under AutoGen), so AIR gives it air.tool_error."""
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "multiply", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="6")
    )
    with rollout_scope("ro-unknown-tool", "at-1"):
        solo_crew(fake_llm(fake_openai.base_url), "Solver", "What is 2 times 3?").kickoff()
    spans = sink.of("ro-unknown-tool")
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    (told,) = tool_messages(fake_openai.requests[1])  # what CrewAI told the model
    (span,) = kind(spans, "tool")
    assert span.name == "execute_tool multiply" and span.attributes[semconv.TOOL_NAME] == "multiply"
    assert json.loads(span.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert span.attributes[semconv.TOOL_CALL_ID] == told["tool_call_id"]
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "_OTHER"  # as AutoGen's adapter
    assert span.error == span.attributes[semconv.TOOL_CALL_RESULT] == told["content"]
    (agent,) = kind(spans, "agent")
    assert span.parent_id == agent.span_id and agent.status != "error"
    assert air_per_call(spans) == [{"air.tool_error": AIRConfig().tool_error}, {}]


@pytest.mark.skipif(CREWAI_VERSION < (1, 15), reason="CrewAI 1.10 gives no structured failure for a spent tool")
def test_a_call_of_a_spent_tool_is_an_error_tool_span(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    """A tool past its ``max_usage_count`` is not run: CrewAI says so to the model, and the call fails."""
    once = add.model_copy(update={"max_usage_count": 1, "current_usage_count": 0})
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 1, "b": 2}}]),
        FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 3, "b": 4}}]),
        FakeReply(content="3"),
    )
    with rollout_scope("ro-spent-tool", "at-1"):
        solo_crew(fake_llm(fake_openai.base_url), "Solver", "Add twice.", tools=[once]).kickoff()
    spans = sink.of("ro-spent-tool")
    first, second = kind(spans, "tool")
    assert first.status != "error" and first.attributes[semconv.TOOL_CALL_RESULT] == 3
    assert second.status == "error" and second.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert "usage limit" in second.error and second.error == tool_messages(fake_openai.requests[2])[-1]["content"]
    assert json.loads(second.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 3, "b": 4}
    assert air_per_call(spans)[1] == {"air.tool_error": AIRConfig().tool_error}


def react_llm(base_url: str, monkeypatch: pytest.MonkeyPatch) -> LLM:
    """A model CrewAI drives with text (ReAct) tool calling: one it thinks cannot call functions natively."""
    llm = fake_llm(base_url)
    monkeypatch.setattr(type(llm), "supports_function_calling", lambda self: False)
    return llm


def react_action(tool_name: str, arguments: Dict[str, Any]) -> FakeReply:
    return FakeReply(content=f"Thought: I use a tool.\nAction: {tool_name}\nAction Input: {json.dumps(arguments)}")


FINAL_6 = FakeReply(content="Thought: I now know the final answer\nFinal Answer: 6")


def test_a_text_action_naming_a_tool_the_agent_lacks_is_an_error_tool_span_that_air_penalises(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ReAct: the model writes ``Action: multiply`` when the agent only has ``add``. CrewAI runs no tool and
    answers an error as the observation; the action still gets a failed tool span, credited by AIR to the
    model call that wrote it. A known tool in the same run is an ordinary tool span."""
    fake_openai.script(
        react_action("multiply", {"a": 2, "b": 3}),
        react_action("add", {"a": 2, "b": 4}),
        FINAL_6,
    )
    llm = react_llm(fake_openai.base_url, monkeypatch)
    with rollout_scope("ro-react-unknown", "at-1"):
        result = solo_crew(llm, "Solver", "What is 2 times 3?").kickoff()
    assert "6" in result.raw
    assert all("tools" not in r["body"] for r in fake_openai.requests)  # text tool calling indeed
    spans = sink.of("ro-react-unknown")
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    unknown, known = kind(spans, "tool")
    assert unknown.name == "execute_tool multiply" and unknown.attributes[semconv.TOOL_NAME] == "multiply"
    assert json.loads(unknown.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert unknown.status == "error" and unknown.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert unknown.error == unknown.attributes[semconv.TOOL_CALL_RESULT]
    told = "\n".join(str(m["content"]) for m in fake_openai.requests[1]["body"]["messages"])
    assert "Action 'multiply' don't exist" in unknown.error and unknown.error in told  # the observation
    assert known.status != "error" and known.attributes[semconv.TOOL_CALL_RESULT] == 6
    (agent,) = kind(spans, "agent")
    assert unknown.parent_id == agent.span_id and agent.status != "error"
    assert air_per_call(spans) == [{"air.tool_error": AIRConfig().tool_error}, {}, {}]


def test_a_text_action_whose_input_does_not_parse_is_an_error_tool_span(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ReAct: an ``Action Input`` CrewAI cannot read as arguments runs no tool either (the same answer)."""
    fake_openai.script(
        FakeReply(content="Thought: I add.\nAction: add\nAction Input: two and four"),
        FINAL_6,
    )
    with rollout_scope("ro-react-bad-input", "at-1"):
        solo_crew(react_llm(fake_openai.base_url, monkeypatch), "Solver", "What is 2 plus 4?").kickoff()
    spans = sink.of("ro-react-bad-input")
    (span,) = kind(spans, "tool")
    assert span.name == "execute_tool add" and span.status == "error"
    assert span.attributes[semconv.TOOL_CALL_ARGUMENTS] == "two and four"
    assert air_per_call(spans) == [{"air.tool_error": AIRConfig().tool_error}, {}]


def failing_lookup() -> Any:
    """A tool that fails by *returning* CrewAI 1.15's ToolFailure (no exception)."""
    from crewai.tools.tool_failure import ToolFailure

    @tool("lookup")
    def lookup(key: str) -> Any:
        """Look a key up."""
        return ToolFailure(message=f"no entry for {key}", code="not_found")

    return lookup


@pytest.mark.skipif(CREWAI_VERSION < (1, 15), reason="ToolFailure is new in CrewAI 1.15")
@pytest.mark.parametrize("text_calling", [False, True])
def test_a_tool_returning_a_tool_failure_is_an_error_tool_span(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, monkeypatch: pytest.MonkeyPatch, text_calling: bool
) -> None:
    first = (
        react_action("lookup", {"key": "x"})
        if text_calling
        else FakeReply(tool_calls=[{"name": "lookup", "arguments": {"key": "x"}}])
    )
    fake_openai.script(first, FINAL_6 if text_calling else FakeReply(content="6"))
    llm = react_llm(fake_openai.base_url, monkeypatch) if text_calling else fake_llm(fake_openai.base_url)
    rollout_id = f"ro-tool-failure-{text_calling}"
    with rollout_scope(rollout_id, "at-1"):
        solo_crew(llm, "Solver", "Look x up.", tools=[failing_lookup()]).kickoff()
    spans = sink.of(rollout_id)
    (span,) = kind(spans, "tool")
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert span.error == span.attributes[semconv.TOOL_CALL_RESULT] == "no entry for x (code: not_found)"
    if not text_calling:
        assert tool_messages(fake_openai.requests[1])[0]["content"] == span.error
    assert air_per_call(spans) == [{"air.tool_error": AIRConfig().tool_error}, {}]


@pytest.mark.skipif(CREWAI_VERSION < (1, 15), reason="tool_failure_policy is new in CrewAI 1.15")
@pytest.mark.parametrize("text_calling", [False, True])
def test_an_unknown_tool_under_the_raise_policy_is_an_error_tool_span_before_the_run_aborts(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, monkeypatch: pytest.MonkeyPatch, text_calling: bool
) -> None:
    from crewai.tools.tool_failure import ToolExecutionFailedError

    first = (
        react_action("multiply", {"a": 2, "b": 3})
        if text_calling
        else FakeReply(tool_calls=[{"name": "multiply", "arguments": {"a": 2, "b": 3}}])
    )
    fake_openai.script(first)
    llm = react_llm(fake_openai.base_url, monkeypatch) if text_calling else fake_llm(fake_openai.base_url)
    rollout_id = f"ro-raise-{text_calling}"
    crew = solo_crew(llm, "Solver", "What is 2 times 3?", tool_failure_policy="raise")
    with rollout_scope(rollout_id, "at-1"), pytest.raises(ToolExecutionFailedError):
        crew.kickoff()
    assert len(fake_openai.requests) == 1
    spans = sink.of(rollout_id)
    (span,) = kind(spans, "tool")
    assert span.name == "execute_tool multiply" and span.status == "error"
    assert span.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert json.loads(span.attributes[semconv.TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    (agent,) = kind(spans, "agent")
    assert span.parent_id == agent.span_id and agent.status == "error"
    assert air_per_call(spans) == [{"air.tool_error": AIRConfig().tool_error}]


@pytest.mark.skipif(CREWAI_VERSION < (1, 15), reason="the planning StepExecutor is new in CrewAI 1.15")
def test_native_calls_of_a_planned_step_have_call_ids_and_an_unknown_tool_fails(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    """``Agent(planning=True)``: CrewAI plans, then runs each step in its ``StepExecutor``, which executes
    native tool calls with a function of its own. Its tool spans get the model's call ids, and a call of a
    tool the agent lacks is an error tool span there too."""
    plan = {
        "plan": "Multiply, then add.",
        "steps": [{"step_number": 1, "description": "Compute", "tool_to_use": "add", "depends_on": []}],
        "ready": True,
    }
    calls = [{"name": "multiply", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1, "b": 5}}]
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "create_reasoning_plan", "arguments": plan}]),  # the planner
        FakeReply(tool_calls=calls),  # the step
        FakeReply(content="6"),  # the step's answer
        FakeReply(content="6"),  # the synthesis of the steps
    )
    llm = fake_llm(fake_openai.base_url)
    agent = Agent(role="Planner", goal="Answer.", backstory="Plans.", llm=llm, tools=[add], planning=True)
    crew = Crew(agents=[agent], tasks=[Task(description="What is 2 times 3?", expected_output="a number", agent=agent)])
    with rollout_scope("ro-step-executor", "at-1"):
        assert "6" in crew.kickoff().raw
    assert len(fake_openai.requests) == 4
    spans = sink.of("ro-step-executor")
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    told = {m["tool_call_id"]: m["content"] for m in tool_messages(fake_openai.requests[2])}
    unknown, known = kind(spans, "tool")
    assert unknown.name == "execute_tool multiply" and unknown.status == "error"
    assert unknown.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert unknown.error == told[unknown.attributes[semconv.TOOL_CALL_ID]] == "Tool not found"
    assert known.status != "error" and told[known.attributes[semconv.TOOL_CALL_ID]] == "6"
    assert {agent_of(s, spans) for s in (unknown, known)} == {"Planner"}
    assert air_per_call(spans) == [{}, {"air.tool_error": AIRConfig().tool_error}, {}, {}]


def test_delegating_to_a_coworker_that_does_not_exist_is_an_error_tool_span(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    """The manager of a hierarchical crew delegates to a role no agent has: CrewAI's delegation tool returns
    its "coworker mentioned not found" text (no exception, no structured failure), which agl recognises by
    CrewAI's own template. A delegation that reaches a coworker is not an error."""
    llm = fake_llm(fake_openai.base_url)
    delegate = "delegate_work_to_coworker"
    fake_openai.script(
        FakeReply(tool_calls=[{"name": delegate, "arguments": {"task": "2+3?", "context": "c", "coworker": "Nobody"}}]),
        FakeReply(tool_calls=[{"name": delegate, "arguments": {"task": "2+3?", "context": "c", "coworker": "Writer"}}]),
        FakeReply(content="5"),  # the writer
        FakeReply(content="5"),  # the manager
    )
    writer = Agent(role="Writer", goal="Answer.", backstory="Careful.", llm=llm)
    crew = Crew(
        agents=[writer],
        tasks=[Task(description="What is 2 plus 3?", expected_output="a number")],
        process=Process.hierarchical,
        manager_llm=llm,
    )
    with rollout_scope("ro-bad-coworker", "at-1"):
        crew.kickoff()
    spans = sink.of("ro-bad-coworker")
    missing, found = kind(spans, "tool")
    told = tool_messages(fake_openai.requests[1])[-1]["content"]
    assert missing.status == "error" and missing.attributes[semconv.ERROR_TYPE] == "_OTHER"
    assert "coworker mentioned not found" in told and missing.error == told
    assert missing.attributes[semconv.TOOL_CALL_RESULT] == told
    assert found.status != "error" and agent_of(found, spans) == "Crew Manager"
    manager_calls = [s for s in kind(spans, "llm") if agent_of(s, spans) == "Crew Manager"]
    rewards = dict(zip([s.span_id for s in kind(spans, "llm")], air_per_call(spans)))
    assert [rewards[s.span_id] for s in manager_calls] == [{"air.tool_error": AIRConfig().tool_error}, {}, {}]


def test_an_agent_on_litellm_is_warned_about_once(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """LiteLLM (current versions post with the openai client's low-level post) makes no llm spans: the
    rollout succeeded with nothing to train on and nothing said so. The flag CrewAI sets on such a model
    (``is_litellm``) is what agl reads; LiteLLM itself is not installed here."""
    from agl.integrations.crewai import _wrappers

    monkeypatch.setattr(_wrappers, "_warned_routes", set())
    llm = fake_llm(fake_openai.base_url)
    llm.is_litellm = True
    fake_openai.script(FakeReply(content="1"), FakeReply(content="2"))
    with caplog.at_level("WARNING", logger="agl.integrations.crewai"), rollout_scope("ro-litellm", "at-1"):
        solo_crew(llm, "Solver", "Say 1", tools=[]).kickoff()
        solo_crew(llm, "Solver", "Say 2", tools=[]).kickoff()
    warned = [r.getMessage() for r in caplog.records if "LiteLLM" in r.getMessage()]
    assert len(warned) == 1 and "'Solver'" in warned[0] and 'provider="openai"' in warned[0]


class CannedLLM(BaseLLM):
    """A model of one's own (CrewAI's ``BaseLLM``) that answers without the openai client: agl cannot see it."""

    def call(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        return "1"


def test_an_agent_on_a_custom_base_llm_is_warned_about_once(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """A custom ``BaseLLM`` that does not call the openai client made no llm span, and nothing said so (agl
    warned only for LiteLLM): it is warned about once too, naming the agent and the class. CrewAI's own
    native OpenAI provider, a ``BaseLLM`` as well, is not."""
    monkeypatch.setattr(_wrappers, "_warned_routes", set())
    fake_openai.script(FakeReply(content="1"))

    def agls() -> List[str]:
        return [r.getMessage() for r in caplog.records if r.name == "agl.integrations.crewai"]

    with caplog.at_level("WARNING", logger="agl.integrations.crewai"), rollout_scope("ro-custom-llm", "at-1"):
        solo_crew(fake_llm(fake_openai.base_url), "Native", "Say 1", tools=[]).kickoff()
        assert agls() == []
        for question in ("Say 1", "Say 2"):
            solo_crew(CannedLLM(model="canned"), "Canned", question, tools=[]).kickoff()
    (warned,) = agls()
    assert warned.startswith("CrewAI agent 'Canned' calls its model through CannedLLM, a custom BaseLLM")
    assert 'provider="openai"' in warned
    spans = sink.of("ro-custom-llm")
    assert [agent_of(s, spans) for s in kind(spans, "llm")] == ["Native"]  # the canned answers left no span


@tool("graded_add")
def graded_add(a: int, b: int) -> int:
    """Add two integers (and grade the call)."""
    agl.emit_reward(0.5)
    return a + b


def test_a_reward_emitted_in_a_tool_is_a_step_reward_for_the_call_that_asked_for_it(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "graded_add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5")
    )
    with rollout_scope("ro-tool-reward", "at-1"):
        solo_crew(fake_llm(fake_openai.base_url), "Solver", "What is 2 + 3?", tools=[graded_add]).kickoff()
    assert_tool_reward_credited(sink.of("ro-tool-reward"), 0.5)


def test_direct_and_structured_tool_calls_make_one_span_each(instrumented: None, sink: Any) -> None:
    with rollout_scope("ro-tools", "at-1"):
        assert add.run(a=1, b=2) == 3
        assert add.to_structured_tool().invoke({"a": 4, "b": 5}) == 9  # the ReAct path
    spans = kind(sink.of("ro-tools"), "tool")
    assert [json.loads(s.attributes[semconv.TOOL_CALL_ARGUMENTS]) for s in spans] == [
        {"a": 1, "b": 2},
        {"a": 4, "b": 5},
    ]
    assert [s.attributes[semconv.TOOL_CALL_RESULT] for s in spans] == [3, 9]


# -- both OpenAI APIs, plain and streamed -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "api, stream, tools",
    [
        ("completions", False, [add]),
        ("completions", True, [add]),
        pytest.param(
            "responses",
            False,
            [add],
            marks=pytest.mark.skipif(
                CREWAI_VERSION < (1, 15), reason="CrewAI 1.10 returns Responses function calls as the answer text"
            ),
        ),
        # CrewAI's streamed Responses path drops function calls (it returns the empty text): no tools there.
        ("responses", True, []),
    ],
)
def test_every_api_and_stream_mode_nests_llm_spans_in_the_agent(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, api: str, stream: bool, tools: List[Any]
) -> None:
    rollout_id = f"ro-{api}-{stream}"
    if tools:
        script_add(fake_openai, 20, 22)
    llm = fake_llm(fake_openai.base_url, api=api, stream=stream)
    with rollout_scope(rollout_id, "at-1"):
        result = solo_crew(llm, "Solver", "What is 20 plus 22?", tools=tools).kickoff()
    assert ("42" in result.raw) == bool(tools)
    spans = sink.of(rollout_id)
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    assert len(fake_openai.requests) == (2 if tools else 1)
    assert {r["path"] for r in fake_openai.requests} == {
        "/v1/responses" if api == "responses" else "/v1/chat/completions"
    }
    for span in kind(spans, "llm"):
        assert span.attributes[semconv.LLM_API] == ("responses" if api == "responses" else "chat.completions")
        assert span.attributes[semconv.LLM_STREAM] is stream
        assert agent_of(span, spans) == "Solver"
    assert len(kind(spans, "tool")) == len(tools)


# -- concurrency: rollouts in threads and asyncio tasks, CrewAI's own worker threads --------------------------
def test_concurrent_rollouts_in_threads_keep_their_spans(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    fake_openai.script(*[FakeReply(delay=0.2)] * 2)  # default answers, slow enough for the two to overlap
    llm = fake_llm(fake_openai.base_url)
    barrier = threading.Barrier(2)

    def run(role: str) -> None:
        barrier.wait(5)
        solo_crew(llm, role, "What is 1 plus 2?", tools=[add_and_finish]).kickoff()

    threads = []
    for role in ("Alpha", "Beta"):
        with rollout_scope(f"ro-thread-{role}", "at-1"):
            threads.append(threading.Thread(target=agl.propagate(run), args=(role,)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for role in ("Alpha", "Beta"):
        spans = sink.of(f"ro-thread-{role}")
        assert crewai_agent_names(spans) == [role]
        assert len(kind(spans, "llm")) == 1 and len(kind(spans, "tool")) == 1
        assert {agent_of(s, spans) for s in kind(spans, "llm") + kind(spans, "tool")} == {role}
    assert len(fake_openai.requests) == 2


def test_concurrent_rollouts_in_asyncio_tasks_keep_their_spans(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    llm = fake_llm(fake_openai.base_url)

    async def one(role: str, native_async: bool) -> None:
        with rollout_scope(f"ro-async-{role}", "at-1"):
            crew = solo_crew(llm, role, "What is 3 plus 4?", tools=[add_and_finish])
            await (crew.akickoff() if native_async else crew.kickoff_async())

    async def both() -> None:
        await asyncio.gather(one("Native", True), one("Threaded", False))

    asyncio.run(both())
    for role in ("Native", "Threaded"):
        spans = sink.of(f"ro-async-{role}")
        assert crewai_agent_names(spans) == [role]
        assert len(kind(spans, "llm")) == 1 and len(kind(spans, "tool")) == 1
        assert {agent_of(s, spans) for s in kind(spans, "llm") + kind(spans, "tool")} == {role}
        assert [s.name for s in kind(spans, "chain")] == ["crew crew", "task What is 3 plus 4?"]
    assert len(fake_openai.requests) == 2


def test_crewais_worker_threads_stay_in_the_rollout(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    """max_execution_time (agent runs in a pool), async_execution (a thread), parallel tool calls (a pool)."""
    parallel = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]
    fake_openai.script(FakeReply(tool_calls=parallel), FakeReply(content="3 and 7"))
    llm = fake_llm(fake_openai.base_url)
    agent = Agent(role="Timed", goal="Add.", backstory="Quick.", llm=llm, tools=[add], max_execution_time=30)
    # a YAML "|" description spans lines; the task span's name is one line (it used to keep the newlines)
    task = Task(description="Add 1 and 2,\n  and 3 and 4.\n", expected_output="sums", agent=agent, async_execution=True)
    with rollout_scope("ro-pools", "at-1"):
        Crew(agents=[agent], tasks=[task]).kickoff()
    spans = sink.of("ro-pools")
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    tools = kind(spans, "tool")
    assert sorted(s.attributes[semconv.TOOL_CALL_RESULT] for s in tools) == [3, 7]
    for span in kind(spans, "llm") + tools:
        assert [a.name for a in ancestors(span, spans)] == [
            "invoke_agent Timed",
            "task Add 1 and 2, and 3 and 4.",
            "crew crew",
        ]


def test_a_streaming_crew_stays_in_the_rollout(fake_openai: FakeOpenAIServer, instrumented: None, sink: Any) -> None:
    """Crew(stream=True) runs the crew in a thread started when the stream is read; chunks still arrive."""
    script_add(fake_openai, 1, 2)
    crew = solo_crew(fake_llm(fake_openai.base_url), "Streamer", "What is 1 plus 2?")
    crew.stream = True
    with rollout_scope("ro-crew-stream", "at-1"):
        streaming = crew.kickoff()
        chunks = list(streaming)
    assert chunks and "3" in streaming.result.raw
    spans = sink.of("ro-crew-stream")
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    for span in kind(spans, "llm") + kind(spans, "tool"):
        assert [a.name for a in ancestors(span, spans)] == [
            "invoke_agent Streamer",
            "task What is 1 plus 2?",
            "crew crew",
        ]


# -- flows and standalone agents -----------------------------------------------------------------------------------
@pytest.mark.parametrize("inside_loop", [False, True])
def test_flow_methods_are_agents_and_crews_nest_inside(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, inside_loop: bool
) -> None:
    llm = fake_llm(fake_openai.base_url)

    class PlanThenSolve(Flow):
        @start()
        def plan(self) -> str:
            return llm.call("Plan how to add 5 and 6.")

        @listen(plan)
        def solve(self, plan: str) -> str:
            return solo_crew(llm, "Solver", "What is 5 plus 6?").kickoff().raw

    fake_openai.script(FakeReply())  # plan: the default answer
    script_add(fake_openai, 5, 6)

    async def kickoff_in_a_running_loop() -> Any:
        return PlanThenSolve().kickoff()  # older CrewAI hops to a pool thread here

    rollout_id = f"ro-flow-{inside_loop}"
    with rollout_scope(rollout_id, "at-1"):
        result = asyncio.run(kickoff_in_a_running_loop()) if inside_loop else PlanThenSolve().kickoff()
    assert "11" in result
    spans = sink.of(rollout_id)
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    assert crewai_agent_names(spans) == ["plan", "solve", "Solver"]
    assert ["Plan how to add" in prompt_text(s) for s in select_llm_calls(spans, "^plan$")] == [True]
    assert len(select_llm_calls(spans, "^Solver$")) == 2 and not select_llm_calls(spans, "^solve$")
    (solver,) = [s for s in kind(spans, "agent") if s.attributes[semconv.AGENT_NAME] == "Solver"]
    assert [a.name for a in ancestors(solver, spans)] == [
        "task What is 5 plus 6?",
        "crew crew",
        "invoke_agent solve",
        "flow PlanThenSolve",
    ]


def test_a_standalone_agent_kickoff_is_an_agent_span(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any
) -> None:
    agent = Agent(role="Solo", goal="Add.", backstory="Alone.", llm=fake_llm(fake_openai.base_url), tools=[add])
    script_add(fake_openai, 7, 8)
    with rollout_scope("ro-solo", "at-1"):
        agent.kickoff("What is 7 plus 8?")
    spans = sink.of("ro-solo")
    assert crewai_agent_names(spans) == ["Solo"]
    assert_llm_spans_complete(spans, len(fake_openai.requests))
    assert {agent_of(s, spans) for s in kind(spans, "llm") + kind(spans, "tool")} == {"Solo"}


# -- instrumentor contract ----------------------------------------------------------------------------------------
def _patched_attributes() -> Dict[str, Any]:
    """``module:Class.method`` -> the object on the class now, for every target present in this version."""
    found = {}
    for module, name, _ in _TARGETS + _THREAD_HOPS:
        target = resolve_target(module, name)
        if target is not None:
            owner: Any = importlib.import_module(target[0])
            class_path, _, attr = target[1].rpartition(".")
            if class_path:
                owner = getattr(owner, class_path)
            found[f"{target[0]}:{target[1]}"] = vars(owner)[attr]
    return found


def _span_counts(spans: Sequence[Span]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for span in spans:
        counts[span.kind] = counts.get(span.kind, 0) + 1
    return counts


def test_uninstrument_restores_crewai_exactly(fake_openai: FakeOpenAIServer, sink: Any) -> None:
    from crewai.events import crewai_event_bus

    agl.uninstrument()
    before = _patched_attributes()
    handlers_before = dict(crewai_event_bus._sync_handlers)
    assert len(before) >= 15  # crew, task, agent, flow, tool methods and the thread hops exist
    inst = CrewAIInstrumentor()
    assert inst.instrument()
    during = _patched_attributes()
    assert all(during[key] is not before[key] for key in before)
    stale_run = add.run  # bound while hooked, as CrewAI's executors keep them
    inst.uninstrument()
    after = _patched_attributes()
    assert all(after[key] is before[key] for key in before)
    assert dict(crewai_event_bus._sync_handlers) == handlers_before

    agl.instrument([])  # the OpenAI client only
    try:
        script_add(fake_openai, 1, 1)
        with rollout_scope("ro-unhooked", "at-1"):
            solo_crew(fake_llm(fake_openai.base_url), "Solver", "What is 1 plus 1?").kickoff()
            assert stale_run(a=1, b=1) == 2
    finally:
        agl.uninstrument()
    spans = sink.of("ro-unhooked")
    assert _span_counts(spans) == {"llm": 2}


def test_instrumenting_twice_equals_once(fake_openai: FakeOpenAIServer, instrumented: None, sink: Any) -> None:
    llm = fake_llm(fake_openai.base_url)
    script_add(fake_openai, 1, 1)
    with rollout_scope("ro-once", "at-1"):
        solo_crew(llm, "Solver", "What is 1 plus 1?").kickoff()
    second = CrewAIInstrumentor()
    assert agl.instrument(["crewai"]) == ["openai", "thread_pools", "crewai"] and second.instrument()
    script_add(fake_openai, 1, 1)
    with rollout_scope("ro-twice", "at-1"):
        solo_crew(llm, "Solver", "What is 1 plus 1?").kickoff()
    second.uninstrument()  # it hooked nothing, so it unhooks nothing
    script_add(fake_openai, 1, 1)
    with rollout_scope("ro-after-second", "at-1"):
        solo_crew(llm, "Solver", "What is 1 plus 1?").kickoff()
    once = _span_counts(sink.of("ro-once"))
    assert once == {"chain": 2, "agent": 1, "llm": 2, "tool": 1}
    assert _span_counts(sink.of("ro-twice")) == once == _span_counts(sink.of("ro-after-second"))


def test_outside_the_supported_range_it_warns_once_and_hooks_nothing(caplog: pytest.LogCaptureFixture) -> None:
    class FutureOnly(CrewAIInstrumentor):
        instruments = ("crewai>=99",)

    agl.uninstrument()
    before = _patched_attributes()
    inst = FutureOnly()
    with caplog.at_level(logging.WARNING, logger="agl.instrumentation"):
        assert not inst.instrument() and not inst.instrument()
    assert len([r for r in caplog.records if "outside the supported range" in r.getMessage()]) == 1
    assert _patched_attributes() == before


def test_an_adapter_bug_never_reaches_the_user(
    fake_openai: FakeOpenAIServer, instrumented: None, sink: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(agent: Any) -> str:
        raise RuntimeError("adapter bug")

    monkeypatch.setattr(_wrappers, "agent_name", broken)
    errors_before = internal_error_count("crewai.open_span")
    script_add(fake_openai, 2, 2)
    with rollout_scope("ro-bug", "at-1"):
        result = solo_crew(fake_llm(fake_openai.base_url), "Solver", "What is 2 plus 2?").kickoff()
    assert "4" in result.raw
    assert internal_error_count("crewai.open_span") > errors_before
    spans = sink.of("ro-bug")
    assert crewai_agent_names(spans) == [] and len(kind(spans, "tool")) == 1
    assert_llm_spans_complete(spans, len(fake_openai.requests))


def test_the_example_runs_as_its_docstring_says(dev_example: Any) -> None:
    dev_example("crewai_agent.py:crewai_calc_agent", "^Calculator$")
