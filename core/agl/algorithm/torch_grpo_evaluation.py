"""TorchGRPO's evaluations: the validation tasks run with the current policy before, during and after training
(``val_sampling``, and each of ``extra_evals`` before and after only), and what a run returns and prints.

With a time budget the evaluations keep to it too: the ones before training share a third of it, and those
after training end with it. An evaluation still running at its deadline is cut short: its queued rollouts are
cancelled (the running ones end), it counts the tasks that ran, and every later evaluation runs those tasks
only, so that "before" and "after" compare the same tasks. A rollout that ran past its timeout gave no answer:
it is counted apart, not as a wrong answer."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agl.algorithm.metrics import MetricsLog, ascii_curve, console
from agl.algorithm.tool_calls import ToolCallStats
from agl.algorithm.torch_grpo_config import TorchGRPOBase
from agl.errors import IllegalTransitionError
from agl.types import Rollout, Task

logger = logging.getLogger("agl.train")

#: the share of the time budget that the evaluations before training may take together (those after training
#: take about as long again, which leaves training at least the rest)
BEFORE_SHARE = 1 / 3
CUT_POLL_S = 0.2  # past its deadline, how often an evaluation's queued rollouts are looked for and cancelled


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
    timed_out: int = 0  # rollouts past their timeout: no answer, so neither a success nor a wrong answer
    cut: int = 0  # tasks not run: the evaluation reached its deadline (the time budget) first
    task_ids: Optional[List[str]] = None  # the tasks it ran, when it ran fewer than it was given
    llm_calls_per_rollout: Optional[float] = None  # :mod:`agl.algorithm.tool_calls`
    tool_call_validity: Optional[float] = None  # None: no tool call was tried

    def as_row(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Evaluation:
        """An evaluation kept in a checkpoint (one saved before ``timed_out``, ``cut`` and ``task_ids`` has none)."""
        return cls(**{k: row[k] for k in cls.__dataclass_fields__ if k in row})

    @property
    def answered(self) -> int:
        """Rollouts that ended in time (a failed one counts: it is the agent's failure, not the clock's)."""
        return self.n - self.timed_out

    def __str__(self) -> str:
        if self.answered:
            rate = f"{self.success:.1%} ({round(self.success * self.answered)}/{self.answered})"
        else:
            rate = "- (no rollout answered in time)"
        text = (
            f"[{self.name}] held-out success {rate}, mean reward {self.reward_mean:.3f}, {self.failed} failed "
            f"rollouts, {self.seconds:.0f} s"
        )
        if self.timed_out:
            text += f"; {self.timed_out} timed out (no answer: not counted)"
        if self.cut:
            text += f"; {self.cut} of {self.n + self.cut} tasks cut to fit the time budget"
        if self.tool_call_validity is not None:
            calls = f"{self.llm_calls_per_rollout:.1f} LLM calls per rollout"
            text += f"; {calls}, tool-call validity {self.tool_call_validity:.0%}"
        return text


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
        """Held-out success after minus before (a fraction; 0.2 is 20 points); None when either has no answer."""
        if self.before is None or self.after is None or not (self.before.answered and self.after.answered):
            return None
        return self.after.success - self.before.success


class Evaluations(TorchGRPOBase):
    """The part of :class:`~agl.algorithm.torch_grpo.TorchGRPO` that evaluates its policy (its settings and
    ``state`` are TorchGRPO's)."""

    def _first_evaluations(self, val_tasks: List[Task], metrics: MetricsLog, started: float) -> Dict[str, Evaluation]:
        """The untrained policy's evaluations by name (kept in the checkpoint: a resumed run reports them).

        With a time budget they share its first third (:data:`BEFORE_SHARE`), each getting an equal part of
        what is left of it when it starts; an extra one is skipped once that is gone, or once no training step
        fits any more (no step will run, so it would only delay the "no training step" message: the main job
        on a busy machine took 4 more minutes after the budget was spent)."""
        out: Dict[str, Evaluation] = {}
        if not val_tasks:
            return out
        names = ["val", *self.extra_evals]
        share_end = None if self.time_budget_s is None else started + self.time_budget_s * BEFORE_SHARE
        for i, name in enumerate(names):
            saved = [e for e in self.state.evaluations if e["step"] == 0 and e.get("name") == name]
            if saved:
                out[name] = Evaluation.from_row(saved[0])
                continue
            now = time.monotonic()
            if i > 0 and self.state.step == 0 and (self._over_budget(started) or (share_end or math.inf) <= now):
                logger.warning(
                    "skipping the untrained policy's %s evaluation: after the %s one, the time budget of %.0f s "
                    "leaves no room for it (%.0f s gone)",
                    ", ".join(names[i:]),
                    ", ".join(out),
                    self.time_budget_s,
                    now - started,
                )
                break
            deadline = None if share_end is None else now + max(0.0, share_end - now) / (len(names) - i)
            out[name] = self._evaluate(val_tasks, metrics, name, deadline)
        return out

    def _final_evaluation(
        self,
        val_tasks: List[Task],
        metrics: MetricsLog,
        name: str,
        started: float,
        latest: Optional[Evaluation] = None,
    ) -> Evaluation:
        """The evaluation ``name`` of the current weights, cut short at the end of the time budget: one already
        made at this step (``latest``, or one a resumed run finished with) is not run again."""
        if latest is not None and latest.name == name and latest.step == self.state.step:
            return latest
        saved = [e for e in self.state.evaluations if e["step"] == self.state.step and e.get("name") == name]
        if saved:
            return Evaluation.from_row(saved[-1])
        deadline = None if self.time_budget_s is None else started + self.time_budget_s
        return self._evaluate(val_tasks, metrics, name, deadline)

    def _evaluate(
        self, val_tasks: List[Task], metrics: MetricsLog, name: str = "val", deadline: Optional[float] = None
    ) -> Evaluation:
        started = time.monotonic()
        overrides = self.val_sampling if name == "val" else self.extra_evals[name]
        resources_id = self._publish({**self._train_sampling(), **(overrides or {})})
        tasks = self._evaluated_tasks(val_tasks, name)
        rollouts = self._rollouts_until(tasks, resources_id, deadline, f"eval (step {self.state.step})")
        evaluation = _score(name, self.state.step, rollouts, self.success_threshold, time.monotonic() - started)
        calls = ToolCallStats.of(self.store.query_spans(r.rollout_id) for r in rollouts if r.status != "cancelled")
        evaluation.llm_calls_per_rollout, evaluation.tool_call_validity = calls.llm_calls_per_rollout, calls.validity
        self.state.evaluations.append(evaluation.as_row())
        metrics.evaluated(evaluation.step, name, evaluation.success)
        metrics.note(f"eval at step {evaluation.step}: {evaluation}")
        console(f"eval at step {evaluation.step}: {evaluation}")
        return evaluation

    def _evaluated_tasks(self, val_tasks: List[Task], name: str) -> List[Task]:
        """The tasks an evaluation runs: those of the untrained policy's evaluation of that name (else of its
        "val" one) when it was cut short, so that every later evaluation compares the same tasks."""
        first = {e.get("name"): e for e in self.state.evaluations if e["step"] == 0 and e.get("task_ids")}
        chosen = first.get(name) or first.get("val")
        if chosen is None:
            return val_tasks
        kept = set(chosen["task_ids"])
        return [task for task in val_tasks if task.task_id in kept]

    def _rollouts_until(
        self, tasks: List[Task], resources_id: str, deadline: Optional[float], description: str
    ) -> List[Rollout]:
        """The evaluation's rollouts; at ``deadline`` the ones still queued are cancelled (the running ones end
        as they would: cancelling them would not stop a sync agent, only its report)."""
        if deadline is None:
            return self._run_rollouts(tasks, resources_id, mode="val", description=description)
        finished = threading.Event()
        cutter = threading.Thread(
            target=self._cut_at, args=(resources_id, deadline, finished), name="agl-eval-deadline", daemon=True
        )
        cutter.start()
        try:
            return self._run_rollouts(tasks, resources_id, mode="val", description=description)
        finally:
            finished.set()
            cutter.join()

    def _cut_at(self, resources_id: str, deadline: float, finished: threading.Event) -> None:
        """From ``deadline`` until the evaluation has ``finished``: cancel its rollouts still queued, once one of
        them has started (a deadline already past when the evaluation starts leaves it the rollouts the
        runners took first, rather than none; the rollouts may also be enqueued after it)."""
        if finished.wait(max(0.0, deadline - time.monotonic())):
            return
        while not finished.wait(CUT_POLL_S):
            ours = [r for r in self.store.query_rollouts(mode="val") if r.resources_id == resources_id]
            if not any(r.status != "queued" for r in ours):
                continue
            for rollout in ours:
                if rollout.status == "queued":
                    try:
                        self.store.cancel_rollout(rollout.rollout_id)
                    except IllegalTransitionError:  # a runner took it meanwhile: it runs to its end
                        pass


def _score(name: str, step: int, rollouts: Sequence[Rollout], threshold: float, seconds: float) -> Evaluation:
    """An evaluation of ``rollouts``: a cancelled one was cut (not run), a timed-out one gave no answer (counted
    apart), a failed one counts as a wrong answer with reward 0."""
    ran = [r for r in rollouts if r.status != "cancelled"]
    timed_out = sum(1 for r in ran if r.attempt is not None and r.attempt.status == "timeout")
    rewards = final_rewards(ran)
    answered = len(ran) - timed_out
    cut = len(rollouts) - len(ran)
    return Evaluation(
        name=name,
        step=step,
        success=sum(1 for r in rewards if r >= threshold) / answered if answered else math.nan,
        reward_mean=sum(rewards) / answered if answered else math.nan,  # failed rollouts count as reward 0 here
        n=len(ran),
        failed=answered - len(rewards),
        seconds=seconds,
        timed_out=timed_out,
        cut=cut,
        task_ids=list(dict.fromkeys(r.task_id for r in ran)) if cut else None,
    )


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
        if not (before.answered and after.answered):
            lines.append(f"  {name}: no comparison: no rollout answered in time before or after training")
            continue
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
