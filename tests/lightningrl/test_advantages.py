"""Rollout-level GRPO / RLOO advantages, loss weights and the failed-rollout policy: hand cases and properties."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Dict, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.lightningrl.advantages import (
    ADVANTAGE_ESTIMATORS,
    FailedRollouts,
    compute_advantages,
    grpo_advantages,
    resolve_rollout_rewards,
    rloo_advantages,
)
from agl.lightningrl.types import Sample
from agl.types import Rollout


def sample(rollout: str, reward: float, task: str = "t0", k: int = 0) -> Sample:
    return Sample(
        rollout_id=rollout,
        task_id=task,
        policy="default",
        prompt_ids=[1, 2],
        response_ids=[3, k],
        response_mask=[1, 1],
        reward=reward,
    )


def group(rewards: Dict[str, float], task: str = "t0") -> List[Sample]:
    return [sample(rid, r, task) for rid, r in rewards.items()]


def adv_by_rollout(samples: List[Sample]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for s in samples:
        assert out.setdefault(s.rollout_id, s.advantage) == s.advantage
    return out


# --- GRPO / RLOO hand cases -------------------------------------------------------------------------------


def test_grpo_with_std_hand_computed() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 1/sqrt(3)
    out = grpo_advantages(group({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0}), eps=0.0)
    expected = 0.5 * math.sqrt(3)
    assert adv_by_rollout(out) == pytest.approx({"a": expected, "b": -expected, "c": -expected, "d": expected})


def test_grpo_eps_in_denominator() -> None:
    # rewards 0, 2: mean 1, sample std sqrt(2)
    out = grpo_advantages(group({"a": 0.0, "b": 2.0}), eps=0.5)
    assert adv_by_rollout(out) == pytest.approx({"a": -1 / (math.sqrt(2) + 0.5), "b": 1 / (math.sqrt(2) + 0.5)})


def test_grpo_without_std() -> None:
    out = grpo_advantages(group({"a": 3.0, "b": 1.0, "c": 2.0}), normalize_std=False)
    assert adv_by_rollout(out) == pytest.approx({"a": 1.0, "b": -1.0, "c": 0.0})


def test_rloo_hand_computed() -> None:
    # A_a = 3 - (1 + 2)/2 = 1.5, A_b = 1 - (3 + 2)/2 = -1.5, A_c = 2 - (3 + 1)/2 = 0
    out = rloo_advantages(group({"a": 3.0, "b": 1.0, "c": 2.0}))
    assert adv_by_rollout(out) == pytest.approx({"a": 1.5, "b": -1.5, "c": 0.0})
    # two rollouts: A_i = r_i - r_other
    out = rloo_advantages(group({"a": 1.0, "b": 0.25}))
    assert adv_by_rollout(out) == pytest.approx({"a": 0.75, "b": -0.75})


# --- rollout-level weighting --------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_rollout_level_weighting(estimator: str) -> None:
    long = [sample("long", 1.0, k=k) for k in range(5)]
    short = [sample("short", 0.0)]
    out = compute_advantages(long + short, estimator)
    # the same advantages as with one sample per rollout: sample counts do not enter the baseline
    one_each = compute_advantages(group({"long": 1.0, "short": 0.0}), estimator)
    assert adv_by_rollout(out) == pytest.approx(adv_by_rollout(one_each))
    assert adv_by_rollout(out)["long"] == pytest.approx(-adv_by_rollout(out)["short"])
    assert [s.loss_weight for s in out] == pytest.approx([0.2] * 5 + [1.0])
    for rid in ("long", "short"):
        assert math.fsum(s.loss_weight for s in out if s.rollout_id == rid) == pytest.approx(1.0)


def test_returns_new_samples_in_order_inputs_untouched() -> None:
    inputs = [sample("a", 1.0, k=0), sample("b", 0.0), sample("a", 1.0, k=1)]
    out = grpo_advantages(inputs)
    assert [s.rollout_id for s in out] == ["a", "b", "a"]
    assert [s.response_ids for s in out] == [s.response_ids for s in inputs]
    assert all(o is not i for o, i in zip(out, inputs))
    assert all(s.advantage == 0.0 and s.loss_weight == 1.0 for s in inputs)


def test_rollout_of_two_tasks_rejected() -> None:
    with pytest.raises(ValueError, match="samples of tasks"):
        grpo_advantages([sample("a", 1.0, task="t1"), sample("a", 1.0, task="t2")])


# --- per-call rewards (discounted / step credit): rollout-level statistics -----------------------------------


def test_grpo_per_call_rewards_hand_computed() -> None:
    # rollout a: rewards 1, 3 (rbar 2, T=2); rollout b: reward 0 (T=1). mean = (2 + 0) / 2 = 1
    # var = [((1-1)^2 + (3-1)^2) / 2 + (0-1)^2 / 1] / (2 - 1) = 3
    out = grpo_advantages([sample("a", 1.0, k=0), sample("a", 3.0, k=1), sample("b", 0.0)], eps=0.0)
    s3 = math.sqrt(3)
    assert [s.advantage for s in out] == pytest.approx([0.0, 2 / s3, -1 / s3])
    assert [s.loss_weight for s in out] == [0.5, 0.5, 1.0]
    out = grpo_advantages([sample("a", 1.0, k=0), sample("a", 3.0, k=1), sample("b", 0.0)], normalize_std=False)
    assert [s.advantage for s in out] == pytest.approx([0.0, 2.0, -1.0])


def test_rloo_per_call_rewards_hand_computed() -> None:
    # rollout a: 1, 3 (rbar 2); b: 0; c: 4.  A_{a,t} = r_{a,t} - (0 + 4)/2, A_b = 0 - (2 + 4)/2, A_c = 4 - (2 + 0)/2
    samples = [sample("a", 1.0, k=0), sample("a", 3.0, k=1), sample("b", 0.0), sample("c", 4.0)]
    out = rloo_advantages(samples)
    assert [s.advantage for s in out] == pytest.approx([-1.0, 1.0, -3.0, 3.0])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_per_call_rewards_long_rollout_does_not_dominate(estimator: str) -> None:
    """Ten copies of a rollout's calls move the baseline no more than one copy does."""
    long = [sample("long", r, k=k) for k, r in enumerate([0.0, 2.0] * 5)]
    short = [sample("short", 0.0)]
    once = [sample("long", 0.0, k=0), sample("long", 2.0, k=1)] + short
    by_reward = lambda out: {(s.rollout_id, s.reward): s.advantage for s in out}  # noqa: E731 - a one-line callable handed on
    assert by_reward(compute_advantages(long + short, estimator)) == pytest.approx(
        by_reward(compute_advantages(once, estimator))
    )


