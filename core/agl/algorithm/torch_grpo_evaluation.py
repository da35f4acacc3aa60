"""TorchGRPO's evaluations: the validation tasks run with the current policy before, during and after training
(``val_sampling``, and each of ``extra_evals`` before and after only), and what a run returns and prints."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agl.algorithm.metrics import MetricsLog, ascii_curve, console
from agl.algorithm.torch_grpo_config import TorchGRPOBase
from agl.types import Rollout, Task

logger = logging.getLogger("agl.train")


@dataclass
class Evaluation:
    """One pass over the validation tasks."""

    name: str
    step: int
    success: float
    reward_mean: float
    n: int
    failed: int
    seconds: float

    def as_row(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "success": self.success,
            "reward_mean": self.reward_mean,
            "n": self.n,
            "failed": self.failed,
            "seconds": self.seconds,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Evaluation:
        return cls(**{k: row[k] for k in ("name", "step", "success", "reward_mean", "n", "failed", "seconds")})

    def __str__(self) -> str:
        return (
            f"[{self.name}] held-out success {self.success:.1%} ({round(self.success * self.n)}/{self.n}), mean reward "
            f"{self.reward_mean:.3f}, {self.failed} failed rollouts, {self.seconds:.0f} s"
        )


@dataclass
class TrainResult:
    """What ``run`` returns (and ``Trainer.fit`` hands back)."""

    before: Optional[Evaluation]
    after: Optional[Evaluation]
    steps: int
    seconds: float
    output_dir: Path
    rows: List[Dict[str, float]] = field(default_factory=list)
    curve_png: Optional[Path] = None
    extra: Dict[str, Tuple[Evaluation, Evaluation]] = field(default_factory=dict)  # name: (before, after)

    @property
    def improvement(self) -> Optional[float]:
        """Held-out success after minus before (a fraction; 0.2 is 20 points)."""
        if self.before is None or self.after is None:
            return None
        return self.after.success - self.before.success


class Evaluations(TorchGRPOBase):
    """The part of :class:`~agl.algorithm.torch_grpo.TorchGRPO` that evaluates its policy (its settings and
    ``state`` are TorchGRPO's)."""

    def _first_evaluations(self, val_tasks: List[Task], metrics: MetricsLog, started: float) -> Dict[str, Evaluation]:
        """The untrained policy's evaluations by name (kept in the checkpoint: a resumed run reports them).

        In a fresh run, once the evaluations made so far leave the time budget no room for a step (they take as
        long again at the end), the extra ones are skipped: no step will run, so they would only delay the "no
        training step" message (the main job on a busy machine: 4 more minutes after the budget was spent)."""
        out: Dict[str, Evaluation] = {}
        if not val_tasks:
            return out
        names = ["val", *self.extra_evals]
        for i, name in enumerate(names):
            saved = [e for e in self.state.evaluations if e["step"] == 0 and e.get("name") == name]
            if saved:
                out[name] = Evaluation.from_row(saved[0])
                continue
            if i > 0 and self.state.step == 0 and self._over_budget(started):
                logger.warning(
                    "skipping the untrained policy's %s evaluation: after the %s one, the time budget of %.0f s "
                    "leaves no room for a training step (%.0f s gone)",
                    ", ".join(names[i:]),
                    ", ".join(out),
                    self.time_budget_s,
                    time.monotonic() - started,
                )
                break
            out[name] = self._evaluate(val_tasks, metrics, name)
        return out

    def _final_evaluation(
        self, val_tasks: List[Task], metrics: MetricsLog, name: str, latest: Optional[Evaluation] = None
    ) -> Evaluation:
        """The evaluation ``name`` of the current weights: one already made at this step (``latest``, or one a
        resumed run finished with) is not run again."""
        if latest is not None and latest.name == name and latest.step == self.state.step:
            return latest
        saved = [e for e in self.state.evaluations if e["step"] == self.state.step and e.get("name") == name]
        return Evaluation.from_row(saved[-1]) if saved else self._evaluate(val_tasks, metrics, name)

    def _evaluate(self, val_tasks: List[Task], metrics: MetricsLog, name: str = "val") -> Evaluation:
        started = time.monotonic()
        overrides = self.val_sampling if name == "val" else self.extra_evals[name]
        sampling = {**self._train_sampling(), **(overrides or {})}
        rollouts = self._run_rollouts(
            val_tasks, self._publish(sampling), mode="val", description=f"eval (step {self.state.step})"
        )
        rewards = final_rewards(rollouts)
        successes = sum(1 for r in rewards if r >= self.success_threshold)
        evaluation = Evaluation(
            name=name,
            step=self.state.step,
            success=successes / len(rollouts),
            reward_mean=sum(rewards) / len(rollouts),  # failed rollouts count as reward 0 here
            n=len(rollouts),
            failed=len(rollouts) - len(rewards),
            seconds=time.monotonic() - started,
        )
        self.state.evaluations.append(evaluation.as_row())
        metrics.note(f"eval at step {evaluation.step}: {evaluation}")
        console(f"eval at step {evaluation.step}: {evaluation}")
        return evaluation


def print_summary(result: TrainResult) -> None:
    """The run in a few lines on the console: its steps, the evaluations before and after, the success curve."""
    lines = [f"TorchGRPO: {result.steps} steps in {result.seconds:.0f} s; output in {result.output_dir}"]
    if result.before is not None:
        lines.append(f"  before training: {result.before}")
    if result.after is not None:
        lines.append(f"  after training:  {result.after}")
    if result.improvement is not None:
        lines.append(f"  held-out success {result.improvement * 100:+.1f} points")
    for name, (before, after) in result.extra.items():
        gain = (after.success - before.success) * 100
        lines.append(f"  {name}: {before.success:.1%} -> {after.success:.1%} ({gain:+.1f} points)")
    curve = [r["success_rate"] for r in result.rows if "success_rate" in r]
    if curve:
        lines.append(ascii_curve(curve, label="train success per step"))
    if result.curve_png is not None:
        lines.append(f"  curve: {result.curve_png}")
    console("\n".join(lines))


def final_rewards(rollouts: Sequence[Rollout]) -> List[float]:
    """The final rewards of the rollouts that succeeded with one (failed ones have none to count)."""
    return [r.final_reward for r in rollouts if r.status == "succeeded" and r.final_reward is not None]
