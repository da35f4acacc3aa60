"""TorchGRPO's checkpoints: saving the finished steps, resuming from the newest one, and what a resumed run takes
over from the runs before it in the same checkpoint folder (their leftover rollouts, their spans)."""

from __future__ import annotations

import logging

from agl.algorithm.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    published_resources,
    save_checkpoint,
)
from agl.algorithm.torch_grpo_config import TorchGRPOBase
from agl.errors import IllegalTransitionError

logger = logging.getLogger("agl.train")


class Checkpoints(TorchGRPOBase):
    """The part of :class:`~agl.algorithm.torch_grpo.TorchGRPO` that saves and resumes its runs (its settings,
    ``state`` and ``policy`` are TorchGRPO's)."""

    def _cancel_leftovers(self) -> None:
        """Cancel the rollouts that an earlier run of this checkpoint folder left queued or running when it
        was killed mid-step: its policy server died with it, so runners would only fail them (queued ones
        first, ahead of this run's) against an address another process may serve by now. Only rollouts of
        resources that run published are touched: a store shared with other trainers keeps theirs."""
        ours = published_resources(self.checkpoint_dir)
        if not ours:
            return
        left = [r for r in self.store.query_rollouts(status=["queued", "running"]) if r.resources_id in ours]
        cancelled = 0
        for rollout in left:
            try:
                self.store.cancel_rollout(rollout.rollout_id)
                cancelled += 1
            except IllegalTransitionError:  # it ended meanwhile (an orphaned runner finished it): nothing to cancel
                pass
        if cancelled:
            logger.warning(
                "cancelled %d rollouts that an earlier run in %s left queued or running (it stopped mid-step; "
                "their policy server is gone)",
                cancelled,
                self.checkpoint_dir,
            )

    def _maybe_resume(self) -> bool:
        assert self.policy is not None and self.optimizer is not None
        fingerprint = self.policy.fingerprint(self._model_label())
        self.state = TrainerState(fingerprint=fingerprint)
        self._saved_step = 0
        path = latest_checkpoint(self.checkpoint_dir) if self.resume else None
        if path is None:
            return False
        self.state = load_checkpoint(
            path, self.policy.module, self.optimizer, lora=self.policy.is_lora, fingerprint=fingerprint
        )
        self._saved_step = self.state.step
        self.server.set_version(self.state.policy_version)
        logger.info("resumed from %s (step %d)", path, self.state.step)
        return True

    def _retain_earlier_runs(self) -> None:
        """A resumed run's store holds the training rollouts of the runs before it, whose span retention
        window ended with their process (their spans stayed for good). They count as one step older than
        this run's first, so the window deletes them in turn (with ``span_retention_steps`` set). Only the
        rollouts of resources those runs published: a store shared with other experiments or trainers keeps
        theirs (every finished training rollout was taken, another run's spans deleted with no word)."""
        if self.trainer.span_retention.steps is None:
            return
        ours = published_resources(self.checkpoint_dir)
        finished = self.store.query_rollouts(mode="train", status=["succeeded", "failed", "cancelled"])
        earlier = [r for r in finished if r.resources_id in ours]
        if earlier:
            self.trainer.learned_from(earlier)

    def _model_label(self) -> str:
        return self.model_spec if isinstance(self.model_spec, str) else type(self.model_spec[0]).__name__

    def _save(self) -> None:
        if self.checkpoint_dir is None:
            return
        assert self.policy is not None and self.optimizer is not None
        path = save_checkpoint(
            self.checkpoint_dir, self.policy.module, self.optimizer, self.state, lora=self.policy.is_lora
        )
        self._saved_step = self.state.step
        logger.info("checkpoint %s", path)

    def _save_if_behind(self) -> None:
        """Checkpoint the last finished step unless it is saved already: a run that stops between
        ``checkpoint_every`` steps (its time budget, a failing ``on_step``) would lose those steps."""
        if self.state.step > self._saved_step:
            self._save()
