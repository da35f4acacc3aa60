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
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch

from agl.algorithm.base import Algorithm, EmptySteps
from agl.algorithm.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    published_resources,
    record_published,
    save_checkpoint,
)
from agl.algorithm.grpo_loss import (
    collate,
    policy_loss,
    response_logprobs,
    split_micro_batches,
)
from agl.algorithm.metrics import MetricsLog, ascii_curve, plot_reward_curve
from agl.checks import check_number, is_finite_number
from agl.algorithm.trainable import DEFAULT_LORA, LoraSpec, TrainablePolicy
from agl.runtime.dataset import as_tasks
from agl.errors import AglError, IllegalTransitionError
from agl.lightningrl.types import Sample
from agl._util.http_thread import WILDCARD_HOSTS, advertised_url
from agl.serving.models import attention_kernels, load_policy
from agl.serving.openai_api import REQUEST_SETTINGS
from agl.types import LLM, Rollout, Task

logger = logging.getLogger("agl.train")

_DEFAULT = object()  # "not given": lora's default is LoRA, None means full fine-tuning


class TrainingDivergedError(AglError, RuntimeError):
    """An update made the trainable weights NaN or infinite: TorchGRPO stops before serving or saving them."""


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
        return {"name": self.name, "step": self.step, "success": self.success, "reward_mean": self.reward_mean,
                "n": self.n, "failed": self.failed, "seconds": self.seconds}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "Evaluation":
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


