"""TorchGRPO's training loop: each step runs ``group_size`` rollouts of ``batch_tasks`` tasks, turns them into
samples, updates the policy with the server paused and publishes the next version, logs the step's row and
checkpoints it; the loop ends at ``steps`` (or ``epochs``), the time budget, or an update that diverged."""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from agl.algorithm.base import EmptySteps
from agl.algorithm.metrics import MetricsLog, console
from agl.algorithm.tool_calls import ToolCallStats
from agl.algorithm.torch_grpo_config import TorchGRPOBase
from agl.algorithm.torch_grpo_evaluation import Evaluation, final_rewards
from agl.errors import AglError
from agl.lightningrl.types import Sample
from agl.types import Rollout, Task

logger = logging.getLogger("agl.train")


class TrainingDivergedError(AglError, RuntimeError):
    """An update made the trainable weights NaN or infinite: TorchGRPO stops before serving or saving them."""


class TrainingLoop(TorchGRPOBase):
    """The part of :class:`~agl.algorithm.torch_grpo.TorchGRPO` that runs its training steps (its settings,
    ``state``, ``server`` and ``update`` are TorchGRPO's)."""

    def _total_steps(self, n_tasks: int) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * math.ceil(n_tasks / self.batch_tasks)

    def _train(
        self,
        train_tasks: List[Task],
        val_tasks: List[Task],
        total_steps: int,
        adapter: Any,
        metrics: MetricsLog,
        started: float,
    ) -> Optional[Evaluation]:
        last_eval: Optional[Evaluation] = None
        empty_steps = EmptySteps(limit=3)
        equal_in_a_row = 0  # steps in a row whose every group had equal rewards (before this one)
        resources_id = self._publish(self._train_sampling())
        # Between batches of rollouts the server keeps the training settings (each batch sets its own).
        self.server.request_defaults = dict(self._sampling_of[resources_id])
        while self.state.step < total_steps:
            if self._over_budget(started):
                metrics.note(f"time budget of {self.time_budget_s:.0f} s reached after {self.state.step} steps")
                if self.state.step == 0:
                    self._say_nothing_trained(time.monotonic() - started)
                break
            step_started = time.monotonic()
            tasks = self._next_tasks(train_tasks)
            rollouts = self._run_rollouts(
                tasks,
                resources_id,
                mode="train",
                n_per_task=self.group_size,
                description=f"step {self.state.step + 1}: rollouts",
            )
            rollouts_version = self.store.get_resources(resources_id).version  # type: ignore[union-attr]  # the resources it just published
            generated = time.monotonic()
            batch = adapter.build_batch(self.store, rollouts, progress=False)
            if batch.samples:
                # A batch whose groups all agreed trains nothing either, but still counts as trained here: a
                # policy that solves (or fails) every task of a batch is not a broken setup, and it may
                # disagree again on the next tasks. It is warned about at every step (docs/training.md).
                empty_steps.trained()
                self._warn_if_all_equal(batch.samples, equal_in_a_row)
            else:  # the step still counts: its rollouts ran, and a resumed run must not repeat it
                empty_steps.nothing(self.state.step + 1, batch.report.why_empty(adapter.agent_match))
            equal_in_a_row = equal_in_a_row + 1 if _all_groups_equal(batch.samples) else 0
            with self.server.paused():
                stats = self.update(batch.samples)
                self._stop_if_diverged()
            self.trainer.learned_from(rollouts)
            resources_id = self._publish(self._train_sampling())
            self.state.policy_version = self.store.get_resources(resources_id).version  # type: ignore[union-attr]  # the resources it just published
            self.server.set_version(self.state.policy_version)
            self.state.step += 1
            row = self._row(rollouts, batch, stats, step_started, generated, rollouts_version)
            if val_tasks and self.eval_every and self.state.step % self.eval_every == 0:
                last_eval = self._evaluate(val_tasks, metrics)
                row["val_success"] = last_eval.success
            console(
                metrics.log(
                    row, total_steps=total_steps, steps_that_fit=self._steps_that_fit(started, total_steps, row)
                )
            )
            self.state.rows = metrics.rows
            if self.state.step % self.checkpoint_every == 0 or self.state.step == total_steps:
                self._save()
            if self.on_step is not None:  # after the checkpoint: a failing tracker loses no training
                try:
                    self.on_step(dict(row))
                except BaseException:
                    self._save_if_behind()
                    raise
        self._save_if_behind()  # a time budget stops between checkpoints: its last steps are kept too
        return last_eval

    def _warn_if_all_equal(self, samples: Sequence[Sample], before: int) -> None:
        """Warn (console and ``train.log``) when every group of the step's batch had equal rewards: every
        advantage is 0, so the step does no optimizer step (a KL term alone only pulls toward the reference).
        ``before``: such steps in a row before this one."""
        if not _all_groups_equal(samples):
            return
        n_groups = len({(s.policy, s.mode, s.task_id) for s in samples})
        if all(s.reward is not None and s.reward >= self.success_threshold for s in samples):
            logger.info("step %d: every rollout succeeded: nothing left to learn from these tasks", self.state.step + 1)
            return
        rewards = sorted({s.reward for s in samples if s.reward is not None})
        seen = ", ".join(f"{r:g}" for r in rewards[:5]) + (", ..." if len(rewards) > 5 else "")
        logger.warning(
            "step %d: all %d groups had equal rewards: nothing to learn from this step; every advantage is 0, "
            "so %s (%d such steps in a row; rewards seen: %s).%s A reward that never varies (a constant, a bug), "
            "tasks too easy or too hard for the policy, greedy sampling, a fixed sampling seed (an agent that "
            "passes its own `seed`) or group_size=1 give this; it does not stop the run",
            self.state.step + 1,
            n_groups,
            "only the KL term updates the policy" if self.kl_coef > 0 else "no optimizer step",
            before + 1,
            seen or "none",
            " The rollouts of every group were token for token identical: a fixed `seed` in the agent's requests "
            "(or greedy sampling) does this."
            if _groups_identical(samples)
            else "",
        )

    def _say_nothing_trained(self, elapsed_s: float) -> None:
        """The budget ends before step 1 when the first evaluations take most of it (a slow or busy machine):
        one line says so, with the figures that show it and what to do."""
        first = [e for e in self.state.evaluations if e["step"] == 0]
        timed_out = sum(e.get("timed_out", 0) for e in first)
        logger.warning(
            "no training step ran: this machine is too busy or too slow for the time budget of %.0f s (load "
            "average %s on %d cores; %.0f s gone, the evaluations before training took %.0f s%s, a step would take "
            "about %.0f s and the evaluations after it as long again): give the run more time, or evaluate on fewer "
            "tasks",
            self.time_budget_s,
            f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "unknown",
            os.cpu_count() or 1,
            elapsed_s,
            sum(e["seconds"] for e in first),
            f", {timed_out} of their rollouts past their timeout" if timed_out else "",
            self._next_step_s(),
        )

    def _over_budget(self, started: float) -> bool:
        """Whether one more step and the final evaluations would run past ``time_budget_s``."""
        if self.time_budget_s is None:
            return False
        return time.monotonic() - started + self._still_needed_s() > self.time_budget_s

    def _still_needed_s(self) -> float:
        """Time one more step and the final evaluations need: as long as the next step (:meth:`_next_step_s`)
        and the first evaluations took."""
        return self._next_step_s() + self._final_evaluations_s()

    def _final_evaluations_s(self) -> float:
        """Time the final evaluations need: as long as the first ones took."""
        return sum(e["seconds"] for e in self.state.evaluations if e["step"] == 0)

    def _next_step_s(self) -> float:
        """How long the next step will take: as long as the last one; before the first, as long as the
        untrained policy's evaluation took per wave of rollouts (as many as there are runners), times the
        step's waves, plus half that again for the update (the training phase took 0.3-1.1 times the
        generation phase in the main job's runs)."""
        if self.state.rows:
            return float(self.state.rows[-1].get("step_time_s", 0.0))
        first = next((e for e in self.state.evaluations if e["step"] == 0 and e.get("name") == "val"), None)
        if first is None or not first["n"]:
            return 0.0
        at_once = self.trainer.n_runners or first["n"]  # 0: runners elsewhere, as many as the evaluation had
        waves = math.ceil(self.batch_tasks * self.group_size / at_once) / math.ceil(first["n"] / at_once)
        return 1.5 * first["seconds"] * waves

    def _steps_that_fit(self, started: float, total_steps: int, row: Dict[str, float]) -> Optional[int]:
        """The time budget's estimate of the run's last step, once step ``row`` is done (None without a
        budget): the steps done and as many more as fit before the final evaluations, at the mean duration of
        this run's steps so far."""
        if self.time_budget_s is None:
            return None
        durations = [r["step_time_s"] for r in [*self.state.rows, row] if "step_time_s" in r]
        left = self.time_budget_s - (time.monotonic() - started) - self._final_evaluations_s()
        more = max(0, math.floor(left / max(1e-9, statistics.fmean(durations))))
        return min(total_steps, self.state.step + more)

    def _next_tasks(self, train_tasks: List[Task]) -> List[Task]:
        """The next ``batch_tasks`` tasks of a per-epoch shuffled order (seeded, so resuming continues it)."""
        chosen: List[Task] = []
        while len(chosen) < min(self.batch_tasks, len(train_tasks)):
            order = list(range(len(train_tasks)))
            random.Random(self.seed * 100_003 + self.state.epoch).shuffle(order)
            take = order[self.state.cursor : self.state.cursor + self.batch_tasks - len(chosen)]
            chosen.extend(train_tasks[i] for i in take)
            self.state.cursor += len(take)
            if self.state.cursor >= len(order):
                self.state.epoch += 1
                self.state.cursor = 0
        return chosen

    def _stop_if_diverged(self) -> None:
        """Stop at the update that made a trainable weight NaN or infinite (a learning rate far too high), before
        the weights are served or saved: every later rollout would fail to sample, and the checkpoints kept (the
        newest two) would soon all be broken ones, the run still ending "done"."""
        assert self.policy is not None
        if all(bool(torch.isfinite(p).all()) for p in self.policy.parameters()):
            return
        kept = (
            f"the checkpoint of step {self._saved_step} in {self.checkpoint_dir} is the last good one"
            if self._saved_step
            else "no checkpoint was saved before it"
        )
        raise TrainingDivergedError(
            f"step {self.state.step + 1}'s update made trainable weights NaN or infinite, so the run stopped before "
            f"serving or saving them; {kept}. Lower lr (now {self.lr:g}) or max_grad_norm and resume, or start again"
        )

    def _row(
        self,
        rollouts: List[Rollout],
        batch: Any,
        stats: Dict[str, float],
        started: float,
        generated: float,
        rollouts_version: int,
    ) -> Dict[str, float]:
        """The step's metrics row. ``policy_version``: the version published after its update (the server's
        from then on, the checkpoint's); ``rollouts_version``: the one its rollouts ran with."""
        rewards = final_rewards(rollouts)
        # As in the evaluations, a failed rollout counts as reward 0 in reward_mean/std (it already counts as
        # no success in success_rate); failed_rollouts says how many there were.
        counted = rewards + [0.0] * (len(rollouts) - len(rewards))
        gen_s = generated - started
        gen_tokens = sum(len(s.response_ids) for s in batch.samples)
        row: Dict[str, float] = {
            "step": self.state.step,
            "policy_version": self.state.policy_version,
            "rollouts_version": rollouts_version,
            "reward_mean": statistics.fmean(counted) if counted else float("nan"),
            "reward_std": statistics.pstdev(counted) if len(counted) > 1 else 0.0,
            "success_rate": sum(r >= self.success_threshold for r in rewards) / len(rollouts),
            "rollouts": len(rollouts),
            "failed_rollouts": len(rollouts) - len(rewards),
            "gen_s": gen_s,
            "gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
            **stats,
            # a multi-turn agent's calls and tool use (agl.algorithm.tool_calls): read again from the store
            **ToolCallStats.of(self.store.query_spans(r.rollout_id) for r in rollouts).columns(),
            "lr": float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else float("nan"),
            "step_time_s": time.monotonic() - started,
        }
        if stats.get("train_tokens"):
            row["train_tokens_per_s"] = stats.get("train_tokens", 0.0) * self.ppo_epochs / stats["train_s"]
        return row


def _all_groups_equal(samples: Sequence[Sample]) -> bool:
    """True when there are samples and every one has advantage 0 (every group's rewards were equal)."""
    return bool(samples) and all(s.advantage == 0.0 for s in samples)


def _groups_identical(samples: Sequence[Sample]) -> bool:
    """True when every group has more than one rollout and all of a group's rollouts generated the same
    tokens (the same seed, or greedy sampling, on the same prompt)."""
    groups: Dict[Any, Dict[str, List[Tuple[int, ...]]]] = {}
    for s in samples:
        groups.setdefault((s.policy, s.mode, s.task_id), {}).setdefault(s.rollout_id, []).append(tuple(s.response_ids))
    return bool(groups) and all(
        len(rollouts) > 1 and len({tuple(r) for r in rollouts.values()}) == 1 for rollouts in groups.values()
    )
