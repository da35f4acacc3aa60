"""APO end to end: real runner threads, a real SQLite store, the agent's model and the optimizer model both
real OpenAI-compatible HTTP servers on 127.0.0.1 (the optimizer's replies scripted)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import openai
import pytest
from test_apo_robustness import apo_trainer, transcript_span

import agl
from agl.algorithm.apo import APO, APOError, transcript
from agl.testing.fake_openai import FakeOpenAIServer
from agl.testing.fake_policy import FakeReply

TASKS = [{"task_id": f"t{i}", "question": f"What is {i} plus {i}?"} for i in range(6)]
SEED = "Answer the question: {question}"
GOOD = "Be concise. Answer the question: {question}"
pytestmark = pytest.mark.usefixtures("instrumented")  # agl.instrument() around each test: tests/conftest.py


@agl.rollout
def agent(task: Dict[str, Any], prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    """The system prompt is the template; the reward depends only on it (1.0 when it asks for concision),
    so APO's choice is checkable. The model call gives the optimizer a transcript to read."""
    system = prompt_template.format(question=task["question"])
    with openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0) as client:
        client.chat.completions.create(model=llm.model, messages=[{"role": "system", "content": system}])
    return 1.0 if "concise" in system else 0.25


@pytest.fixture
def optimizer() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def _optimizer_llm(server: FakeOpenAIServer) -> agl.LLM:
    return agl.LLM(endpoint=server.base_url, model="optimizer-model", sampling_parameters={"temperature": 1.0})


def _contents(server: FakeOpenAIServer) -> List[str]:
    return [r["body"]["messages"][0]["content"] for r in server.requests if r["path"].endswith("/chat/completions")]


def test_beam_search_finds_the_better_prompt_and_publishes_it(tmp_path, fake_openai, optimizer) -> None:
    optimizer.script(
        # round 1, from the seed: one critique, two edits (the second invents a placeholder: refused)
        FakeReply(content="The prompt never asks for a short answer."),
        FakeReply(content=f"Here it is:\n<prompt>\n{GOOD}\n</prompt>"),
        FakeReply(content="<prompt>Answer {query}</prompt>"),
        # round 2, from the best (GOOD) then the seed: a repeat of GOOD is not scored again
        FakeReply(content="Fine already."),
        FakeReply(content=f"<prompt>{GOOD}</prompt>"),
        FakeReply(content="<prompt>Answer: {question}</prompt>"),
        FakeReply(content="Still no request for concision."),
        FakeReply(content="<prompt>Think, then answer: {question}</prompt>"),
        FakeReply(content=f"<prompt>{GOOD}</prompt>"),
    )
    algorithm = APO(
        _optimizer_llm(optimizer), beam_width=2, branch_factor=2, rounds=2, gradient_batch_size=2, val_batch_size=4
    )
    trainer = apo_trainer(tmp_path, fake_openai.base_url, algorithm)
    result = trainer.fit(agent, TASKS, val_dataset=TASKS[:4])

    assert [c.template for c in result.history] == [SEED, GOOD, "Answer: {question}", "Think, then answer: {question}"]
    assert [c.score for c in result.history] == [0.25, 1.0, 0.25, 0.25]
    assert [c.parent for c in result.history] == [None, 0, 1, 0]
    assert result.history[1].critique == "The prompt never asks for a short answer."
    assert result.refused == 1
    assert result.best.template == GOOD and result.seed.template == SEED
    # published: the trainer's current resources hold the best prompt, the agent's LLM unchanged
    published = trainer.store.get_resources(trainer.resources_id)
    assert published.resources["prompt"].template == GOOD
    assert published.resources["main_llm"].model == "agent-model"
    # every candidate was scored on the same 4 validation tasks, one rollout each
    val = [r for r in trainer.store.query_rollouts() if r.mode == "val"]
    by_resources: Dict[str, List[str]] = {}
    for r in val:
        by_resources.setdefault(r.resources_id, []).append(r.task_id)
    assert len(by_resources) == 4 and all(
        sorted(t) == sorted(next(iter(by_resources.values()))) for t in by_resources.values()
    )
    assert all(len(t) == 4 for t in by_resources.values())

    requests = _contents(optimizer)
    assert len(requests) == 9
    critique = requests[0]
    assert SEED in critique and '<run reward="0.25">' in critique
    assert "[system] Answer the question: What is" in critique  # the agent's own call, read from its spans
    assert "[assistant] " in critique
    edit = requests[1]
    assert "The prompt never asks for a short answer." in edit and "{question}" in edit and SEED in edit
    assert all(
        r["body"]["model"] == "optimizer-model" and r["body"]["temperature"] == 1.0
        for r in optimizer.requests
        if r["path"].endswith("/chat/completions")
    )


