"""LightningRL end to end: real rollouts of a tool-using agent (openai client, agl.instrument()) against the
local fake server into a SQLite store, then batches under each setting; config errors; a batch-level
property over synthetic rollouts."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Dict, List, Tuple

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

import agl
from agl import semconv
from agl.errors import MissingTokenIdsError
from agl.lightningrl import Batch, BatchReport, LightningRL
from agl.lightningrl.advantages import FailedRollouts
from agl.lightningrl.synthetic import synthetic_rollouts
from agl.store import SqliteLightningStore
from agl.testing import FakeReply, FakeTokenizer, without_token_ids
from agl.types import Rollout

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


@agl.tool
def add(a: float, b: float) -> float:
    return a + b


@agl.rollout
def adder(task, llm):
    """Two calls (a tool call, then the answer) under the root agent 'adder'; a third by 'reviewer'."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    result = add(**json.loads(call.function.arguments))
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"{result:g}"},
    ]
    answer = client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS).choices[0].message.content
    from agl.instrumentation.framework import agent_span

    with agent_span("reviewer", "test"):
        client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": answer}])
    if task.get("fail"):
        raise RuntimeError("the agent crashed")
    return 1.0 if str(task["answer"]) in answer else 0.0


def run(fake_trainer, tmp_path, tasks, n_per_task=2, agent=adder) -> Tuple[SqliteLightningStore, List[Rollout]]:
    """``agent`` (by default ``adder``) on ``tasks`` with thread runners against the fake server, into SQLite."""
    store = SqliteLightningStore(tmp_path / "lrl.db")
    trainer = fake_trainer(store)
    with trainer.runners(agent):
        rollouts = trainer.run_tasks(tasks, n_per_task=n_per_task)
    return store, rollouts


@pytest.fixture
def two_groups(tmp_path, fake_openai, fake_trainer, instrumented):
    """Task q1: rollouts rewarded 1 and 0 (the second's answer is scripted wrong); task q2: both 1."""
    fake_openai.script(FakeReply(), FakeReply(), FakeReply(), FakeReply(), FakeReply(content="It is 7."))
    return run(
        fake_trainer,
        tmp_path,
        [{"question": "What is 1 plus 2?", "answer": 3}, {"question": "What is 2 plus 2?", "answer": 4}],
    )


def test_default_batch_from_a_sqlite_store(two_groups) -> None:
    store, rollouts = two_groups
    assert [r.final_reward for r in rollouts] == [1.0, 0.0, 1.0, 1.0]
    batch = LightningRL.from_config(None).build_batch(store, rollouts, progress=False)

    report = batch.report
    assert (report.rollouts, report.used, report.llm_spans, report.transitions, report.samples) == (4, 4, 12, 12, 12)
    assert report.accounted and report.tree_repairs.total == 0
    # token ids are the server's: the fake model's tokenizer applied to the messages sent
    tok = FakeTokenizer()
    for t in batch.transitions:
        span = next(s for s in store.query_spans(t.rollout_id) if s.span_id == t.span_id)
        messages = json.loads(span.attributes[semconv.INPUT_MESSAGES])
        tools = json.loads(span.attributes.get(semconv.TOOL_DEFINITIONS, "null"))
        assert t.prompt_ids == tok.encode(tok.apply_chat_template(messages, tools))
    # broadcast credit, GRPO at the rollout level, loss weight 1/3 per call of a 3-call rollout
    by_rollout: Dict[str, List] = defaultdict(list)
    for s in batch.samples:
        by_rollout[s.rollout_id].append(s)
    r1, r0, q2a, q2b = (by_rollout[r.rollout_id] for r in rollouts)
    assert {s.reward for s in r1} == {1.0} and {s.reward for s in r0} == {0.0}
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # rewards 1 and 0: mean 0.5, sample std sqrt(0.5)
    assert [s.advantage for s in r1] == pytest.approx([a] * 3)
    assert [s.advantage for s in r0] == pytest.approx([-a] * 3)
    assert [s.advantage for s in q2a + q2b] == [0.0] * 6
    assert all(s.loss_weight == pytest.approx(1 / 3) for s in batch.samples)
    assert str(report).startswith(
        "4 rollouts (4 used, 0 failed dropped, 0 failed filled); 12 llm spans -> 12 transitions"
    )