# --- groups -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_singleton_group_gets_zero(estimator: str) -> None:
    out = compute_advantages([sample("a", 5.0, k=0), sample("a", 5.0, k=1)], estimator)
    assert [s.advantage for s in out] == [0.0, 0.0]
    assert [s.loss_weight for s in out] == [0.5, 0.5]


def test_groups_separated_by_task_id() -> None:
    samples = group({"a": 1.0, "b": 0.0}, task="t1") + group({"c": 10.0, "d": 20.0, "e": 30.0}, task="t2")
    samples += group({"f": 7.0}, task="t3")
    out = adv_by_rollout(grpo_advantages(samples, normalize_std=False))
    assert out == pytest.approx({"a": 0.5, "b": -0.5, "c": -10.0, "d": 0.0, "e": 10.0, "f": 0.0})


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_groups_separated_by_mode_under_one_task_id(estimator: str) -> None:
    """A validation rollout is never in a training group, even when the two datasets' ids collide."""
    samples = group({"a": 1.0, "b": 1.0}, task="t") + [dataclasses.replace(sample("v", 0.0, task="t"), mode="val")]
    out = compute_advantages(samples, estimator)
    assert [s.advantage for s in out] == [0.0, 0.0, 0.0]  # two equal rewards; a group of one
    assert [s.mode for s in out] == ["train", "train", "val"]
    with pytest.raises(ValueError, match=r"samples of tasks 't' \(train\) and 't' \(val\)"):
        compute_advantages([sample("a", 1.0, task="t"), dataclasses.replace(sample("a", 1.0, task="t"), mode="val")])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("reward", [0.0, 0.1, 1.0, -3.7])