class TorchGRPO(Algorithm):
    """GRPO with PPO clipping, LoRA or full fine-tuning, on the policy it serves itself.

    Model: ``model`` is ``"smollm2"`` (bundled), ``"tiny"`` (random, tests), a Hugging Face name or path, or
    a ``(model, tokenizer)`` pair already loaded. ``lora``: a dict of ``peft.LoraConfig`` fields (default
    :data:`~agl.algorithm.trainable.DEFAULT_LORA`), a LoraConfig, or None for full fine-tuning.

    Schedule: each step runs ``group_size`` rollouts of ``batch_tasks`` training tasks. ``steps`` bounds
    the number of steps; without it, ``epochs`` passes over the training tasks. ``time_budget_s`` bounds
    the whole ``run``: no step starts unless it and the final evaluations (timed by the last step and the
    first evaluations) still fit. ``eval_every`` steps (0: only before and after) the validation tasks run once each.

    Optimisation: ``lr`` (AdamW, torch's defaults otherwise: weight decay 0.01; a resumed run uses this
    ``lr``, not the checkpoint's), ``ppo_epochs`` passes over each batch, ``micro_batch_size`` samples per
    forward pass, ``grad_accum`` micro-batches per optimizer step (None: one step per pass over the batch),
    ``clip_eps`` (PPO ratio clip), ``kl_coef`` (k3 KL to the reference; 0 skips the reference pass),
    ``max_grad_norm``.

    Sampling: ``temperature`` and ``max_tokens`` go into the published LLM resource (so into every agent
    request); ``sampling`` adds other parameters (a ``temperature`` other than ``temperature`` is refused, the
    loss computes every logprob at that one, and so is a fixed ``seed`` with ``group_size > 1``, which would make
    a group's rollouts identical); ``val_sampling`` overrides them for validation (for
    example ``{"temperature": 0.0}`` for greedy evaluation); ``extra_evals`` names more evaluations run
    before and after training only, e.g. ``{"greedy": {"temperature": 0.0}}``. ``success_threshold``: a rollout whose reward
    reaches it counts as a success.

    Metrics: every step's row goes to ``metrics.csv``, ``train.log``, TensorBoard (when installed) and, if
    given, ``on_step(row)``, called on the training thread after the row is logged and the step's checkpoint
    saved: hand it to any tracker,
    e.g. ``on_step=lambda row: wandb.log(row, step=row["step"])``. An exception it raises stops training.
    """

    def __init__(
        self,
        *,
        model: Union[str, Tuple[Any, Any]] = "smollm2",
        lora: LoraSpec = _DEFAULT,  # type: ignore[assignment]
        lr: float = 5e-4,
        group_size: int = 4,
        batch_tasks: int = 8,
        steps: Optional[int] = None,
        epochs: int = 1,
        ppo_epochs: int = 1,
        micro_batch_size: int = 16,
        grad_accum: Optional[int] = None,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        max_grad_norm: float = 1.0,
        old_logprobs: Literal["sample", "recompute"] = "sample",
        temperature: float = 1.0,
        max_tokens: int = 256,
        sampling: Optional[Mapping[str, Any]] = None,
        val_sampling: Optional[Mapping[str, Any]] = None,
        extra_evals: Optional[Mapping[str, Mapping[str, Any]]] = None,
        success_threshold: float = 1.0,
        eval_every: int = 0,
        time_budget_s: Optional[float] = None,
        checkpoint_dir: Union[str, Path, None] = None,
        checkpoint_every: int = 1,
        resume: bool = True,
        output_dir: Union[str, Path, None] = None,
        seed: int = 0,
        device: Optional[str] = None,
        dtype: Any = None,
        torch_threads: Optional[int] = None,
        server_batch_size: int = 16,
        server_host: str = "127.0.0.1",
        server_port: int = 0,
        server_url: Optional[str] = None,
        model_name: str = "policy",
        resource_name: str = "main_llm",
        on_step: Optional[Callable[[Dict[str, float]], None]] = None,
    ) -> None:
        _check_positive(group_size=group_size, batch_tasks=batch_tasks, epochs=epochs, ppo_epochs=ppo_epochs,
                        micro_batch_size=micro_batch_size, max_tokens=max_tokens, server_batch_size=server_batch_size)
        if steps is not None and steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if grad_accum is not None and grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1 or None (one optimizer step per pass), got {grad_accum}")
        if group_size < 2:
            logger.warning("group_size=1: GRPO compares rollouts of the same task, every advantage will be 0")
        if old_logprobs not in ("sample", "recompute"):
            raise ValueError(f'old_logprobs must be "sample" or "recompute", got {old_logprobs!r}')
        if not (is_finite_number(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0 for training rollouts (got {temperature}); "
                             "use val_sampling={'temperature': 0.0} for greedy evaluation")
        for name, value in (("lr", lr), ("clip_eps", clip_eps), ("max_grad_norm", max_grad_norm)):
            check_number(name, value, positive=True)
        check_number("kl_coef", kl_coef, positive=False)
        if not is_finite_number(success_threshold):
            raise ValueError(f"success_threshold must be a finite number, got {success_threshold!r}")
        if time_budget_s is not None and time_budget_s != time_budget_s:  # NaN: no step would ever be over budget
            raise ValueError("time_budget_s must be a number of seconds or None (no budget), got nan")
        self.model_spec = model
        self.lora = dict(DEFAULT_LORA) if lora is _DEFAULT else lora
        self.lr = lr
        self.group_size = group_size
        self.batch_tasks = batch_tasks
        self.steps = steps
        self.epochs = epochs
        self.ppo_epochs = ppo_epochs
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef
        self.max_grad_norm = max_grad_norm
        self.old_logprobs = old_logprobs
        self._drift_warned = False
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.sampling = dict(sampling or {})
        self.val_sampling = dict(val_sampling) if val_sampling is not None else None
        self.extra_evals = {name: dict(v) for name, v in (extra_evals or {}).items()}
        _check_sampling(sampling=self.sampling, val_sampling=self.val_sampling or {},
                        **{f"extra_evals[{name!r}]": v for name, v in self.extra_evals.items()})
        if "val" in self.extra_evals:
            raise ValueError('extra_evals cannot use the name "val": it is the main evaluation (val_sampling)')
        _check_training_sampling(self.sampling, temperature=temperature, group_size=group_size)
        self.success_threshold = success_threshold
        self.eval_every = eval_every
        self.time_budget_s = time_budget_s
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.seed = seed
        self.device = device
        self.dtype = dtype
        self.torch_threads = torch_threads
        self.server_batch_size = server_batch_size
        self.server_host = server_host
        self.server_port = server_port
        self.server_url = server_url.rstrip("/") if server_url else None
        self.model_name = model_name
        self.resource_name = resource_name
        self.on_step = on_step
        # set up by run()
        self.policy: Optional[TrainablePolicy] = None
        self.tokenizer: Any = None
        self.server: Any = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.state = TrainerState()
        self._saved_step = 0  # the step of the newest checkpoint (made or resumed from)
        self._sampling_of: Dict[str, Dict[str, Any]] = {}  # resources id -> the sampling settings published in it

    # ------------------------------------------------------------------------------------------------------
    # run
    # ------------------------------------------------------------------------------------------------------
    def bind(self, trainer: Any) -> None:
        super().bind(trainer)
        if self.resume:  # before the trainer starts its runners, which would take the leftovers first
            self._cancel_leftovers()

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
                "their policy server is gone)", cancelled, self.checkpoint_dir,
            )

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
            metrics = MetricsLog(output, rows=self.state.rows)
            try:
                metrics.note(
                    f"TorchGRPO: {self.policy.n_trainable() / 1e6:.2f}M trainable parameters "  # type: ignore[union-attr]
                    f"({'LoRA' if self.policy.is_lora else 'full fine-tuning'}), {total_steps} steps of "  # type: ignore[union-attr]
                    f"{self.batch_tasks} tasks x {self.group_size} rollouts, serving at {self.server.base_url}"
                    + (f", resumed at step {self.state.step}" if resumed else "")
                )
                before = self._first_evaluations(val_tasks, metrics, started)
                after = self._train(train_tasks, val_tasks, total_steps, adapter, metrics, started)
                extra: Dict[str, Tuple[Evaluation, Evaluation]] = {}
                if self.state.step == 0:  # nothing trained: "after" would evaluate the same weights again
                    after = None
                elif val_tasks:
                    after = self._final_evaluation(val_tasks, metrics, "val", after)
                    extra = {name: (before[name], self._final_evaluation(val_tasks, metrics, name)) for name in self.extra_evals}
                png = plot_reward_curve(self.state.rows, metrics.png_path, evaluations=self.state.evaluations)
            finally:
                metrics.close()
        result = TrainResult(
            before=before.get("val"), after=after, extra=extra, steps=self.state.step, seconds=time.monotonic() - started,
            output_dir=Path(output), rows=list(self.state.rows), curve_png=png,
        )
        self._print_summary(result)
        return result

    def _total_steps(self, n_tasks: int) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * math.ceil(n_tasks / self.batch_tasks)

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        """Load the policy, start its server, publish it; stop the server on the way out (errors too)."""
        from agl.lightningrl.adapter import LightningRL
        from agl.serving import PolicyServer

        adapter = LightningRL.from_config(self.adapter)
        if self.torch_threads or not torch.cuda.is_available():
            torch.set_num_threads(self.torch_threads or os.cpu_count() or 1)
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        model, tokenizer = self._load_model()
        self.attach(model, tokenizer)
        self.server = PolicyServer(model, self.tokenizer, model_name=self.model_name, max_batch_size=self.server_batch_size,
                                   host=self.server_host, port=self.server_port)
        self.server.start()
        self._warn_if_unreachable()
        try:
            yield adapter
        finally:
            self.server.stop()

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Wrap ``model`` for training (LoRA or full) and create the optimizer. ``run`` calls it; a custom
        loop may call it and then :meth:`update` directly."""
        self.tokenizer = tokenizer
        self.policy = TrainablePolicy(model, self.lora, need_reference=self.kl_coef > 0)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.lr)

    def _load_model(self) -> Tuple[Any, Any]:
        if isinstance(self.model_spec, tuple):
            model, tokenizer = self.model_spec
            return model, tokenizer
        return load_policy(self.model_spec, dtype=self.dtype, device=self.device, seed=self.seed)

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

    # ------------------------------------------------------------------------------------------------------
    # resources
    # ------------------------------------------------------------------------------------------------------
    def _publish(self, sampling: Mapping[str, Any]) -> str:
        """Store an LLM resource pointing at the server with ``sampling``; returns its resources id.

        The settings travel with the resources id: :meth:`_run_rollouts` makes the server apply them to the
        requests that leave them out while that id's rollouts run (see there). Publishing itself does not
        touch the server, so publishing the next training resources before an evaluation (or the reverse)
        cannot change how any other rollouts are sampled."""
        llm = LLM(endpoint=self._endpoint(), model=self.model_name, sampling_parameters=dict(sampling))
        resources_id = self.store.add_resources({self.resource_name: llm}).resources_id
        record_published(self.checkpoint_dir, resources_id)
        self._sampling_of[resources_id] = dict(sampling)
        return resources_id

    def _run_rollouts(self, tasks: List[Task], resources_id: str, **kwargs: Any) -> List[Rollout]:
        """``trainer.run_tasks`` of ``tasks`` with ``resources_id``, the server sampling as that resource says.

        An agent that does not pass ``llm.sampling_parameters`` on (the README's does not) is sampled at the
        server's ``request_defaults``, not at the resource's settings. One policy server serves training and
        validation, so its defaults are set here to the settings published with ``resources_id`` for as long
        as its rollouts run, and put back afterwards (errors too): training rollouts are always sampled with
        the training settings and validation rollouts with ``val_sampling`` (or their ``extra_evals``
        entry), whatever order resources are published and evaluations run in. This holds because the
        trainer runs one batch of rollouts at a time (``run_tasks`` returns once all of them ended), so no
        rollout of another resources id is being served meanwhile."""
        previous = self.server.request_defaults
        self.server.request_defaults = dict(self._sampling_of[resources_id])
        try:
            return self.trainer.run_tasks(tasks, resources_id=resources_id, **kwargs)
        finally:
            self.server.request_defaults = previous

    def _endpoint(self) -> str:
        """The policy server's URL as agents get it: ``server_url``, else the bound address, a wildcard
        ``server_host`` advertised under this machine's name (runners on other machines must reach it)."""
        if self.server_url:
            return self.server_url
        if self.server_host in WILDCARD_HOSTS:
            return advertised_url(self.server_host, self.server.bound_port)
        return self.server.base_url

    def _warn_if_unreachable(self) -> None:
        """Runners only on other machines (``n_runners=0``) cannot reach a server bound to loopback."""
        if self.trainer.n_runners == 0 and not self.server_url and self.server_host in ("127.0.0.1", "localhost", "::1"):
            logger.warning(
                "n_runners=0 (runners on other machines) but the policy server listens on %s only: they would "
                "be sent to their own %s. Pass server_host='0.0.0.0' (published under this machine's name, %s) "
                "or server_url='http://HOST:PORT/v1' with a server_port", self.server_host, self._endpoint(),
                advertised_url("0.0.0.0", self.server.bound_port),
            )

    def _train_sampling(self) -> Dict[str, Any]:
        # logprobs: the server returns each token's logprob, the exact "old" logprobs of the PPO ratio.
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "logprobs": True, **self.sampling}

    # ------------------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------------------
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
                    ", ".join(names[i:]), ", ".join(out), self.time_budget_s, time.monotonic() - started,
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
        rewards = _rewards(rollouts)
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
        _console(f"eval at step {evaluation.step}: {evaluation}")
        return evaluation

    # ------------------------------------------------------------------------------------------------------
    # training loop
    # ------------------------------------------------------------------------------------------------------
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
                tasks, resources_id, mode="train", n_per_task=self.group_size,
                description=f"step {self.state.step + 1}: rollouts",
            )
            rollouts_version = self.store.get_resources(resources_id).version  # type: ignore[union-attr]
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
            self.state.policy_version = self.store.get_resources(resources_id).version  # type: ignore[union-attr]
            self.server.set_version(self.state.policy_version)
            self.state.step += 1
            row = self._row(rollouts, batch, stats, step_started, generated, rollouts_version)
            if val_tasks and self.eval_every and self.state.step % self.eval_every == 0:
                last_eval = self._evaluate(val_tasks, metrics)
                row["val_success"] = last_eval.success
            _console(metrics.log(row, total_steps=total_steps))
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
        rewards = sorted({s.reward for s in samples if s.reward is not None})
        seen = ", ".join(f"{r:g}" for r in rewards[:5]) + (", ..." if len(rewards) > 5 else "")
        logger.warning(
            "step %d: all %d groups had equal rewards: nothing to learn from this step; every advantage is 0, "
            "so %s (%d such steps in a row; rewards seen: %s).%s A reward that never varies (a constant, a bug), "
            "tasks too easy or too hard for the policy, greedy sampling, a fixed sampling seed (an agent that "
            "passes its own `seed`) or group_size=1 give this; it does not stop the run",
            self.state.step + 1, n_groups,
            "only the KL term updates the policy" if self.kl_coef > 0 else "no optimizer step",
            before + 1, seen or "none",
            " The rollouts of every group were token for token identical: a fixed `seed` in the agent's requests "
            "(or greedy sampling) does this." if _groups_identical(samples) else "",
        )

    def _say_nothing_trained(self, elapsed_s: float) -> None:
        """The budget ends before step 1 when the first evaluations take most of it (a slow or busy machine):
        the run would otherwise end quietly, reporting the untrained policy twice as "before" and "after"."""
        evaluations = sum(e["seconds"] for e in self.state.evaluations if e["step"] == 0)
        logger.warning(
            "no training step ran: the time budget of %.0f s would be used up before one step and the final "
            "evaluations could finish (%.0f s gone; the first evaluations took %.0f s, and the final ones need as "
            "long). Give the run more time, or evaluate on fewer tasks (or fewer evaluation settings).",
            self.time_budget_s, elapsed_s, evaluations,
        )

    def _over_budget(self, started: float) -> bool:
        """Whether one more step and the final evaluations would run past ``time_budget_s``."""
        if self.time_budget_s is None:
            return False
        return time.monotonic() - started + self._still_needed_s() > self.time_budget_s

    def _still_needed_s(self) -> float:
        """Time one more step and the final evaluations need: as long as the last step and the first
        evaluations took."""
        last_step = self.state.rows[-1].get("step_time_s", 0.0) if self.state.rows else 0.0
        return last_step + sum(e["seconds"] for e in self.state.evaluations if e["step"] == 0)

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
        kept = f"the checkpoint of step {self._saved_step} in {self.checkpoint_dir} is the last good one" \
            if self._saved_step else "no checkpoint was saved before it"
        raise TrainingDivergedError(
            f"step {self.state.step + 1}'s update made trainable weights NaN or infinite, so the run stopped before "
            f"serving or saving them; {kept}. Lower lr (now {self.lr:g}) or max_grad_norm and resume, or start again"
        )

    def _save(self) -> None:
        if self.checkpoint_dir is None:
            return
        assert self.policy is not None and self.optimizer is not None
        path = save_checkpoint(self.checkpoint_dir, self.policy.module, self.optimizer, self.state, lora=self.policy.is_lora)
        self._saved_step = self.state.step
        logger.info("checkpoint %s", path)

    def _save_if_behind(self) -> None:
        """Checkpoint the last finished step unless it is saved already: a run that stops between
        ``checkpoint_every`` steps (its time budget, a failing ``on_step``) would lose those steps."""
        if self.state.step > self._saved_step:
            self._save()

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
                            logprobs, old[i], batches[i], clip_eps=self.clip_eps, kl_coef=self.kl_coef,
                            ref_logprobs=ref[i], weight_total=total,
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
            "(top_p < 1, a response_format): the server reports logprobs of what it drew from, the trainer "
            "computes the unrestricted policy's. PPO ratios are then off from the start; for the last two, "
            "TorchGRPO(old_logprobs=\"recompute\") takes the old logprobs from the trainer's own forward pass.",
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

    def _row(
        self, rollouts: List[Rollout], batch: Any, stats: Dict[str, float], started: float, generated: float,
        rollouts_version: int,
    ) -> Dict[str, float]:
        """The step's metrics row. ``policy_version``: the version published after its update (the server's
        from then on, the checkpoint's); ``rollouts_version``: the one its rollouts ran with."""
        rewards = _rewards(rollouts)
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
            "lr": float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else float("nan"),
            "step_time_s": time.monotonic() - started,
        }
        if stats.get("train_tokens"):
            row["train_tokens_per_s"] = stats.get("train_tokens", 0.0) * self.ppo_epochs / stats["train_s"]
        return row

    # ------------------------------------------------------------------------------------------------------
    def _print_summary(self, result: TrainResult) -> None:
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
        _console("\n".join(lines))