def test_agent_match_mapping_trains_policies_with_their_own_baselines(two_groups) -> None:
    store, rollouts = two_groups
    adapter = LightningRL.from_config(
        {"agent_match": {"^adder$": "solver", "review": "reviewer"}, "credit": "step", "air": {"tool_ok": 0.5}}
    )
    batch = adapter.build_batch(store, rollouts, progress=False)
    policies = batch.by_policy()
    assert sorted(policies) == ["reviewer", "solver"]
    assert len(policies["solver"]) == 8 and len(policies["reviewer"]) == 4
    # step credit: the solver's first call caused the tool that ran (AIR tool_ok), nothing else has a reward
    solver = [t for t in batch.transitions if t.policy == "solver"]
    assert [t.step_rewards for t in solver] == [{"air.tool_ok": 0.5}, {}] * 4
    assert [t.reward for t in solver] == [0.5, 0.0] * 4
    # the reviewer's rewards are all 0: its own group gives zero advantages; the solver's are not mixed in
    assert all(s.advantage == 0.0 and s.loss_weight == 1.0 for s in policies["reviewer"])
    assert all(s.loss_weight == 0.5 for s in policies["solver"])


def test_aggregate_merges_the_tool_conversation(two_groups) -> None:
    store, rollouts = two_groups
    batch = LightningRL.from_config({"agent_match": "^adder$", "aggregate": True}).build_batch(
        store, rollouts, progress=False
    )
    assert batch.report.merged_calls == 4 and batch.report.prefix_mismatches == 0
    assert len(batch.samples) == 4 and all(s.loss_weight == 1.0 for s in batch.samples)
    for s in batch.samples:
        first, second = (t for t in batch.transitions if t.span_id in s.span_ids)
        assert s.prompt_ids == first.prompt_ids
        assert s.prompt_ids + s.response_ids == second.prompt_ids + second.response_ids
        assert [tok for tok, m in zip(s.response_ids, s.response_mask) if m] == first.response_ids + second.response_ids
        assert 0 in s.response_mask  # the tool result and template tokens in between are masked out


def test_failed_rollouts_are_dropped_or_filled_and_said_why(tmp_path, fake_trainer, instrumented, caplog) -> None:
    store, rollouts = run(
        fake_trainer,
        tmp_path,
        [{"question": "1 plus 2?", "answer": 3}, {"question": "1 plus 1?", "answer": 2, "fail": True}],
        n_per_task=1,
    )
    assert [r.status for r in rollouts] == ["succeeded", "failed"]
    with caplog.at_level("WARNING", logger="agl.lightningrl"):
        dropped = LightningRL().build_batch(store, rollouts, progress=False)
    (warning,) = [r.getMessage() for r in caplog.records if "rollouts failed" in r.getMessage()]
    assert "1 of 2 rollouts failed or gave no reward (dropped)" in warning and "the agent crashed" in warning
    assert (dropped.report.used, dropped.report.failed_dropped) == (1, 1)
    assert {s.rollout_id for s in dropped.samples} == {rollouts[0].rollout_id}
    filled = LightningRL(failed=-1.0).build_batch(store, rollouts, progress=False)
    assert (filled.report.used, filled.report.failed_filled) == (2, 1)
    assert {s.reward for s in filled.samples if s.rollout_id == rollouts[1].rollout_id} == {-1.0}
    assert LightningRL(failed=FailedRollouts(reward=0.0)).failed == FailedRollouts(reward=0.0)


@agl.rollout
def best_of_two(task, llm):
    """One call asking for two choices (n=2), as a best-of-n agent does, and one plain call."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    messages = [{"role": "user", "content": task["question"]}]
    client.chat.completions.create(model=llm.model, messages=messages, n=2)
    client.chat.completions.create(model=llm.model, messages=messages)
    return 1.0


def test_calls_with_several_choices_are_counted_and_warned(
    tmp_path, fake_openai, fake_trainer, instrumented, caplog
) -> None:
    fake_openai.script(*[FakeReply(content="3") for _ in range(4)])
    store, rollouts = run(fake_trainer, tmp_path, [{"question": "1 plus 2?"}], n_per_task=2, agent=best_of_two)
    first, second = [s for s in store.query_spans(rollouts[0].rollout_id) if s.kind == "llm"]
    assert first.attributes[semconv.REQUEST_CHOICE_COUNT] == 2 and semconv.REQUEST_CHOICE_COUNT not in second.attributes
    with caplog.at_level("WARNING", logger="agl.lightningrl"):
        batch = LightningRL().build_batch(store, rollouts, progress=False)
    assert batch.report.several_choices == 2 and len(batch.samples) == 4  # still trained, as choice 0
    assert "2 calls with n > 1 (choice 0 trained)" in str(batch.report)
    (warning,) = [r.getMessage() for r in caplog.records if "several choices" in r.getMessage()]
    assert warning.startswith("LightningRL: 2 llm call(s) asked for several choices (n > 1, or a Completions batch")


@agl.rollout
def retrier(task, llm):
    """Asks again after the server refuses its first call: the refused call stays in the trace, failed."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    try:
        client.chat.completions.create(model=llm.model, messages=messages)
    except openai.InternalServerError:
        pass
    return (
        1.0
        if "3" in client.chat.completions.create(model=llm.model, messages=messages).choices[0].message.content
        else 0.0
    )