def test_zero_variance_group_gives_exact_zero(estimator: str, reward: float) -> None:
    out = compute_advantages(group({"a": reward, "b": reward, "c": reward}), estimator)
    assert [s.advantage for s in out] == [0.0, 0.0, 0.0]


def test_registry_and_unknown_estimator() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo"}
    out = compute_advantages(group({"a": 2.0, "b": 0.0}), "grpo", normalize_std=False)
    assert adv_by_rollout(out) == {"a": 1.0, "b": -1.0}
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages([], "ppo")
    assert compute_advantages([]) == []


# --- failed rollouts ----------------------------------------------------------------------------------------


def rollouts() -> List[Rollout]:
    return [
        Rollout(rollout_id="ok1", task_id="t", status="succeeded", final_reward=1.0),
        Rollout(rollout_id="ok0", task_id="t", status="succeeded", final_reward=0.0),
        Rollout(rollout_id="failed", task_id="t", status="failed", final_reward=0.7),
        Rollout(rollout_id="noreward", task_id="t", status="succeeded"),
        Rollout(rollout_id="cancelled", task_id="t", status="cancelled"),
    ]


def test_failed_rollouts_dropped_by_default() -> None:
    res = resolve_rollout_rewards(rollouts())
    assert res.rewards == {"ok1": 1.0, "ok0": 0.0}
    assert res.dropped == ["failed", "noreward", "cancelled"] and res.n_dropped == 3
    assert res.filled == [] and res.n_filled == 0


def test_failed_rollouts_filled_with_configured_reward() -> None:
    res = resolve_rollout_rewards(rollouts(), FailedRollouts(reward=-1.0))
    assert res.rewards == {"ok1": 1.0, "ok0": 0.0, "failed": -1.0, "noreward": -1.0, "cancelled": -1.0}
    assert res.filled == ["failed", "noreward", "cancelled"] and res.n_filled == 3
    assert res.dropped == [] and res.n_dropped == 0
    # an explicit 0.0 is allowed, and reported as filled
    res = resolve_rollout_rewards(rollouts(), FailedRollouts(reward=0.0))
    assert res.rewards["failed"] == 0.0 and res.n_filled == 3


def test_no_silent_zero() -> None:
    with pytest.raises(TypeError):
        FailedRollouts()  # type: ignore[call-arg]
    for bad in (None, float("nan"), float("inf"), True, "0", 10**400):
        with pytest.raises(ValueError):
            FailedRollouts(reward=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        resolve_rollout_rewards(rollouts(), "zero")  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------------------------

rewards_st = st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=8)


@settings(max_examples=150, deadline=None)
@given(rewards=rewards_st, samples_per_rollout=st.lists(st.integers(1, 4), min_size=8, max_size=8))
def test_grpo_group_advantages_are_standardised(rewards: List[float], samples_per_rollout: List[int]) -> None:
    samples = [sample(f"r{i}", r, k=k) for i, r in enumerate(rewards) for k in range(samples_per_rollout[i])]
    adv = list(adv_by_rollout(grpo_advantages(samples)).values())  # one per rollout
    assert len(adv) == len(rewards)
    assert all(math.isfinite(a) for a in adv)
    assert statistics.fmean(adv) == pytest.approx(0.0, abs=1e-6)
    std = statistics.stdev(rewards)
    if std > 1e-3:
        assert statistics.stdev(adv) == pytest.approx(1.0, rel=1e-2)
    elif len(set(rewards)) == 1:  # not std == 0.0: Python 3.10's stdev underflows to 0 for [0.0, 2e-194]
        assert adv == [0.0] * len(rewards)
    else:  # a tiny spread: standardised, so never beyond (n - 1) / sqrt(n) (eps only shrinks them)
        assert all(abs(a) <= (len(rewards) - 1) / math.sqrt(len(rewards)) + 1e-9 for a in adv)
