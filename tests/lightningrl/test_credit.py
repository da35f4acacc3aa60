"""Credit rules: hand-computed cases, the discounted return against its closed form, and config errors."""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.lightningrl.credit import Broadcast, CreditRule, Discounted, StepOnly, credit_rule
from agl.lightningrl.types import Transition


def steps(*step_rewards: Dict[str, float]) -> List[Transition]:
    return [
        Transition(
            rollout_id="r",
            attempt_id="a",
            task_id="t",
            span_id=f"s{i}",
            step=i,
            prompt_ids=[1],
            response_ids=[2],
            step_rewards=dict(sr),
        )
        for i, sr in enumerate(step_rewards)
    ]


def test_broadcast_adds_each_calls_own_step_rewards() -> None:
    calls = steps({}, {"air.tool_error": -0.1, "quality": 0.5}, {})
    assert Broadcast().assign(calls, 1.0) == pytest.approx([1.0, 1.4, 1.0])


def test_discounted_hand_computed() -> None:
    calls = steps({"s": 0.5}, {}, {"s": -0.2})
    # G_2 = -0.2 + 1.0 = 0.8; G_1 = 0 + 0.5 * 0.8 = 0.4; G_0 = 0.5 + 0.5 * 0.4 = 0.7
    assert Discounted(0.5).assign(calls, 1.0) == pytest.approx([0.7, 0.4, 0.8])
    assert Discounted(1.0).assign(steps({}, {}), 2.0) == [2.0, 2.0]
    assert Discounted(0.0).assign(calls, 1.0) == pytest.approx([0.5, 0.0, 0.8])


def test_step_only() -> None:
    assert StepOnly().assign(steps({"a": 1.0, "b": 2.0}, {}), 5.0) == [3.0, 0.0]


def test_empty_attempt() -> None:
    for rule in (Broadcast(), Discounted(0.9), StepOnly()):
        assert rule.assign([], 1.0) == []


@settings(max_examples=200, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), max_size=12),
    gamma=st.floats(0, 1),
    episode=st.floats(-5, 5, allow_nan=False),
)
def test_discounted_matches_the_closed_form(rewards: List[float], gamma: float, episode: float) -> None:
    calls = steps(*({"s": r} for r in rewards))
    got = Discounted(gamma).assign(calls, episode)
    n = len(rewards)
    for t in range(n):
        expected = math.fsum(gamma ** (k - t) * rewards[k] for k in range(t, n)) + gamma ** (n - 1 - t) * episode
        assert got[t] == pytest.approx(expected, abs=1e-9)


def test_credit_rule_from_config() -> None:
    assert isinstance(credit_rule("broadcast"), Broadcast)
    assert isinstance(credit_rule("step"), StepOnly)
    assert credit_rule("discounted", 0.9).gamma == 0.9

    class Last:
        def assign(self, transitions, episode_reward):
            return [episode_reward if i == len(transitions) - 1 else 0.0 for i in range(len(transitions))]

    custom = Last()
    assert isinstance(custom, CreditRule) and credit_rule(custom) is custom
    with pytest.raises(ValueError, match="needs gamma"):
        credit_rule("discounted")
    with pytest.raises(ValueError, match="only used by"):
        credit_rule("broadcast", 0.9)
    with pytest.raises(ValueError, match="unknown credit rule"):
        credit_rule("montecarlo")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        credit_rule("discounted", 1.5)
    with pytest.raises(TypeError, match="assign"):
        credit_rule(42)  # type: ignore[arg-type]