def test_a_failed_call_is_skipped_and_the_report_says_so(tmp_path, fake_openai, fake_trainer, instrumented) -> None:
    fake_openai.script(FakeReply(status_code=500, error_message="overloaded"), FakeReply(content="3"))
    store, rollouts = run(fake_trainer, tmp_path, [{"question": "1 plus 2?"}], n_per_task=1, agent=retrier)
    assert [r.final_reward for r in rollouts] == [1.0]
    batch = LightningRL().build_batch(store, rollouts, progress=False)
    report = batch.report
    assert (report.llm_spans, report.transitions, report.skipped) == (2, 1, {"llm call failed": 1})
    assert report.accounted and "skipped 1 llm call failed" in str(report)
    (sample,) = batch.samples  # only the answered call: a refused request has no response to train on
    assert sample.reward == 1.0


def test_missing_token_ids_error_and_retokenization(tmp_path, fake_trainer) -> None:
    agl.instrument(request_token_ids=False)  # the server is not asked for ids, as with a plain endpoint
    try:
        store, rollouts = run(fake_trainer, tmp_path, [{"question": "1 plus 2?", "answer": 3}], n_per_task=1)
    finally:
        agl.uninstrument()
    with pytest.raises(MissingTokenIdsError, match="'absent'") as info:
        LightningRL().build_batch(store, rollouts, progress=False)
    assert info.value.rollout_id == rollouts[0].rollout_id and info.value.agent_name == "adder"
    batch = LightningRL(tokenizer=FakeTokenizer()).build_batch(store, rollouts, progress=False)
    assert batch.report.retokenized == 3 and len(batch.samples) == 3
    assert "3 re-tokenized" in str(batch.report)


def test_retokenized_ids_equal_the_servers_ids(two_groups) -> None:
    """Strip the ids of real spans: re-tokenizing the recorded messages (tool calls, tool results, tool
    definitions included) with the server's tokenizer gives back exactly the server's ids."""
    store, rollouts = two_groups
    with_ids = LightningRL().build_batch(store, rollouts, progress=False)
    again = LightningRL(tokenizer=FakeTokenizer()).batch_from_spans(rollouts, without_token_ids(store, rollouts))
    assert again.report.retokenized == 12
    assert [(t.prompt_ids, t.response_ids) for t in again.transitions] == [
        (t.prompt_ids, t.response_ids) for t in with_ids.transitions
    ]


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "Add two numbers.",
        "parameters": TOOLS[0]["function"]["parameters"],
    }
]


