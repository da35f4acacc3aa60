"""TorchGRPO: a GRPO / PPO-clip trainer in plain torch that serves the policy it trains.

    trainer = agl.Trainer(algorithm=TorchGRPO(model="smollm2", group_size=4, batch_tasks=4, steps=12),
                          adapter={"agent_match": "^(solve|answer)$"}, n_runners=16, runner_mode="thread")
    trainer.fit(agent, train_dataset, val_dataset=val_dataset)

One process holds the model. A :class:`~agl.serving.PolicyServer` serves it (the same object, no copy) and
the store publishes an ``LLM`` resource with the server's ``base_url``, so the runners' agents reach the
policy by URL like any OpenAI-compatible endpoint. Each step alternates two phases, so generation and
training never fight over the CPU cores or the GPU:

1. **generate**: ``group_size`` rollouts of each of ``batch_tasks`` training tasks (``Trainer.run_tasks``);
2. **train**, with the server paused: LightningRL turns the rollouts' spans into samples with advantages
   (``adapter.build_batch``), the GRPO loss (:mod:`agl.algorithm.grpo_loss`) updates the weights in place,
   and the server answers from then on as the next policy version.

The "old" logprobs of the PPO ratio are the ones the server returned with each token (the exact ids and
the distribution they were drawn from); ``old_logprobs="recompute"`` uses a forward pass instead. The
reference policy for the optional KL term is the model with the LoRA adapter disabled (or a frozen copy
under full fine-tuning). Metrics go to the console, ``metrics.csv``, TensorBoard when installed, and a PNG
curve at the end (:mod:`agl.algorithm.metrics`); checkpoints let a stopped run resume
(:mod:`agl.algorithm.checkpoint`). The same code runs on a CUDA GPU when one is present. See docs/training.md.

This module holds the run and the GRPO update; TorchGRPO's other parts are its settings
(:mod:`~agl.algorithm.torch_grpo_config`), the policy-server session (:mod:`~agl.algorithm.torch_grpo_session`),
the training loop (:mod:`~agl.algorithm.torch_grpo_loop`), the evaluations
(:mod:`~agl.algorithm.torch_grpo_evaluation`) and the checkpoints (:mod:`~agl.algorithm.torch_grpo_checkpoints`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from agl.algorithm.base import Algorithm
from agl.algorithm.checkpoint import TrainerState
from agl.algorithm.grpo_loss import collate, policy_loss, response_logprobs, split_micro_batches
from agl.algorithm.metrics import MetricsLog, plot_reward_curve
from agl.algorithm.torch_grpo_checkpoints import Checkpoints
from agl.algorithm.torch_grpo_config import TorchGRPOConfig
from agl.algorithm.torch_grpo_evaluation import Evaluation, Evaluations, TrainResult, print_summary
from agl.algorithm.torch_grpo_loop import TrainingDivergedError, TrainingLoop
from agl.algorithm.torch_grpo_session import PolicyServerSession
from agl.algorithm.trainable import TrainablePolicy
from agl.lightningrl.types import Sample
from agl.runtime.dataset import as_tasks
from agl.serving.models import attention_kernels

__all__ = ["Evaluation", "TorchGRPO", "TorchGRPOConfig", "TrainResult", "TrainingDivergedError"]

logger = logging.getLogger("agl.train")


class TorchGRPO(PolicyServerSession, Evaluations, TrainingLoop, Checkpoints, Algorithm):
    """GRPO with PPO clipping, LoRA or full fine-tuning, on the policy it serves itself.

    Its keywords are the fields of :class:`~agl.algorithm.torch_grpo_config.TorchGRPOConfig`, each with its
    default, its check and what it means (docs/training.md says more), checked when it is built. Each setting
    is then an attribute of the same name (``model`` as ``model_spec``), which a custom loop may change.

    Each step runs ``group_size`` rollouts of ``batch_tasks`` training tasks, for ``steps`` steps (or ``epochs``
    passes over the tasks) within ``time_budget_s``; the validation tasks run before and after training and
    every ``eval_every`` steps. Every step's row goes to ``metrics.csv``, ``train.log``, TensorBoard (when
    installed) and ``on_step(row)``, e.g. ``on_step=lambda row: wandb.log(row, step=row["step"])``.
    """

    __signature__ = TorchGRPOConfig.signature()

    def __init__(self, **settings: Any) -> None:
        for name, value in TorchGRPOConfig.from_keywords(settings):
            setattr(self, "model_spec" if name == "model" else name, value)
        self._drift_warned = False
        # set up by run(); the settings and these are declared, with their types, in TorchGRPOBase
        self.policy = None
        self.tokenizer = None
        self.server = None
        self.optimizer = None
        self.state = TrainerState()
        self._saved_step = 0
        self._sampling_of = {}

    # ------------------------------------------------------------------------------------------------------
    # run
    # ------------------------------------------------------------------------------------------------------
    def bind(self, trainer: Any) -> None:
        super().bind(trainer)
        if self.resume:  # before the trainer starts its runners, which would take the leftovers first
            self._cancel_leftovers()

    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> TrainResult:
        """Evaluate, train for the configured steps, evaluate again; see the class and module docs."""
        if not train_dataset:
            raise ValueError("TorchGRPO needs a training dataset: trainer.fit(agent, train_dataset, val_dataset=...)")
        started = time.monotonic()
        train_tasks = as_tasks(train_dataset)
        val_tasks = as_tasks(val_dataset, mode="val") if val_dataset else []
        total_steps = self._total_steps(len(train_tasks))
        output = self.output_dir or self.checkpoint_dir or Path(".agl") / "runs" / time.strftime("grpo-%Y%m%d-%H%M%S")
        with self._session() as adapter:
            resumed = self._maybe_resume()
            if resumed:
                self._retain_earlier_runs()
            policy = self.policy
            assert policy is not None  # the session attached the model
            metrics = MetricsLog(output, rows=self.state.rows, evaluations=self.state.evaluations)
            try:
                metrics.note(
                    f"TorchGRPO: {policy.n_trainable() / 1e6:.2f}M trainable parameters "
                    f"({'LoRA' if policy.is_lora else 'full fine-tuning'}), {total_steps} steps of "
                    f"{self.batch_tasks} tasks x {self.group_size} rollouts, serving at {self.server.base_url}"
                    + (f", resumed at step {self.state.step}" if resumed else "")
                )
                before = self._first_evaluations(val_tasks, metrics, started)
                after = self._train(train_tasks, val_tasks, total_steps, adapter, metrics, started)
                extra: Dict[str, Tuple[Evaluation, Evaluation]] = {}
                if self.state.step == 0:  # nothing trained: "after" would evaluate the same weights again
                    after = None
                elif val_tasks:
                    after = self._final_evaluation(val_tasks, metrics, "val", started, after)
                    extra = {
                        name: (before[name], self._final_evaluation(val_tasks, metrics, name, started))
                        for name in self.extra_evals
                        if name in before  # one skipped before training has nothing to compare with
                    }
                png = plot_reward_curve(self.state.rows, metrics.png_path, evaluations=self.state.evaluations)
            finally:
                metrics.close()
        result = TrainResult(
            before=before.get("val"),
            after=after,
            extra=extra,
            steps=self.state.step,
            seconds=time.monotonic() - started,
            output_dir=Path(output),
            rows=list(self.state.rows),
            curve_png=png,
        )
        print_summary(result)
        return result

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Wrap ``model`` for training (LoRA or full) and create the optimizer. ``run`` calls it; a custom
        loop may call it and then :meth:`update` directly."""
        self.tokenizer = tokenizer
        self.policy = TrainablePolicy(model, self.lora, need_reference=self.kl_coef > 0)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.lr)

    # ------------------------------------------------------------------------------------------------------
    # one update
    # ------------------------------------------------------------------------------------------------------
    def update(self, samples: Sequence[Sample]) -> Dict[str, float]:
        """GRPO update(s) on one batch of samples (advantages set); returns the step's statistics.

        Call with the server paused: the weights change in place. Samples with advantage 0 carry no policy
        gradient; without a KL term they are skipped (the loss is unchanged, their weight still counts in
        the normaliser).
        """
        assert self.policy is not None and self.optimizer is not None
        started = time.monotonic()
        stats: Dict[str, float] = {"samples": float(len(samples)), "optimizer_steps": 0.0}
        live = [s for s in samples if s.advantage != 0.0 or self.kl_coef > 0]
        stats["live_samples"] = float(len(live))
        if not live:
            stats["train_s"] = time.monotonic() - started
            return stats
        micro = split_micro_batches(live, self.micro_batch_size)
        pad_id = _pad_id(self.tokenizer)
        device = next(self.policy.module.parameters()).device
        batches = [collate(mb, pad_id).to(device) for mb in micro]
        weight_of = [float(b.weights.sum()) for b in batches]
        per_window = self.grad_accum or len(batches)
        windows = [list(range(i, min(i + per_window, len(batches)))) for i in range(0, len(batches), per_window)]
        # The live samples' share of the weight normaliser; the skipped samples' weight still counts.
        skipped_weight = sum(s.loss_weight for s in samples) - sum(weight_of)
        sums: Dict[str, float] = {}
        drift: List[float] = []
        with attention_kernels(device):  # masked attention on CUDA: see attention_kernels
            old, ref = self._fixed_logprobs(batches)
            self.policy.module.train()
            for epoch in range(self.ppo_epochs):
                for w, window in enumerate(windows):
                    total = sum(weight_of[i] for i in window) + skipped_weight * len(window) / len(batches)
                    for i in window:
                        logprobs = response_logprobs(self.policy.module, batches[i], self.temperature)
                        served = batches[i].old_logprobs
                        if epoch == 0 and w == 0 and served is not None:  # before any update: vs the server
                            mask = batches[i].response_mask
                            drift.append(float(((logprobs.detach() - served).abs() * mask).sum() / mask.sum()))
                        parts = policy_loss(
                            logprobs,
                            old[i],
                            batches[i],
                            clip_eps=self.clip_eps,
                            kl_coef=self.kl_coef,
                            ref_logprobs=ref[i],
                            weight_total=total,
                        )
                        parts.loss.backward()
                        share = float(parts.loss.detach()) / (len(windows) * self.ppo_epochs)
                        _add(sums, {"loss": share, **parts.stats})
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    stats["optimizer_steps"] += 1
                    _add(sums, {"grad_norm_sum": float(grad_norm)})
        self.policy.module.eval()
        tokens = sums.get("tokens", 0.0) or 1.0
        stats.update(
            loss=sums.get("loss", 0.0),
            train_tokens=sums.get("tokens", 0.0) / self.ppo_epochs,
            clip_frac=sums.get("clipped_tokens", 0.0) / tokens,
            kl_old=sums.get("kl_old_sum", 0.0) / tokens,
            neg_logprob=sums.get("entropy_proxy_sum", 0.0) / tokens,
            grad_norm=sums.get("grad_norm_sum", 0.0) / max(1.0, stats["optimizer_steps"]),
            train_s=time.monotonic() - started,
        )
        if self.kl_coef > 0:
            stats["kl_ref"] = sums.get("kl_ref_sum", 0.0) / tokens
        if drift:
            stats["logprob_drift"] = sum(drift) / len(drift)
            self._warn_on_drift(stats["logprob_drift"])
        return stats

    #: mean |trainer - server| logprob per token above which "sample" old logprobs are not the trainer's policy
    DRIFT_WARNING = 0.05

    def _warn_on_drift(self, drift: float) -> None:
        """Say once why served logprobs can differ from the trainer's, and what to do about it."""
        if drift <= self.DRIFT_WARNING or self.old_logprobs != "sample" or self._drift_warned:
            return
        self._drift_warned = True
        logger.warning(
            "served logprobs differ from the trainer's by %.3f per token on average (first pass, before any "
            "update). Either the agent sets its own temperature in its requests (the trainer computes at "
            "TorchGRPO(temperature=...): leave it to llm.sampling_parameters, or set the same value there), or "
            "the served model is not the trained one, or the agent samples from a restricted distribution "
            "(top_p < 1, top_k, a response_format): the server reports logprobs of what it drew from, the trainer "
            "computes the unrestricted policy's. PPO ratios are then off from the start; for the last two, "
            'TorchGRPO(old_logprobs="recompute") takes the old logprobs from the trainer\'s own forward pass.',
            drift,
        )

    def _fixed_logprobs(self, batches: List[Any]) -> Tuple[List[Any], List[Any]]:
        """The old logprobs (the server's, or a forward pass before any update) and the reference's."""
        assert self.policy is not None
        old: List[Any] = []
        ref: List[Any] = [None] * len(batches)
        self.policy.module.eval()
        with torch.no_grad():
            for b in batches:
                if self.old_logprobs == "sample" and b.old_logprobs is not None:
                    old.append(b.old_logprobs)
                else:
                    old.append(response_logprobs(self.policy.module, b, self.temperature))
        if self.kl_coef > 0:
            with self.policy.reference() as reference:
                ref = [response_logprobs(reference, b, self.temperature) for b in batches]
        return old, ref


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token to pad batches with")
    return int(pad)


def _add(into: Dict[str, float], values: Mapping[str, float]) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0.0) + value
