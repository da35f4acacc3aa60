"""Merging consecutive LLM calls into one sample with a response mask: hand cases and properties."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from agl.lightningrl.aggregate import AggregationResult, aggregate_trajectories, to_samples
from agl.lightningrl.types import Sample, Transition


def call(
    step: int,
    prompt: List[int],
    response: List[int],
    *,
    policy: str = "default",
    attempt: str = "a0",
    rollout: str = "r0",
    reward: float = 0.0,
    logprobs: Optional[List[float]] = None,
    span: Optional[str] = None,
) -> Transition:
    return Transition(
        rollout_id=rollout,
        attempt_id=attempt,
        task_id="t0",
        span_id=span or f"{rollout}/{attempt}/{policy}/{step}",
        step=step,
        prompt_ids=prompt,
        response_ids=response,
        policy=policy,
        response_logprobs=logprobs,
        reward=reward,
    )


# --- hand cases -----------------------------------------------------------------------------------------


def test_clean_three_turn_chat_is_one_sample_with_the_right_mask() -> None:
    calls = [
        call(0, [1, 2], [10, 11], reward=0.1, logprobs=[-0.1, -0.2]),
        call(1, [1, 2, 10, 11, 3, 4], [12], reward=0.2, logprobs=[-0.3]),
        call(2, [1, 2, 10, 11, 3, 4, 12, 5], [13, 14], reward=1.0, logprobs=[-0.4, -0.5]),
    ]
    result = aggregate_trajectories(calls)

    assert result.merged_calls == 2
    assert result.prefix_mismatches == []
    [sample] = result.samples
    assert sample.prompt_ids == [1, 2]
    assert sample.response_ids == [10, 11, 3, 4, 12, 5, 13, 14]
    assert sample.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.response_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert sample.reward == 1.0  # the last merged call's
    assert sample.span_ids == [c.span_id for c in calls]


def test_steps_are_merged_in_step_order_whatever_the_input_order() -> None:
    calls = [call(1, [1, 2, 3], [4]), call(0, [1], [2])]
    [sample] = aggregate_trajectories(calls).samples
    assert sample.prompt_ids == [1]
    assert sample.response_ids == [2, 3, 4]
    assert sample.response_mask == [1, 0, 1]


def test_drift_in_the_middle_gives_two_samples_and_one_mismatch() -> None:
    calls = [
        call(0, [1, 2], [10, 11]),
        call(1, [1, 2, 99, 11, 3], [12]),  # "10" retokenized as "99": breaks at token 2
        call(2, [1, 2, 99, 11, 3, 12, 4], [13]),
    ]
    result = aggregate_trajectories(calls)

    assert [s.span_ids for s in result.samples] == [[calls[0].span_id], [calls[1].span_id, calls[2].span_id]]
    assert result.merged_calls == 1
    [mismatch] = result.prefix_mismatches
    assert (mismatch.rollout_id, mismatch.step, mismatch.token_index) == ("r0", 1, 2)
    assert mismatch.span_id == calls[1].span_id
    assert result.samples[1].response_mask == [1, 0, 1]
    assert "step 1" in result.summary() and "token 2" in result.summary()


def test_a_prompt_shorter_than_the_history_breaks_at_its_length() -> None:
    result = aggregate_trajectories([call(0, [1, 2], [3, 4]), call(1, [1, 2, 3], [5])])
    assert len(result.samples) == 2
    assert result.prefix_mismatches[0].token_index == 3


def test_different_policies_interleaved_are_never_merged_across() -> None:
    calls = [
        call(0, [1], [2], policy="A"),
        call(0, [1, 2, 3], [4], policy="B"),  # extends A's step 0, but another policy
        call(1, [1, 2, 3, 4, 5], [6], policy="A"),  # extends B's step 0 and A's step 0
        call(1, [1, 2, 3, 4, 5, 6, 7], [8], policy="B"),
    ]
    result = aggregate_trajectories(calls)

    assert result.prefix_mismatches == []
    assert {s.policy: s.span_ids for s in result.samples} == {
        "A": [calls[0].span_id, calls[2].span_id],
        "B": [calls[1].span_id, calls[3].span_id],
    }
    a = next(s for s in result.samples if s.policy == "A")
    assert a.response_ids == [2, 3, 4, 5, 6] and a.response_mask == [1, 0, 0, 0, 1]


def test_different_attempts_are_never_merged() -> None:
    result = aggregate_trajectories([call(0, [1], [2], attempt="a0"), call(1, [1, 2, 3], [4], attempt="a1")])
    assert len(result.samples) == 2
    assert result.merged_calls == 0 and result.prefix_mismatches == []


def test_a_call_without_logprobs_drops_the_merged_samples_logprobs() -> None:
    [sample] = aggregate_trajectories([call(0, [1], [2], logprobs=[-1.0]), call(1, [1, 2, 3], [4])]).samples
    assert sample.response_logprobs is None


def test_empty_input() -> None:
    result = aggregate_trajectories([])
    assert result == AggregationResult()
    assert to_samples([]) == []
    assert "0 calls -> 0 samples" in result.summary()


def test_to_samples_is_one_sample_per_call() -> None:
    calls = [call(0, [1], [2, 3], reward=0.5, logprobs=[-1.0, -2.0]), call(1, [1, 2, 3], [4])]
    samples = to_samples(calls)
    assert samples[0] == Sample(
        rollout_id="r0",
        task_id="t0",
        policy="default",
        prompt_ids=[1],
        response_ids=[2, 3],
        response_mask=[1, 1],
        reward=0.5,
        response_logprobs=[-1.0, -2.0],
        span_ids=[calls[0].span_id],
    )
    assert samples[1].response_mask == [1] and samples[1].response_logprobs is None


# --- properties -----------------------------------------------------------------------------------------

tokens = st.lists(st.integers(0, 50), max_size=5)
CORRUPT = 1000  # never a generated token, so a corrupted position always differs


@st.composite
def conversation(draw: st.DrawFn, attempt: str, policy: str) -> Tuple[List[Transition], Optional[Tuple[int, int]]]:
    """A multi-turn chat (each prompt = previous prompt + previous response + environment tokens), maybe with
    one prompt corrupted at one position; returns the calls and (step, index) of the corruption."""
    turns = draw(st.integers(1, 5))
    corrupt_step = draw(st.one_of(st.none(), st.integers(1, turns - 1))) if turns > 1 else None
    corruption = None
    prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=5))
    calls: List[Transition] = []
    for step in range(turns):
        if step > 0:
            history = calls[-1].prompt_ids + calls[-1].response_ids
            prompt = history + draw(tokens)
            if step == corrupt_step:
                index = draw(st.integers(0, len(history) - 1))
                prompt[index] = CORRUPT
                corruption = (step, index)
        response = draw(tokens)
        logprobs = [-(t + 1) / 100 for t in response]
        calls.append(
            call(step, prompt, response, attempt=attempt, policy=policy, reward=float(step), logprobs=logprobs)
        )
    return calls, corruption


@st.composite
def rollouts(draw: st.DrawFn) -> Tuple[List[Transition], List[Tuple[List[Transition], Optional[Tuple[int, int]]]]]:
    """1-4 conversations of one rollout, each its own (attempt, policy), their calls shuffled together."""
    n = draw(st.integers(1, 4))
    conversations = [draw(conversation(f"a{i % 2}", f"p{i // 2}")) for i in range(n)]
    everything = [t for calls, _ in conversations for t in calls]
    return draw(st.permutations(everything)), conversations


@settings(max_examples=200, deadline=None)
@given(rollouts())
def test_aggregation_properties(case) -> None:
    transitions, conversations = case
    result = aggregate_trajectories(transitions)
    by_span: Dict[str, Transition] = {t.span_id: t for t in transitions}

    # every transition is in exactly one sample
    spans = [span for s in result.samples for span in s.span_ids]
    assert sorted(spans) == sorted(by_span)
    assert len(result.samples) + result.merged_calls == len(transitions)

    for sample in result.samples:
        merged = [by_span[span] for span in sample.span_ids]
        first, last = merged[0], merged[-1]
        assert len({(t.attempt_id, t.policy) for t in merged}) == 1
        assert [t.step for t in merged] == sorted(t.step for t in merged)
        # ids round-trip: the sample is the last merged call's full context
        assert sample.prompt_ids == first.prompt_ids
        assert sample.prompt_ids + sample.response_ids == last.prompt_ids + last.response_ids
        assert sample.reward == last.reward
        # the mask covers exactly the generated tokens, in order
        generated = [tok for t in merged for tok in t.response_ids]
        assert len(sample.response_mask) == len(sample.response_ids)
        assert sum(sample.response_mask) == len(generated)
        assert [tok for tok, m in zip(sample.response_ids, sample.response_mask) if m] == generated
        # logprobs aligned with the response, 0.0 where masked
        assert sample.response_logprobs is not None
        assert len(sample.response_logprobs) == len(sample.response_ids)
        assert [lp for lp, m in zip(sample.response_logprobs, sample.response_mask) if m] == [
            lp for t in merged for lp in (t.response_logprobs or [])
        ]
        assert all(lp == 0.0 for lp, m in zip(sample.response_logprobs, sample.response_mask) if not m)

    # a corruption yields exactly one counted mismatch, where it was made; a clean chat is one sample
    for calls, corruption in conversations:
        key = (calls[0].attempt_id, calls[0].policy)
        mismatches = [(m.step, m.token_index) for m in result.prefix_mismatches if (m.attempt_id, m.policy) == key]
        samples = [s for s in result.samples if by_span[s.span_ids[0]].attempt_id == key[0] and s.policy == key[1]]
        if corruption is None:
            assert mismatches == [] and len(samples) == 1
        else:
            assert mismatches == [corruption] and len(samples) == 2
    assert len(result.prefix_mismatches) == sum(c is not None for _, c in conversations)
