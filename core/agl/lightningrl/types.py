"""The data LightningRL passes between its steps: plain dataclasses of lists (no numpy or torch in core;
trainers build tensors from these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Transition:
    """One selected LLM call of one rollout attempt: what the policy saw, what it generated, its credit.

    ``prompt_ids`` / ``response_ids`` are the server's token ids exactly; ``response_logprobs`` has one
    entry per response token when the server returned logprobs. ``step`` orders the calls of one attempt
    (0, 1, ...). ``reward`` is the credit assigned to this call; ``step_rewards`` are rewards attached to the
    call itself (emitted inside its operation, or Automatic Intermediate Rewards), by name. ``mode`` is the
    rollout's (``"train"`` or ``"val"``): GRPO groups are formed per ``(mode, task_id)``.
    """

    rollout_id: str
    attempt_id: str
    task_id: str
    span_id: str
    step: int
    prompt_ids: List[int]
    response_ids: List[int]
    policy: str = "default"
    agent_name: Optional[str] = None
    response_logprobs: Optional[List[float]] = None
    reward: float = 0.0
    step_rewards: Dict[str, float] = field(default_factory=dict)
    mode: str = "train"


@dataclass
class Sample:
    """One training sample: a prompt and a response (``response_mask`` 1 on tokens the model generated,
    0 on tokens it did not, e.g. tool results inside a merged trajectory), with its advantage and the
    loss weight that makes every rollout weigh the same however many samples it produced. ``mode`` is its
    rollout's (``"train"`` or ``"val"``); the advantages group samples by ``(mode, task_id)``."""

    rollout_id: str
    task_id: str
    policy: str
    prompt_ids: List[int]
    response_ids: List[int]
    response_mask: List[int]
    reward: float
    advantage: float = 0.0
    loss_weight: float = 1.0
    response_logprobs: Optional[List[float]] = None
    span_ids: List[str] = field(default_factory=list)
    mode: str = "train"
