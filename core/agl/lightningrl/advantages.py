"""Advantages and loss weights for training samples: GRPO and RLOO at the rollout level.

Every estimator works on **rollouts**, not on samples. The samples of a task are grouped by
``(mode, task_id)`` into ``n`` rollouts (training and validation rollouts never share a group, even under
one task id); rollout ``i`` has ``T_i`` samples with rewards ``r_{i,1..T_i}`` (all equal under the
broadcast credit rule, different per call under discounted or step credit). Each rollout weighs the same
in the group statistics however many samples it produced: its samples count with weight ``1 / T_i``::

    rbar_i = (1/T_i) * sum_t r_{i,t}                              # the rollout's mean reward
    mean   = (1/n)   * sum_i rbar_i

When each rollout has one reward (``r_{i,t} = r_i``) this is plain GRPO / RLOO over the ``n`` rollout
rewards. Every sample of rollout ``i`` gets the loss weight

    loss_weight = 1 / T_i

so the loss weights of one rollout's samples sum to 1 and every rollout contributes equally to the loss.

Estimators return new :class:`Sample` objects (copies with ``advantage`` and ``loss_weight`` set: the token
lists are shared with the input, the input samples themselves are not modified), in the input order.

Failed rollouts never get a silent reward of 0: :func:`resolve_rollout_rewards` either drops them (the
default) or fills them with a reward that was configured explicitly (``FailedRollouts(reward=0.0)``), and
reports which rollouts it dropped or filled.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Literal, Sequence, Tuple, Union

from agl.checks import is_finite_number
from agl.lightningrl.types import Sample
from agl.types import Rollout

# ---------------------------------------------------------------------------------------------------------
# Failed rollouts
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailedRollouts:
    """Fill failed rollouts (and rollouts without a reward) with this reward instead of dropping them.

    ``reward`` has no default on purpose: the value a failure is worth is a training decision.
    """

    reward: float

    def __post_init__(self) -> None:
        if not is_finite_number(self.reward):
            raise ValueError(f"FailedRollouts.reward must be a finite number, got {self.reward!r}")


FailedRolloutPolicy = Union[Literal["drop"], FailedRollouts]
"""How to treat a rollout that did not succeed or has no ``final_reward``: ``"drop"`` it (the default), or
fill it with ``FailedRollouts(reward=...)``."""


@dataclass
class RewardResolution:
    """The episode reward of every kept rollout, and which rollouts were dropped or filled (ids in input
    order)."""

    rewards: Dict[str, float] = field(default_factory=dict)
    dropped: List[str] = field(default_factory=list)
    filled: List[str] = field(default_factory=list)

    @property
    def n_dropped(self) -> int:
        return len(self.dropped)

    @property
    def n_filled(self) -> int:
        return len(self.filled)


def resolve_rollout_rewards(rollouts: Iterable[Rollout], policy: FailedRolloutPolicy = "drop") -> RewardResolution:
    """The episode reward per rollout id, with failed rollouts handled by ``policy``.

    A rollout is *ok* when ``status == "succeeded"`` and ``final_reward is not None``; its reward is
    ``final_reward``. Every other rollout (failed, cancelled, not finished, or succeeded without a reward) is
    either dropped (``policy="drop"``: absent from ``rewards``, listed in ``dropped``) or given
    ``policy.reward`` (``FailedRollouts``: listed in ``filled``); a failed rollout's own ``final_reward``, if
    any, is ignored.
    """
    if not (policy == "drop" or isinstance(policy, FailedRollouts)):
        raise ValueError(f'policy must be "drop" or FailedRollouts(reward=...), got {policy!r}')
    out = RewardResolution()
    for rollout in rollouts:
        if rollout.status == "succeeded" and rollout.final_reward is not None:
            out.rewards[rollout.rollout_id] = float(rollout.final_reward)
        elif isinstance(policy, FailedRollouts):
            out.rewards[rollout.rollout_id] = float(policy.reward)
            out.filled.append(rollout.rollout_id)
        else:
            out.dropped.append(rollout.rollout_id)
    return out


# ---------------------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------------------


class _Rollout:
    """The sample indices and rewards of one rollout of a group."""

    __slots__ = ("indices", "rewards")

    def __init__(self) -> None:
        self.indices: List[int] = []
        self.rewards: List[float] = []

    def mean(self) -> float:
        """``rbar_i``; exactly the reward when all are equal (so equal rewards give exact zeros later)."""
        first = self.rewards[0]
        if all(r == first for r in self.rewards):
            return first
        return math.fsum(self.rewards) / len(self.rewards)


def _rollout_groups(samples: Sequence[Sample]) -> List[List[_Rollout]]:
    """The rollouts of each ``(mode, task_id)``, in first-seen order; checks that a rollout belongs to one.

    The mode is part of the group: a validation rollout is never in a training task's group, even when the
    two datasets gave their tasks the same id.
    """
    task_of: Dict[str, Tuple[str, str]] = {}
    groups: Dict[Tuple[str, str], Dict[str, _Rollout]] = defaultdict(dict)
    for index, s in enumerate(samples):
        task = task_of.setdefault(s.rollout_id, (s.mode, s.task_id))
        if task != (s.mode, s.task_id):
            raise ValueError(
                f"rollout {s.rollout_id!r} has samples of tasks {task[1]!r} ({task[0]}) and {s.task_id!r} ({s.mode})"
            )
        rollout = groups[task].get(s.rollout_id)
        if rollout is None:
            rollout = groups[task][s.rollout_id] = _Rollout()
        rollout.indices.append(index)
        rollout.rewards.append(s.reward)
    return [list(group.values()) for group in groups.values()]


def _with_advantages(samples: Sequence[Sample], advantages: List[float], groups: List[List[_Rollout]]) -> List[Sample]:
    weights = [1.0] * len(samples)
    for group in groups:
        for rollout in group:
            for i in rollout.indices:
                weights[i] = 1.0 / len(rollout.indices)
    return [_with(s, a, w) for s, a, w in zip(samples, advantages, weights)]


def _with(sample: Sample, advantage: float, loss_weight: float) -> Sample:
    """``dataclasses.replace(sample, advantage=..., loss_weight=...)`` in half the time (a Sample has no
    ``__post_init__`` and no ``init=False`` field, so copying its fields is all ``replace`` does)."""
    new = object.__new__(Sample)
    new.__dict__.update(sample.__dict__)
    new.advantage = advantage
    new.loss_weight = loss_weight
    return new


def grpo_advantages(samples: Sequence[Sample], *, normalize_std: bool = True, eps: float = 1e-6) -> List[Sample]:
    """GRPO: each sample's reward relative to the rollouts of its task, with rollout-level statistics.

    For a task group of ``n`` rollouts (``rbar_i``, ``mean`` and ``T_i`` as in the module docstring)::

        var     = sum_i (1/T_i) * sum_t (r_{i,t} - mean)^2 / (n - 1)     # sample variance over rollouts
        A_{i,t} = (r_{i,t} - mean) / (sqrt(var) + eps)                   # normalize_std=True
        A_{i,t} =  r_{i,t} - mean                                        # normalize_std=False

    With one reward per rollout, ``var`` is the sample variance of the ``n`` rollout rewards. A group of
    size 1 gets ``A = 0``; a group whose rewards are all equal gets ``A = 0`` exactly (no NaN). Every
    sample of rollout ``i`` gets ``loss_weight = 1 / T_i``.
    """
    advantages = [0.0] * len(samples)
    groups = _rollout_groups(samples)
    for group in groups:
        n = len(group)
        if n == 1:
            continue
        mean = statistics.mean(r.mean() for r in group)  # exact (fractions): equal rewards give r - mean == 0.0
        scale = 1.0
        if normalize_std:
            var = math.fsum(math.fsum((x - mean) ** 2 for x in r.rewards) / len(r.rewards) for r in group) / (n - 1)
            scale = math.sqrt(var) + eps
        for rollout in group:
            for i, reward in zip(rollout.indices, rollout.rewards):
                advantages[i] = (reward - mean) / scale
    return _with_advantages(samples, advantages, groups)


def rloo_advantages(samples: Sequence[Sample]) -> List[Sample]:
    """RLOO: each sample's reward minus the mean of the *other* rollouts of its task (leave-one-out).

    For a task group of ``n >= 2`` rollouts (``rbar_i`` and ``mean`` as in the module docstring)::

        A_{i,t} = r_{i,t} - (1/(n-1)) * sum_{j != i} rbar_j
                = (r_{i,t} - rbar_i) + n/(n-1) * (rbar_i - mean)

    With one reward per rollout this is ``n/(n-1) * (r_i - mean)``. A group of size 1 gets ``A = 0``. Every
    sample of rollout ``i`` gets ``loss_weight = 1 / T_i``.
    """
    advantages = [0.0] * len(samples)
    groups = _rollout_groups(samples)
    for group in groups:
        n = len(group)
        if n == 1:
            continue
        means = [r.mean() for r in group]
        mean = statistics.mean(means)
        for rollout, rbar in zip(group, means):
            for i, reward in zip(rollout.indices, rollout.rewards):
                advantages[i] = (reward - rbar) + n / (n - 1) * (rbar - mean)
    return _with_advantages(samples, advantages, groups)


AdvantageEstimator = Callable[..., List[Sample]]
"""``estimator(samples, **options) -> new samples`` with ``advantage`` and ``loss_weight`` set, same order."""


ADVANTAGE_ESTIMATORS: Dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(samples: Sequence[Sample], estimator: str = "grpo", **kwargs: Any) -> List[Sample]:
    """Run the estimator registered under ``estimator`` (see ``ADVANTAGE_ESTIMATORS``) with ``kwargs``."""
    try:
        fn = ADVANTAGE_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return fn(samples, **kwargs)