@agl.rollout
def parallel_adder(task, llm):
    """A Responses API agent whose first turn is text and two function calls at once (as the Agents SDK
    sends parallel tool calls), answered with two outputs."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="x")
    items = [{"role": "user", "content": task["question"]}]
    first = client.responses.create(model=llm.model, instructions="Use the tool.", input=items, tools=RESPONSES_TOOLS)
    items += [item.model_dump(exclude_none=True) for item in first.output]
    for call in [item for item in first.output if item.type == "function_call"]:
        items.append(
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": f"{add(**json.loads(call.arguments)):g}",
            }
        )
    client.responses.create(model=llm.model, instructions="Use the tool.", input=items, tools=RESPONSES_TOOLS)
    return 1.0


def test_retokenized_responses_calls_equal_the_servers_ids(tmp_path, fake_openai, fake_trainer, instrumented) -> None:
    """Re-tokenizing Responses API calls maps their input items and flat tools to chat the way the server
    does: a turn of text and parallel function calls is one assistant message, tools are chat tools."""
    fake_openai.script(
        FakeReply(
            content="Adding.",
            tool_calls=[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}],
        ),
        FakeReply(content="3 and 7."),
    )
    store, rollouts = run(
        fake_trainer, tmp_path, [{"question": "1 plus 2, and 3 plus 4?"}], n_per_task=1, agent=parallel_adder
    )
    assert [r.status for r in rollouts] == ["succeeded"]
    with_ids = LightningRL().build_batch(store, rollouts, progress=False)
    again = LightningRL(tokenizer=FakeTokenizer()).batch_from_spans(rollouts, without_token_ids(store, rollouts))
    assert again.report.retokenized == 2
    assert [(t.prompt_ids, t.response_ids) for t in again.transitions] == [
        (t.prompt_ids, t.response_ids) for t in with_ids.transitions
    ]


# --- configuration ----------------------------------------------------------------------------------------


def test_from_config_forms_and_errors(tmp_path) -> None:
    adapter = LightningRL(agent_match="x")
    assert LightningRL.from_config(adapter) is adapter
    assert LightningRL.from_config(None).estimator == "grpo"
    trainer = agl.Trainer(
        store=str(tmp_path / "t.db"), adapter={"agent_match": "w", "estimator": "rloo"}, progress=False
    )
    assert LightningRL.from_config(trainer.adapter).estimator == "rloo"
    assert agl.LightningRL is LightningRL
    with pytest.raises(ValueError, match=r"unknown LightningRL setting\(s\) \['agent_mtch'\]"):
        LightningRL.from_config({"agent_mtch": "w"})
    with pytest.raises(TypeError, match="dict or a LightningRL"):
        LightningRL.from_config("writer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        LightningRL(estimator="ppo")
    with pytest.raises(ValueError, match='failed must be "drop"'):
        LightningRL(failed="zero")
    with pytest.raises(ValueError, match="needs gamma"):
        LightningRL(credit="discounted")
    with pytest.raises(TypeError, match="aggregate"):
        LightningRL(aggregate="yes")  # type: ignore[arg-type]


def test_empty_batch() -> None:
    batch = LightningRL().batch_from_spans([], [])
    assert batch == Batch(samples=[], transitions=[], report=BatchReport())
    assert str(batch.report).startswith("0 rollouts")


# --- property: every rollout and every llm span accounted for, weights per rollout and policy ---------------


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    statuses=st.lists(st.sampled_from(["succeeded", "failed"]), min_size=12, max_size=12),
    failed=st.sampled_from(["drop", -1.0]),
    agent_match=st.sampled_from([None, "writer", {"writer": "a", "check": "b"}]),
    credit=st.sampled_from([{"credit": "broadcast"}, {"credit": "discounted", "gamma": 0.7}, {"credit": "step"}]),
    aggregate=st.booleans(),
)
def test_batch_accounting(n, statuses, failed, agent_match, credit, aggregate) -> None:
    pairs = [
        (r.model_copy(update={"status": statuses[i]}), spans)
        for i, (r, spans) in enumerate(synthetic_rollouts(n * 40, spans_per_rollout=40, rollouts_per_task=3))
    ]
    rollouts = [r for r, _ in pairs]
    adapter = LightningRL.from_config(
        {"agent_match": agent_match, "failed": failed, "aggregate": aggregate, "air": {}, **credit}
    )
    batch = adapter.batch_from_spans(rollouts, pairs)
    report = batch.report
    assert report.rollouts == report.used + report.failed_dropped == len(rollouts)
    assert report.accounted
    used = [r for r in rollouts if r.status == "succeeded" or failed != "drop"]
    assert report.llm_spans == sum(1 for r, spans in pairs if r in used for s in spans if s.kind == "llm")
    assert len(batch.transitions) == report.transitions
    assert sorted(sid for s in batch.samples for sid in s.span_ids) == sorted(t.span_id for t in batch.transitions)
    weights: Dict[Tuple[str, str], float] = defaultdict(float)
    for s in batch.samples:
        assert s.response_ids and len(s.response_mask) == len(s.response_ids)
        weights[(s.rollout_id, s.policy)] += s.loss_weight
    assert all(w == pytest.approx(1.0) for w in weights.values())


def test_an_empty_batch_says_which_agents_agent_match_left_out(two_groups) -> None:
    store, rollouts = two_groups
    batch = LightningRL.from_config({"agent_match": "^solver$"}).build_batch(store, rollouts, progress=False)
    report = batch.report
    assert batch.samples == [] and report.filtered_by_agent == report.llm_spans == 12 and report.accounted
    assert sum(report.filtered_agents.values()) == 12 and "adder" in report.filtered_agents
    names = ", ".join(f"{name} {n}" for name, n in sorted(report.filtered_agents.items()))
    assert f"filtered 12 by agent_match ({names}), 0 by llm_call_match" in str(report)
    why = report.why_empty("^solver$")
    assert why.startswith("agent_match '^solver$' left out every LLM call; the calls' agents: ") and "'adder' (" in why
