"""The advantage of each highlighted sample, as TorchGRPO's step computes it, or why there is none.

A TorchGRPO step hands the rollouts it ran to ``LightningRL.build_batch``, which groups the samples by
(policy, mode, task) and compares each rollout with the others of its group. The advantage of a rollout's
samples therefore depends only on its group: the ``train`` rollouts of the same task that ran with the same
resources version (one step). The page builds that group's batch with LightningRL's own code, so its values
are the ones training used (with LightningRL's defaults besides ``agent_match``: GRPO, broadcast credit,
failed rollouts dropped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from agl.lightningrl import LightningRL
from agl.lightningrl.advantages import resolve_rollout_rewards
from agl.store.base import LightningStore
from agl.types import Rollout

UNFINISHED = ("queued", "running")


@dataclass
class Advantages:
    """Span id -> its sample's advantage (empty when none can be given), and one line that says how the values
    were computed or why there are none."""

    by_span: Dict[str, float] = field(default_factory=dict)
    note: str = ""


def group_advantages(
    store: LightningStore, rollout: Rollout, attempt_id: Optional[str], latest: Optional[str], adapter: LightningRL
) -> Advantages:
    """The advantages of ``rollout``'s samples in the batch of its group (see the module docstring);
    ``attempt_id`` is the attempt shown, ``latest`` the one training reads."""
    why_not = _why_no_batch(rollout, attempt_id, latest, adapter)
    if why_not:
        return Advantages(note=f"No advantage: {why_not}.")
    group = [
        r for r in store.query_rollouts(task_id=rollout.task_id, mode="train") if r.resources_id == rollout.resources_id
    ]
    of_group = f"task {rollout.task_id} at this policy version"
    running = [r for r in group if r.status in UNFINISHED]
    if running:
        return Advantages(
            note=f"No advantage yet: {len(running)} of the {len(group)} rollouts of its group ({of_group}) have "
            "not finished; training builds the batch once they have."
        )
    used = resolve_rollout_rewards(group, adapter.failed).rewards
    if len(used) < 2:
        return Advantages(
            note=f"No advantage: a group of one ({of_group}): GRPO has no other rollout to compare it with (0)."
        )
    batch = adapter.build_batch(store, group, progress=False)
    mine = [s for s in batch.samples if s.rollout_id == rollout.rollout_id]
    return Advantages(
        by_span={span_id: s.advantage for s in mine for span_id in s.span_ids},
        note=f"Advantage over its group: {len(used)} finished rollouts of {of_group} (rewards "
        f"{_rewards(list(used.values()))}), computed by LightningRL's build_batch as a TorchGRPO step does, with "
        "LightningRL's defaults besides agent_match (GRPO, broadcast credit, failed rollouts dropped).",
    )


def _why_no_batch(rollout: Rollout, attempt_id: Optional[str], latest: Optional[str], adapter: LightningRL) -> str:
    """Why no training batch holds this attempt ("" when one can be built)."""
    if rollout.mode == "dev":
        return "dev rollouts (Trainer.dev) are never trained on"
    if rollout.mode == "val":
        return "held-out evaluations are not trained on"
    if attempt_id != latest:
        return "training reads the latest attempt of a rollout, not this one"
    if not rollout.resources_id:
        return "the rollout names no resources version, so its training step is unknown"
    if rollout.status in UNFINISHED:
        return f"the rollout is still {rollout.status}"
    if rollout.rollout_id not in resolve_rollout_rewards([rollout], adapter.failed).rewards:
        return f"the rollout {rollout.status} without a reward, and LightningRL drops such rollouts from the batch"
    return ""


def _rewards(rewards: List[float]) -> str:
    return ", ".join(f"{r:g}" for r in sorted(rewards))
