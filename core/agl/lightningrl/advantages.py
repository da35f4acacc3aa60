"""Advantages and loss weights for training samples: GRPO and RLOO at the rollout level.

Every estimator works on **rollouts**, not on samples. The samples of a task are grouped by ``task_id``;
inside a group each rollout contributes exactly one reward ``r_i`` (the ``reward`` of its samples, which must
all be equal), so a rollout that produced 10 samples weighs the same in the baseline as one that produced 1.
Every sample of rollout ``i`` then gets the rollout's advantage ``A_i`` and the loss weight

    loss_weight = 1 / n_samples(i)

so the loss weights of one rollout's samples sum to 1 and every rollout contributes equally to the loss.

Estimators return new :class:`Sample` objects (``dataclasses.replace``: the token lists are shared with the
input, the input samples themselves are not modified), in the input order.

Failed rollouts never get a silent reward of 0: :func:`resolve_rollout_rewards` either drops them (the
default) or fills them with a reward that was configured explicitly (``FailedRollouts(reward=0.0)``), and
reports which rollouts it dropped or filled.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Literal, Sequence, Union

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
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
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


def resolve_rollout_rewards(
    rollouts: Iterable[Rollout], policy: FailedRolloutPolicy = "drop"
) -> RewardResolution:
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


def _rollout_groups(samples: Sequence[Sample]) -> Dict[str, Dict[str, float]]:
    """``{task_id: {rollout_id: reward}}``; checks that a rollout has one task and one reward."""
    task_of: Dict[str, str] = {}
    groups: Dict[str, Dict[str, float]] = defaultdict(dict)
    for s in samples:
        task = task_of.setdefault(s.rollout_id, s.task_id)
        if task != s.task_id:
            raise ValueError(f"rollout {s.rollout_id!r} has samples of tasks {task!r} and {s.task_id!r}")
        reward = groups[task].setdefault(s.rollout_id, s.reward)
        if reward != s.reward:
            raise ValueError(
                f"rollout {s.rollout_id!r} has samples with rewards {reward!r} and {s.reward!r}; "
                "rollout-level advantages need one reward per rollout"
            )
    return groups


def _with_advantages(samples: Sequence[Sample], advantage: Dict[str, float]) -> List[Sample]:
    counts: Dict[str, int] = defaultdict(int)
    for s in samples:
        counts[s.rollout_id] += 1
    return [replace(s, advantage=advantage[s.rollout_id], loss_weight=1.0 / counts[s.rollout_id]) for s in samples]


def grpo_advantages(samples: Sequence[Sample], *, normalize_std: bool = True, eps: float = 1e-6) -> List[Sample]:
    """GRPO: each rollout's reward relative to the other rollouts of its task, at the rollout level.

    For a task group of ``n`` rollouts with rewards ``r_1..r_n`` (one per rollout)::

        mean = (1/n) * sum_j r_j
        std  = sqrt( sum_j (r_j - mean)^2 / (n - 1) )        # sample standard deviation
        A_i  = (r_i - mean) / (std + eps)                   # normalize_std=True
        A_i  =  r_i - mean                                  # normalize_std=False

    A group of size 1 (``n == 1``) gets ``A = 0``; a group whose rewards are all equal gets ``A = 0`` exactly
    (no NaN). Every sample of rollout ``i`` gets ``advantage = A_i`` and ``loss_weight = 1 / n_samples(i)``.
    """
    advantage: Dict[str, float] = {}
    for group in _rollout_groups(samples).values():
        rewards = list(group.values())
        if len(rewards) == 1:
            advantage.update(dict.fromkeys(group, 0.0))
            continue
        mean = statistics.mean(rewards)  # exact (fractions): equal rewards give r_i - mean == 0.0
        scale = statistics.stdev(rewards, mean) + eps if normalize_std else 1.0
        advantage.update({rid: (r - mean) / scale for rid, r in group.items()})
    return _with_advantages(samples, advantage)


def rloo_advantages(samples: Sequence[Sample]) -> List[Sample]:
    """RLOO: each rollout's reward minus the mean reward of the other rollouts of its task (leave-one-out).

    For a task group of ``n >= 2`` rollouts with rewards ``r_1..r_n`` (one per rollout)::

        A_i = r_i - (1/(n-1)) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean)

    A group of size 1 gets ``A = 0``. Every sample of rollout ``i`` gets ``advantage = A_i`` and
    ``loss_weight = 1 / n_samples(i)``.
    """
    advantage: Dict[str, float] = {}
    for group in _rollout_groups(samples).values():
        n = len(group)
        if n == 1:
            advantage.update(dict.fromkeys(group, 0.0))
            continue
        mean = statistics.mean(group.values())
        advantage.update({rid: n / (n - 1) * (r - mean) for rid, r in group.items()})
    return _with_advantages(samples, advantage)


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
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
    return fn(samples, **kwargs)
