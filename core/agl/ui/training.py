"""The training view: reward and success per step and the held-out evaluations, from the rollouts alone.

agl's trainers write no step number into the store: each TorchGRPO step (and each evaluation) runs its
rollouts with resources it has just published, and runs one batch at a time. So the rollouts of one
resources version in ``train`` mode are one step, numbered in the order they were enqueued, and an
evaluation (``val`` mode) counts the steps enqueued before it (0: before training). Failed rollouts count as
reward 0 and cancelled ones not at all, as TorchGRPO scores its evaluations. Only the newest ``window``
rollouts are read (two LIMIT/OFFSET queries), so a refresh stays cheap on a store of any size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from agl.store.base import LightningStore
from agl.types import Rollout
from agl.ui.chart import Series, svg_chart
from agl.ui.html import esc, number, table
from agl.ui.queries import Counts, ResourceVersions

WINDOW = 5_000
MAX_WINDOW = 100_000


@dataclass
class Group:
    """The rollouts of one resources version in one mode: a training step or an evaluation."""

    step: int
    mode: str
    resources_id: Optional[str]
    rewards: List[float]  # of finished rollouts (failed: 0)
    unfinished: int = 0

    def reward_mean(self) -> Optional[float]:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def success(self, threshold: float) -> Optional[float]:
        return sum(1 for r in self.rewards if r >= threshold) / len(self.rewards) if self.rewards else None


@dataclass
class TrainingView:
    steps: List[Group]
    evaluations: List[Group]
    first: int  # index (0-based, enqueue order) of the first rollout read
    total: int
    versions: Dict[str, int]


def training_view(store: LightningStore, versions: ResourceVersions, counts: Counts, window: int) -> TrainingView:
    """The steps and evaluations among the newest ``window`` rollouts of the store (and any enqueued since the
    count, which may be a few seconds old)."""
    first = max(0, sum(counts.of(store).values()) - window)
    groups: Dict[Tuple[str, Optional[str]], Group] = {}
    steps = total = 0
    for rollout in store.query_rollouts(offset=first):
        total += 1
        if rollout.mode not in ("train", "val"):
            continue
        key = (rollout.mode, rollout.resources_id)
        group = groups.get(key)
        if group is None:
            steps += rollout.mode == "train"
            group = groups[key] = Group(steps, rollout.mode, rollout.resources_id, [])
        _add(group, rollout)
    ids = [g.resources_id for g in groups.values()]
    return TrainingView(
        steps=[g for g in groups.values() if g.mode == "train"],
        evaluations=[g for g in groups.values() if g.mode == "val"],
        first=first,
        total=first + total,
        versions=versions.of(store, ids),
    )


def _add(group: Group, rollout: Rollout) -> None:
    if rollout.status == "succeeded":
        group.rewards.append(rollout.final_reward if rollout.final_reward is not None else 0.0)
    elif rollout.status == "failed":
        group.rewards.append(0.0)
    elif rollout.status != "cancelled":
        group.unfinished += 1


def render_training(view: TrainingView, threshold: float, window: int) -> str:
    """The page body: two charts (reward, success) and the table of steps and evaluations."""
    rewards = Series("train reward (mean)", _points(view.steps, lambda g: g.reward_mean()), "#3b5bdb")
    success = Series("train success", _points(view.steps, lambda g: g.success(threshold)), "#2f9e44")
    held_out = Series("held-out success", _points(view.evaluations, lambda g: g.success(threshold)), "#e8590c", True)
    held_reward = Series(
        "held-out reward (mean)", _points(view.evaluations, lambda g: g.reward_mean()), "#e8590c", True
    )
    scope = (
        f"the whole store ({view.total} rollouts)"
        if view.first == 0
        else f"the newest {view.total - view.first} of {view.total} rollouts: steps are counted from rollout "
        f"{view.first + 1} (raise window= to read more)"
    )
    form = (
        '<form class="filters" method="get">'
        f'<label>success: reward &ge;<input name="threshold" value="{esc(number(threshold))}" size="5"></label>'
        f'<label>rollouts read<input name="window" value="{window}" size="7"></label>'
        "<button>Show</button></form>"
    )
    rows = sorted(view.steps + view.evaluations, key=lambda g: (g.step, g.mode == "val"))
    cells = [
        [
            str(g.step),
            "training step" if g.mode == "train" else "held-out evaluation",
            esc(view.versions.get(g.resources_id or "", "")),
            str(len(g.rewards)),
            str(g.unfinished),
            number(g.reward_mean()),
            number(g.success(threshold)),
        ]
        for g in rows
    ]
    headers = ["step", "what", "policy version", "finished", "unfinished", "reward (mean)", "success"]
    return (
        f"<h1>Training</h1>{form}"
        f'<p class="note">Read from {esc(scope)}. A step is the train rollouts of one resources version; '
        "an evaluation at step N ran after N steps. The page reloads every few seconds.</p>"
        + svg_chart("Reward per step", [rewards, held_reward], "step")
        + svg_chart("Success per step", [success, held_out], "step")
        + table(headers, cells, numeric=(0, 2, 3, 4, 5, 6))
    )


def _points(groups: List[Group], value: Callable[[Group], Optional[float]]) -> List[Tuple[float, float]]:
    points = []
    for group in groups:
        y = value(group)
        if y is not None:
            points.append((float(group.step), y))
    return points