def test_prompt_optimization_of_an_agent_on_a_hosted_model(tmp_path, optimizer) -> None:
    """APO's usual setting: the agent's model on api.openai.com, which refuses the token ids agl asks for in
    rollouts. Every rollout failed before; now the calls are sent again without the flag."""
    from agl.instrumentation import token_id_refusals

    token_id_refusals.forget_all()
    optimizer.script(FakeReply(content="It never asks for concision."), FakeReply(content=f"<prompt>{GOOD}</prompt>"))
    try:
        with FakeOpenAIServer(reject_token_ids=True) as hosted:
            algorithm = APO(
                _optimizer_llm(optimizer),
                beam_width=1,
                branch_factor=1,
                rounds=1,
                gradient_batch_size=2,
                val_batch_size=2,
            )
            trainer = apo_trainer(tmp_path, hosted.base_url, algorithm)
            result = trainer.fit(agent, TASKS, val_dataset=TASKS[:2])
    finally:
        token_id_refusals.forget_all()
    assert [c.score for c in result.history] == [0.25, 1.0] and result.best.template == GOOD
    assert {r.status for r in trainer.store.query_rollouts()} == {"succeeded"}


def test_span_retention_deletes_critiqued_rollouts_spans_after_the_critique(tmp_path, fake_openai, optimizer) -> None:
    optimizer.script(FakeReply(content="It never asks for concision."), FakeReply(content=f"<prompt>{GOOD}</prompt>"))
    algorithm = APO(
        _optimizer_llm(optimizer), beam_width=1, branch_factor=1, rounds=1, gradient_batch_size=2, val_batch_size=2
    )
    trainer = apo_trainer(tmp_path, fake_openai.base_url, algorithm, span_retention_steps=0)
    result = trainer.fit(agent, TASKS, val_dataset=TASKS[:2])
    assert result.best.template == GOOD
    assert "[system] Answer the question: What is" in _contents(optimizer)[0], "the critique read the spans first"
    store = trainer.store
    train = store.query_rollouts(mode="train")
    assert len(train) == 2 and all(store.query_spans(r.rollout_id) == [] for r in train)
    assert all(store.query_spans(r.rollout_id) for r in store.query_rollouts(mode="val"))


def test_a_trainer_without_a_prompt_template_is_told_how_to_add_one(tmp_path, fake_openai, optimizer) -> None:
    trainer = agl.Trainer(
        algorithm=APO(_optimizer_llm(optimizer)),
        store=str(tmp_path / "store.db"),
        n_runners=1,
        runner_mode="thread",
        progress=False,
        initial_resources={"main_llm": agl.LLM(endpoint=fake_openai.base_url, model="m")},
    )
    with pytest.raises(APOError, match=r"initial_resources=\{'prompt': agl.PromptTemplate"):
        trainer.fit(agent, TASKS)
    named = APO(_optimizer_llm(optimizer), prompt="system")
    with pytest.raises(APOError, match=r"no PromptTemplate named 'system' .* \['prompt'\]"):
        apo_trainer(tmp_path / "b", fake_openai.base_url, named).fit(agent, TASKS)


def test_an_unreachable_optimizer_names_the_model_and_url(tmp_path, fake_openai) -> None:
    dead = agl.LLM(endpoint="http://127.0.0.1:9/v1", model="gone")
    algorithm = APO(dead, rounds=1, gradient_batch_size=1, val_batch_size=1, request_timeout=2)
    with pytest.raises(APOError, match=r"optimizer model 'gone' at http://127.0.0.1:9/v1 failed"):
        apo_trainer(tmp_path, fake_openai.base_url, algorithm).fit(agent, TASKS)


def test_an_optimizer_failing_mid_search_keeps_the_best_so_far(tmp_path, fake_openai, optimizer) -> None:
    failure = FakeReply(status_code=500, error_message="overloaded")
    optimizer.script(
        FakeReply(content="Ask for concision."),
        FakeReply(content=f"<prompt>{GOOD}</prompt>"),  # round 1
        failure,
        failure,
        failure,  # round 2's critique: the first try and the client's two retries
    )
    algorithm = APO(
        _optimizer_llm(optimizer), beam_width=1, branch_factor=1, rounds=2, gradient_batch_size=1, val_batch_size=2
    )
    trainer = apo_trainer(tmp_path, fake_openai.base_url, algorithm)
    with pytest.raises(APOError, match="optimizer model 'optimizer-model' .* failed") as caught:
        trainer.fit(agent, TASKS)
    result = caught.value.result
    assert result is not None and [c.template for c in result.history] == [SEED, GOOD]
    assert result.best.template == GOOD
    assert trainer.store.get_resources(trainer.resources_id).resources["prompt"].template == GOOD