def _rewards(rollouts: Sequence[Rollout]) -> List[float]:
    """The final rewards of the rollouts that succeeded with one (failed ones have none to count)."""
    return [r.final_reward for r in rollouts if r.status == "succeeded" and r.final_reward is not None]


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


def _check_sampling(**settings: Mapping[str, Any]) -> None:
    """Sampling settings agl's policy server cannot apply (e.g. vLLM's ``top_k``) fail here, not as a 400 on
    every rollout once the model is loaded."""
    for name, values in settings.items():
        unknown = sorted(set(values) - REQUEST_SETTINGS)
        if unknown:
            raise ValueError(
                f"{name} has {', '.join(map(repr, unknown))}, which agl's policy server does not support; it "
                f"takes {', '.join(sorted(REQUEST_SETTINGS))}"
            )


def _check_training_sampling(sampling: Mapping[str, Any], *, temperature: float, group_size: int) -> None:
    """Training settings in ``sampling`` that would train on something else than what the rollouts sampled:
    a ``temperature`` other than TorchGRPO's (the loss computes every logprob at ``temperature``), and a fixed
    ``seed`` with ``group_size > 1`` (every rollout of a group would be the same, so no advantage). Both are
    fine in ``val_sampling`` and ``extra_evals``, which train nothing."""
    if "temperature" in sampling and sampling["temperature"] != temperature:
        wanted = sampling["temperature"]
        raise ValueError(
            f"sampling has temperature={wanted!r} but TorchGRPO(temperature={temperature!r}): the rollouts would be "
            f"sampled at {wanted!r} while the loss computes every logprob at {temperature!r}. "
            + _temperature_advice(wanted)
        )
    if sampling.get("seed") is not None and group_size > 1:
        raise ValueError(
            f"sampling has seed={sampling['seed']!r}: with group_size={group_size} every rollout of a task would "
            "be sampled from the same prompt with the same seed, so a group's rollouts would be identical, their "
            "rewards equal and no advantage left to train on. Leave seed out of sampling (TorchGRPO(seed=...) "
            "seeds the run); val_sampling and extra_evals may fix one"
        )


def _temperature_advice(wanted: Any) -> str:
    """Where a temperature put in ``sampling`` belongs: TorchGRPO's own ``temperature``, unless it is greedy
    (0), which training refuses and only evaluations take."""
    if isinstance(wanted, (int, float)) and wanted <= 0:
        return (
            "Training samples at a temperature > 0 (greedy rollouts of a group are all alike: nothing to learn); "
            "for greedy evaluation leave temperature out of sampling and set val_sampling={'temperature': 0.0} "
            "or extra_evals={'greedy': {'temperature': 0.0}} (agl train: --set 'extra_evals={\"greedy\": "
            "{\"temperature\": 0}}')"
        )
    return (
        f"Set the training temperature with temperature={wanted!r} (agl train: --temperature {wanted!r}) and leave "
        "it out of sampling; val_sampling and extra_evals may set their own"
    )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token to pad batches with")
    return int(pad)


def _add(into: Dict[str, float], values: Mapping[str, float]) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0.0) + value


def _console(text: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False).print(text, markup=False, soft_wrap=True)
