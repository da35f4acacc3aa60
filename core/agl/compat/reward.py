"""Agent Lightning's deprecated ``agentlightning.reward`` module: the ``@reward`` decorator and the reward
readers, the same objects as :mod:`agl.compat.emitter` serves (``from agl.reward import find_final_reward``)."""

from __future__ import annotations

from agl.compat.emitter import (
    emit_reward,
    find_final_reward,
    find_reward_spans,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
    reward,
)

__all__ = [
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "reward",
]
