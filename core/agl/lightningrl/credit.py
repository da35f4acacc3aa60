"""Credit assignment: how much of a rollout's reward each of its transitions gets.

A rule sees the selected transitions of one attempt in call order (``t = 0 .. T-1``, whatever their
policies), the rollout's episode reward ``R`` and each transition's step rewards ``s_t`` (the sum of
``Transition.step_rewards``: emitted step rewards linked to the call and AIR), and returns one reward
``r_t`` per transition, which becomes ``Transition.reward`` and the sample's reward.

Built-in rules (``credit=`` name in the LightningRL config):

- ``"broadcast"`` (:class:`Broadcast`): every call gets the outcome, plus what it caused itself::

      r_t = R + s_t

- ``"discounted"`` (:class:`Discounted`, needs ``gamma`` in [0, 1]): the discounted return from call t on,
  with the episode reward arriving after the last call::

      r_t = G_t = sum_{k=t}^{T-1} gamma^(k-t) * s_k  +  gamma^(T-1-t) * R

  (``gamma = 1``: ``R`` plus the step rewards from t on; ``gamma = 0``: ``s_t``, and ``R`` for the last
  call only.)

- ``"step"`` (:class:`StepOnly`): only the rewards attached to the call by span linkage::

      r_t = s_t

Any object with ``assign(transitions, episode_reward) -> list of floats`` (one per transition, same order)
is a rule too (:class:`CreditRule`).
"""

from __future__ import annotations

import math
from typing import List, Optional, Protocol, Sequence, Union, runtime_checkable

from agl.lightningrl.types import Transition


@runtime_checkable
class CreditRule(Protocol):
    """Assigns a reward to each transition of one attempt (given in call order)."""

    def assign(self, transitions: Sequence[Transition], episode_reward: float) -> List[float]: ...


def step_total(t: Transition) -> float:
    """``s_t``: the sum of a transition's step rewards."""
    return math.fsum(t.step_rewards.values())


class Broadcast:
    """``r_t = R + s_t``."""

    def assign(self, transitions: Sequence[Transition], episode_reward: float) -> List[float]:
        return [episode_reward + step_total(t) for t in transitions]

    def __repr__(self) -> str:
        return "Broadcast()"


class Discounted:
    """``r_t = sum_{k>=t} gamma^(k-t) s_k + gamma^(T-1-t) R``, computed backwards in O(T)."""

    def __init__(self, gamma: float) -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
        self.gamma = float(gamma)

    def assign(self, transitions: Sequence[Transition], episode_reward: float) -> List[float]:
        returns = [0.0] * len(transitions)
        future = episode_reward  # G_T := R, so G_{T-1} = s_{T-1} + R and G_t = s_t + gamma * G_{t+1}
        for i in range(len(transitions) - 1, -1, -1):
            returns[i] = step_total(transitions[i]) + future
            future = self.gamma * returns[i]
        return returns

    def __repr__(self) -> str:
        return f"Discounted(gamma={self.gamma})"


class StepOnly:
    """``r_t = s_t``."""

    def assign(self, transitions: Sequence[Transition], episode_reward: float) -> List[float]:
        return [step_total(t) for t in transitions]

    def __repr__(self) -> str:
        return "StepOnly()"


CREDIT_RULES = ("broadcast", "discounted", "step")


def credit_rule(credit: Union[str, CreditRule], gamma: Optional[float] = None) -> CreditRule:
    """The rule for a config value: a built-in name (``gamma`` only with ``"discounted"``) or a rule object."""
    if isinstance(credit, str):
        if credit == "discounted":
            if gamma is None:
                raise ValueError('credit="discounted" needs gamma (the discount factor in [0, 1]), e.g. "gamma": 0.9')
            return Discounted(gamma)
        if gamma is not None:
            raise ValueError(f'gamma is only used by credit="discounted", not by credit={credit!r}')
        if credit == "broadcast":
            return Broadcast()
        if credit == "step":
            return StepOnly()
        raise ValueError(f"unknown credit rule {credit!r}; known: {list(CREDIT_RULES)} or an object with assign()")
    if isinstance(credit, CreditRule):
        if gamma is not None:
            raise ValueError('gamma is only used by credit="discounted"; a custom rule takes its own settings')
        return credit
    raise TypeError(
        f"credit must be one of {list(CREDIT_RULES)} or an object with assign(), got {type(credit).__name__}"
    )