def test_agent_lightning_apo_code_runs_unchanged(tmp_path, fake_openai, optimizer) -> None:
    """Agent Lightning's APO takes an AsyncOpenAI client, ``beam_rounds``, its two model names and
    ``adapter=agl.TraceToMessages()``: each raised a TypeError or AttributeError."""
    optimizer.script(FakeReply(content="Ask for concision."), FakeReply(content=f"<prompt>{GOOD}</prompt>"))
    algo = agl.APO(
        openai.AsyncOpenAI(base_url=optimizer.base_url, api_key="sk-test"),
        val_batch_size=2,
        gradient_batch_size=1,
        beam_width=1,
        branch_factor=1,
        beam_rounds=1,
        diversity_temperature=0.7,
    )
    trainer = agl.Trainer(
        algorithm=algo,
        n_runners=2,
        store=str(tmp_path / "store.db"),
        runner_mode="thread",
        progress=False,
        adapter=agl.TraceToMessages(),
        initial_resources={
            "main_llm": agl.LLM(endpoint=fake_openai.base_url, model="agent-model"),
            "prompt_template": agl.PromptTemplate(template=SEED, engine="f-string"),
        },
    )
    trainer.fit(agent=agent, train_dataset=TASKS, val_dataset=TASKS[:2])
    assert algo.rounds == 1
    asked = [r for r in optimizer.requests if r["path"].endswith("/chat/completions")]
    assert [r["body"]["model"] for r in asked] == ["gpt-5-mini", "gpt-4.1-mini"]  # Agent Lightning's defaults
    assert all(r["body"]["temperature"] == 0.7 for r in asked)
    assert all(r["headers"].get("authorization") == "Bearer sk-test" for r in asked)
    assert trainer.store.get_resources(trainer.resources_id).resources["prompt_template"].template == GOOD
    with pytest.raises(TypeError, match="optimizer must be agl.LLM"):
        APO(object())


def test_replies_without_a_prompt_are_refused_and_a_prompt_without_placeholders_keeps_none(
    tmp_path, fake_openai, optimizer
) -> None:
    """An empty reply, empty tags or untagged chatter became the agent's prompt (and could win); the edit
    request asked a prompt without placeholders to keep "{question}"; vLLM sampling settings of the
    optimizer (top_k) raised a TypeError in the openai client."""
    seed = "Answer the question."
    optimizer.script(
        FakeReply(content="It never asks for concision."),
        FakeReply(content=""),
        FakeReply(content="<prompt>  </prompt>"),
        FakeReply(content="Sure! Here is an improved version. Let me know if you need more."),
        FakeReply(content="<prompt>Be concise. Answer the question."),  # never closed: the rest is the prompt
    )
    llm = agl.LLM(
        endpoint=optimizer.base_url, model="optimizer-model", sampling_parameters={"top_k": 20, "temperature": 0.5}
    )
    algorithm = APO(llm, beam_width=1, branch_factor=4, rounds=1, gradient_batch_size=1, val_batch_size=2)
    result = apo_trainer(tmp_path, fake_openai.base_url, algorithm, prompt=seed).fit(agent, TASKS)
    assert [c.template for c in result.history] == [seed, "Be concise. Answer the question."]
    assert result.refused == 3 and result.best.template == "Be concise. Answer the question."
    edit = _contents(optimizer)[1]
    assert "{question}" not in edit and "no placeholders" in edit
    assert all(
        r["body"]["top_k"] == 20 and r["body"]["temperature"] == 0.5
        for r in optimizer.requests
        if r["path"].endswith("/chat/completions")
    )


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        APO({"endpoint": "http://x/v1", "model": "m"}, beam_width=0)
    with pytest.raises(ValueError, match="rounds=3 and beam_rounds=1 disagree"):
        APO({"endpoint": "http://x/v1", "model": "m"}, rounds=3, beam_rounds=1)
    with pytest.raises(APOError, match="needs training tasks"):
        APO({"endpoint": "http://x/v1", "model": "m"}).run([], None)


def test_transcript_shows_new_messages_tool_calls_and_failures() -> None:
    from agl import semconv
    from agl.types import Rollout

    first_in = [{"role": "system", "content": "S"}, {"role": "user", "content": "U" * 800}]
    first_out = [{"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": "{}"}]}]
    spans = [
        transcript_span(0, "llm", **{semconv.INPUT_MESSAGES: first_in, semconv.OUTPUT_MESSAGES: first_out}),
        transcript_span(
            1, "tool", **{semconv.TOOL_NAME: "calc", semconv.TOOL_CALL_ARGUMENTS: "1+1", semconv.TOOL_CALL_RESULT: "2"}
        ),
        transcript_span(
            2,
            "llm",
            **{
                semconv.INPUT_MESSAGES: first_in + first_out + [{"role": "tool", "content": "2"}],
                semconv.OUTPUT_MESSAGES: '[{"role": "assistant", "content": "It is 2."}]',
            },
        ),
    ]
    failed = Rollout(rollout_id="r", task_id="t", input={}, status="failed", error="ValueError: boom")
    text = transcript(spans, failed, limit=100)
    assert text.splitlines() == [
        "[system] S",
        "[user] " + "U" * 99 + "…",
        '[assistant]  <call {"name": "calc", "arguments": "{}"}>',
        "[tool calc] 1+1 -> 2",
        "[tool] 2",
        "[assistant] It is 2.",
        "[rollout failed] ValueError: boom",
    ]
