"""``agl.VERL``: the training loop that runs agents on agl's runners and updates the policy with verl.

One step:

1. keep ``data.train_batch_size`` task groups in flight (``rollout.n`` rollouts each; with
   ``async_groups=k``, k more, so that the next batch is already being generated while this one trains);
2. wait until ``train_batch_size`` groups have all their rollouts finished; unfinished groups carry over
   to the next step (async) or are waited for (sync);
3. build the batch: ``LightningRL.from_config(adapter).build_batch(store, rollouts)`` (credit, rollout-level
   advantages, loss weights), then :func:`~agl.algorithm.verl.batch.samples_to_dataproto`;
4. pause the proxy (new LLM requests wait, those in flight finish), let the backend train on the batch and
   push the weights to the inference servers, resume the proxy;
5. publish a new resources version (the same endpoint; its version tells which policy answered).

The backend (:class:`PolicyBackend`) owns everything on the GPUs: verl's workers, the vLLM servers, the
weight sync. :class:`agl.algorithm.verl.ray_backend.VerlRayBackend` is the real one; the loop itself needs
no GPU and is tested on CPU with a backend that records what it was given.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union

from agl.algorithm.base import Algorithm, EmptySteps
from agl.algorithm.verl.backend import PolicyBackend, Serving
from agl.algorithm.verl.config import ConfigInput, VERLConfig, VERLConfigError, as_verl_config
from agl.errors import NoTrainableSamples
from agl.openai_wire.sampling import openai_arguments
from agl.runtime.dataset import as_tasks
from agl.store.base import EnqueueRequest
from agl.types import ProxyLLM, Rollout, Task

logger = logging.getLogger("agl.verl")

AdvantageSource = Literal["lightningrl", "verl"]
_LIGHTNINGRL_ESTIMATORS = ("grpo", "rloo")
_ROLLOUT = "actor_rollout_ref.rollout"
_VAL_PROFILE = "val"  # the proxy's sampling profile of validation rollouts (LLMProxy.profile_url)


@dataclass
class _Group:
    """The ``n`` rollouts of one task enqueued together (a GRPO group)."""

    task: Task
    rollout_ids: List[str]
    enqueued_at_version: int  # VERL.policy_version when enqueued
    done: Dict[str, Rollout] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.rollout_ids)


@dataclass
class StepResult:
    step: int
    metrics: Dict[str, float]


@dataclass
class TrainingSummary:
    steps: List[StepResult] = field(default_factory=list)
    validations: List[Dict[str, float]] = field(default_factory=list)


class VERL(Algorithm):
    """Train the agent's LLM with verl (GRPO by default) on GPUs; see docs/verl.md.

    ``VERL(config)`` takes the verl keys as a nested dict or as ``"key=value"`` overrides (both:
    ``VERL(config, overrides=[...])``); they are merged onto verl's defaults and validated at once
    (:class:`VERLConfigError`). Options of agl's loop:

    - ``advantages``: ``"lightningrl"`` (default) trains on LightningRL's rollout-level advantages and loss
      weights (every rollout weighs the same however many LLM calls it made); ``"verl"`` lets verl's
      ``algorithm.adv_estimator`` compute per-sample advantages from the rewards (Agent Lightning v0.3);
    - ``overlong_prompt`` / ``overlong_response``: see :mod:`agl.algorithm.verl.batch`;
    - ``async_groups``: extra task groups kept generating while a step trains (0: synchronous);
    - ``llm_resource``: the resource name agents read the model from (``"main_llm"``);
    - ``proxy_spans``: the proxy records an llm span per call (set False when every agent is traced on its
      own side with ``agl.instrument()``, which records the same calls);
    - ``backend``: a :class:`PolicyBackend` (default: verl's Ray workers and vLLM servers).
    """

    def __init__(
        self,
        config: Union[VERLConfig, ConfigInput] = None,
        overrides: Sequence[str] = (),
        *,
        advantages: AdvantageSource = "lightningrl",
        overlong_prompt: str = "drop",
        overlong_response: str = "truncate",
        async_groups: int = 0,
        llm_resource: str = "main_llm",
        proxy_spans: bool = True,
        proxy_host: str = "127.0.0.1",
        proxy_port: int = 0,
        wait_timeout: Optional[float] = None,
        seed: int = 0,
        backend: Optional[PolicyBackend] = None,
    ) -> None:
        self.config = as_verl_config(config, overrides)
        if advantages not in ("lightningrl", "verl"):
            raise VERLConfigError(f'advantages must be "lightningrl" or "verl", got {advantages!r}')
        if advantages == "lightningrl" and self.config.adv_estimator not in _LIGHTNINGRL_ESTIMATORS:
            raise VERLConfigError(
                f"algorithm.adv_estimator={self.config.adv_estimator} is not a LightningRL estimator "
                f"({', '.join(_LIGHTNINGRL_ESTIMATORS)}): use one of those, or VERL(..., advantages='verl') to let "
                "verl compute it per sample"
            )
        if overlong_prompt not in ("drop", "truncate") or overlong_response not in ("truncate", "drop"):
            raise VERLConfigError(
                f'overlong_prompt must be "drop" or "truncate" and overlong_response "truncate" or "drop", got '
                f"{overlong_prompt!r} and {overlong_response!r}"
            )
        if not isinstance(async_groups, int) or async_groups < 0:
            raise VERLConfigError(f"async_groups must be a non-negative integer, got {async_groups!r}")
        if advantages == "lightningrl" and self.config.get("algorithm.use_kl_in_reward"):
            # verl subtracts the KL penalty from token_level_rewards after LightningRL computed the advantages
            # from the raw rewards: the penalty would change nothing the actor trains on.
            raise VERLConfigError(
                "algorithm.use_kl_in_reward=true has no effect with advantages='lightningrl' (the advantages are "
                "computed from the rewards before verl applies the in-reward KL penalty): set "
                "actor_rollout_ref.actor.use_kl_loss=true for a KL term in the loss, or use "
                "VERL(..., advantages='verl') to let verl compute the advantages from the penalised rewards"
            )
        self.advantages = advantages
        self.overlong = (overlong_prompt, overlong_response)
        self.async_groups = async_groups
        self.llm_resource = llm_resource
        self.proxy_spans = proxy_spans
        self.proxy_address = (proxy_host, proxy_port)
        self.wait_timeout = wait_timeout
        self.rng = random.Random(seed)
        self.backend = backend
        self.proxy: Any = None
        self.policy_version = 0  # weight updates done so far
        self.train_resources_id: Optional[str] = None  # the resources training rollouts are enqueued with
        self.empty_steps = EmptySteps(limit=3)  # consecutive steps without a trainable sample before giving up
        self.summary = TrainingSummary()

    # -- the adapter -------------------------------------------------------------------------------------------
    def lightningrl(self) -> Any:
        """The trainer's adapter as a LightningRL, with verl's estimator unless the adapter chose one."""
        from agl.lightningrl.adapter import LightningRL
        from agl.lightningrl.agent_match import PolicyMatcher

        adapter = self.adapter
        if adapter is None or isinstance(adapter, Mapping):
            settings = dict(adapter or {})
            if self.advantages == "lightningrl":
                settings.setdefault("estimator", self.config.adv_estimator)
                if self.config.adv_estimator == "grpo":
                    normalize = bool(self.config.get("algorithm.norm_adv_by_std_in_grpo", True))
                    settings.setdefault("estimator_options", {"normalize_std": normalize})
            adapter = settings
        lightningrl = LightningRL.from_config(adapter)
        policies = PolicyMatcher(lightningrl.agent_match).policies
        if len(policies) > 1:
            # The DataProto has no policy column: verl would train every policy's calls into one model, and
            # with advantages="verl" group them into one GRPO baseline per task.
            raise VERLConfigError(
                f"agl.VERL trains one policy, but the adapter's agent_match {lightningrl.agent_match!r} names "
                f"{len(policies)} ({', '.join(policies)}): give agent_match a regex (every matching agent's calls "
                "train the one model) or map every agent to the same policy name"
            )
        return lightningrl

    # -- run ---------------------------------------------------------------------------------------------------
    def start_ray(self) -> None:
        """verl's Ray cluster, as the backend starts it (runtime env, and fake GPUs on a CPU), before the runners
        on Ray join it; :meth:`run` then finds it started."""
        start_ray = getattr(self._chosen_backend(), "start_ray", None)  # a backend of one's own may have no Ray
        if start_ray is not None:
            start_ray()

    def _chosen_backend(self) -> PolicyBackend:
        """The backend given, else the one ``rollout.name`` names (checked against this machine first)."""
        if self.backend is None:
            self.config.check_runtime()
            self.backend = _backend_for(self.config, self.advantages)
        return self.backend

    def run(self, train_dataset: Optional[Sequence[Any]], val_dataset: Optional[Sequence[Any]]) -> TrainingSummary:
        from agl.instrumentation.proxy import LLMProxy

        if not train_dataset:
            raise ValueError("agl.VERL needs a train_dataset: trainer.fit(agent, train_dataset=[...])")
        tasks = as_tasks(train_dataset)
        batch_size = self.config.train_batch_size
        if len(tasks) < batch_size:
            raise VERLConfigError(
                f"the train dataset has {len(tasks)} tasks, fewer than data.train_batch_size={batch_size}: "
                "lower the batch size or add tasks"
            )
        backend = self._chosen_backend()
        adapter = self.lightningrl()  # fail on a bad adapter before the GPUs start
        if len(tasks) % batch_size:
            logger.info("each epoch leaves out %d task(s) that do not fill a batch", len(tasks) % batch_size)
        schedule_steps, total_steps = self.step_counts(len(tasks))
        host, port = self.proxy_address
        try:
            serving = backend.start(schedule_steps)
            store = self.store if self.proxy_spans else None
            self.proxy = LLMProxy(serving.upstreams, store, host=host, port=port, model=serving.model).start()
            self._publish(serving.model)
            if val_dataset and self.config.get("trainer.val_before_train"):
                self._validate(val_dataset, step=0)
            self._train(tasks, total_steps, adapter, serving, val_dataset)
        finally:
            if self.proxy is not None:
                self.proxy.stop()
            backend.stop()
        return self.summary

    def step_counts(self, n_tasks: int) -> Tuple[int, int]:
        """The steps the LR schedule is sized for, and the steps that run, as verl's ``RayPPOTrainer`` counts
        them: ``trainer.total_training_steps`` when set, else whole batches times ``trainer.total_epochs``
        (verl's default is 30 epochs, so ``total_training_steps`` is the way to bound a run). The data ends
        the run after ``total_epochs`` passes even when ``total_training_steps`` asks for more; the schedule
        is still sized for ``total_training_steps``, as in verl."""
        epoch_steps = n_tasks // self.config.train_batch_size * self.config.total_epochs
        wanted = self.config.total_training_steps
        if wanted is None:
            return epoch_steps, epoch_steps
        if wanted > epoch_steps:
            logger.warning(
                "trainer.total_training_steps=%d but trainer.total_epochs=%d passes over the data make only %d "
                "steps: the run ends after %d (raise trainer.total_epochs to run them all)",
                wanted,
                self.config.total_epochs,
                epoch_steps,
                epoch_steps,
            )
        return wanted, min(wanted, epoch_steps)

    def _train(
        self, tasks: List[Task], total_steps: int, adapter: Any, serving: Serving, val_dataset: Optional[Sequence[Any]]
    ) -> None:
        stream = self._task_stream(tasks)
        in_flight: OrderedDict[str, _Group] = OrderedDict()
        batch_size = self.config.train_batch_size
        test_freq = int(self.config.get("trainer.test_freq") or -1)
        save_freq = int(self.config.get("trainer.save_freq") or -1)
        for step in range(1, total_steps + 1):
            steps_left = total_steps - step + 1
            wanted = min(batch_size + self.async_groups, batch_size * steps_left)
            self._top_up(in_flight, stream, wanted)
            started = time.monotonic()
            groups = self._wait_for_groups(in_flight, batch_size)
            waited = time.monotonic() - started
            # Weight updates between a group's enqueue and this update (0: generated fully on-policy).
            staleness = max(self.policy_version - g.enqueued_at_version for g in groups)
            rollouts = [r for g in groups for r in (g.done[i] for i in g.rollout_ids)]
            metrics = _rollout_metrics(rollouts)
            try:
                self._update(step, rollouts, adapter, serving, metrics)
                self.empty_steps.trained()
            except NoTrainableSamples as exc:
                self.empty_steps.nothing(step, str(exc))
                metrics["agl/step_skipped"] = 1.0
            metrics["agl/policy_version"] = float(self.policy_version)
            self.trainer.learned_from(rollouts)
            metrics["agl/timing/wait_s"] = waited
            metrics["agl/async/carried_over_groups"] = float(len(in_flight))
            metrics["agl/async/max_staleness"] = float(staleness)
            if save_freq > 0 and (step % save_freq == 0 or step == total_steps):
                self.backend.save_checkpoint(step)  # type: ignore[union-attr]  # the backend is set by start(), before any step
            if val_dataset and test_freq > 0 and (step % test_freq == 0 or step == total_steps):
                metrics.update(self._validate(val_dataset, step))
            self.summary.steps.append(StepResult(step, metrics))
            logger.info("step %d/%d: %s", step, total_steps, _format_metrics(metrics))
        for group in in_flight.values():  # async leftovers after the last step
            for rollout_id in group.rollout_ids:
                if rollout_id not in group.done:
                    self.store.cancel_rollout(rollout_id)

    def _task_stream(self, tasks: List[Task]) -> Iterator[Task]:
        """Tasks epoch after epoch, shuffled per epoch, whole batches only (like verl's drop_last)."""
        usable = len(tasks) - len(tasks) % self.config.train_batch_size
        shuffle = bool(self.config.get("data.shuffle", True))
        for _ in range(self.config.total_epochs):
            order = list(tasks)
            if shuffle:
                self.rng.shuffle(order)
            yield from order[:usable]

    def _top_up(self, in_flight: OrderedDict[str, _Group], stream: Iterator[Task], wanted: int) -> None:
        n = self.config.n
        requests: List[Tuple[Task, List[EnqueueRequest]]] = []
        while len(in_flight) + len(requests) < wanted:
            task = next(stream, None)
            if task is None:
                break
            requests.append(
                (
                    task,
                    [
                        EnqueueRequest(
                            input=task.input,
                            task_id=task.task_id,
                            mode="train",
                            # Explicit, not the latest: validation publishes its own resources meanwhile.
                            resources_id=self.train_resources_id,
                            config=self.trainer.rollout_config,
                            metadata=task.metadata,
                        )
                        for _ in range(n)
                    ],
                )
            )
        if not requests:
            return
        rollouts = self.store.enqueue_many([r for _, group in requests for r in group])
        for index, (task, _) in enumerate(requests):
            ids = [r.rollout_id for r in rollouts[index * n : (index + 1) * n]]
            in_flight[ids[0]] = _Group(task, ids, self.policy_version)

    def _wait_for_groups(self, in_flight: OrderedDict[str, _Group], count: int) -> List[_Group]:
        """Block until ``count`` groups are complete; remove and return the oldest complete ones."""
        from agl._util.progress import progress_bar

        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        total = sum(len(g.rollout_ids) for g in in_flight.values())
        with progress_bar(f"rollouts (step of {count} groups)", total=total, enabled=self.trainer.progress) as advance:
            advance(sum(len(g.done) for g in in_flight.values()))
            while sum(g.complete for g in in_flight.values()) < count:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"only {sum(g.complete for g in in_flight.values())} of {count} task groups finished within "
                        f"{self.wait_timeout} s; are the runners alive? (VERL(wait_timeout=...) sets this limit)"
                    )
                owner = {rid: g for g in in_flight.values() for rid in g.rollout_ids if rid not in g.done}
                for rollout in self.store.wait_for_rollouts(sorted(owner), timeout=0.5):
                    group = owner.get(rollout.rollout_id)
                    if group is not None:
                        group.done[rollout.rollout_id] = rollout
                        advance(1)
        ready = [key for key, g in in_flight.items() if g.complete][:count]
        return [in_flight.pop(key) for key in ready]

    def _update(
        self, step: int, rollouts: List[Rollout], adapter: Any, serving: Serving, metrics: Dict[str, float]
    ) -> None:
        """Train on ``rollouts``; the step's counts go into ``metrics`` as they are known, so a step that
        raises :class:`NoTrainableSamples` (nothing left to train on) still reports why."""
        from agl.algorithm.verl.batch import ConversionReport, pad_to_divisor, samples_to_dataproto

        batch = adapter.build_batch(self.store, rollouts, progress=self.trainer.progress)
        metrics["agl/lightningrl/samples"] = float(batch.report.samples)
        metrics["agl/lightningrl/failed_dropped"] = float(batch.report.failed_dropped)
        report = ConversionReport(samples_in=len(batch.samples))
        metrics.update(report.metrics())
        if not batch.samples:
            raise NoTrainableSamples(batch.report.why_empty(adapter.agent_match))
        try:
            data, _ = samples_to_dataproto(
                batch.samples,
                max_prompt_length=self.config.max_prompt_length,
                max_response_length=self.config.max_response_length,
                pad_token_id=serving.pad_token_id,
                overlong_prompt=self.overlong[0],  # type: ignore[arg-type]  # checked against the literals in __init__
                overlong_response=self.overlong[1],  # type: ignore[arg-type]  # checked against the literals in __init__
                precomputed_advantages=self.advantages == "lightningrl",
                report=report,
            )
        finally:
            metrics.update(report.metrics())
        if report.dropped or report.prompts_truncated or report.responses_truncated:
            logger.warning("step %d: %s", step, report)
        mini_batches, divisor = self.mini_batches(len(data))
        data = pad_to_divisor(data, divisor, report)
        self.proxy.pause()
        try:
            metrics.update(self.backend.update(data, step, mini_batches))  # type: ignore[union-attr]  # the backend is set by start(), before any step
            self.policy_version += 1
        finally:
            self.proxy.resume()
        self._publish(serving.model)
        metrics.update(report.metrics())  # padding_rows

    def mini_batches(self, rows: int) -> Tuple[int, int]:
        """How many mini batches a batch of ``rows`` samples is split into, and the row count to pad to a
        multiple of. verl sizes a mini batch as ``ppo_mini_batch_size * rollout.n`` samples; LightningRL
        makes one sample per LLM call, so the count per step varies and the split keeps mini batches near
        that size: ``round(rows / that)`` of them (at least 1). Each rank's share of a mini batch is a whole
        number of update micro batches, and each rank's share of the batch one of log-prob micro batches."""
        target = self.config.ppo_mini_batch_size * self.config.n
        count = max(1, round(rows / target))
        update_micro, infer_micro = self.config.micro_batch_rows
        ranks = self.backend.data_parallel_size()  # type: ignore[union-attr]  # the backend is set by start(), before any step
        return count, ranks * math.lcm(count * update_micro, infer_micro)

    def _publish(self, model: str, section: str = _ROLLOUT) -> str:
        """A new resources version with the proxy as ``llm_resource`` (other resources are kept), sampling
        as ``section`` says; the proxy fills the same settings into requests that leave them out.

        Validation (any other ``section``) gets the proxy's own sampling profile, a URL of its own: in async
        mode training rollouts still generate during validation, and each rollout must be sampled as the
        resources it was started with say, never with the validation settings. Training rollouts are
        enqueued with the id of the latest training version (:attr:`train_resources_id`) for the same reason.
        """
        sampling = self._sampling(section)
        training = section == _ROLLOUT
        if training:
            self.proxy.set_sampling(sampling, f"{_ROLLOUT}.temperature")
            endpoint = self.proxy.base_url
        else:
            self.proxy.set_sampling(sampling, profile=_VAL_PROFILE)
            endpoint = self.proxy.profile_url(_VAL_PROFILE)
        params, _ = openai_arguments(sampling)  # top_k is not one: the proxy fills it in
        latest = self.store.get_resources()
        resources = dict(latest.resources) if latest is not None else {}
        resources[self.llm_resource] = ProxyLLM(endpoint=endpoint, model=model, sampling_parameters=params)
        resources_id = self.store.add_resources(resources).resources_id
        if training:
            self.train_resources_id = resources_id
        return resources_id

    def _sampling(self, section: str) -> Dict[str, Any]:
        """What verl's agent loop samples with: the section's temperature, top_p and top_k (left out when
        they do not restrict), and at most ``data.max_response_length`` tokens (verl's vLLM server caps at
        the response length; a longer response would be cut for training yet keep its full reward)."""
        params: Dict[str, Any] = {
            "temperature": float(self.config.get(f"{section}.temperature", 1.0)),
            "max_tokens": self.config.max_response_length,
        }
        top_p, top_k = self.config.get(f"{section}.top_p"), self.config.get(f"{section}.top_k")
        if top_p is not None and float(top_p) < 1.0:
            params["top_p"] = float(top_p)
        if top_k is not None and int(top_k) > 0:
            params["top_k"] = int(top_k)
        return params

    def _validate(self, val_dataset: Sequence[Any], step: int) -> Dict[str, float]:
        """Run the validation tasks once with ``rollout.val_kwargs`` sampling; mean reward and success rate."""
        resources_id = self._publish(self.proxy.model, f"{_ROLLOUT}.val_kwargs")
        rollouts = self.trainer.run_tasks(val_dataset, mode="val", resources_id=resources_id, description="validation")
        self._publish(self.proxy.model)  # the latest version is a training one again, for whoever reads it
        rewards = [r.final_reward if r.final_reward is not None else 0.0 for r in rollouts]
        metrics = {
            "val/reward_mean": float(sum(rewards) / len(rewards)) if rewards else math.nan,
            "val/succeeded": float(sum(r.status == "succeeded" for r in rollouts)),
            "val/rollouts": float(len(rollouts)),
        }
        self.summary.validations.append({"step": float(step), **metrics})
        logger.info("validation at step %d: %s", step, _format_metrics(metrics))
        return metrics


def _backend_for(config: VERLConfig, advantages: str) -> PolicyBackend:
    """The backend of ``actor_rollout_ref.rollout.name``: verl's vLLM servers, or agl's policy server."""
    if config.rollout_name == "agl":
        from agl.algorithm.verl.agl_rollout import AglRolloutBackend

        return AglRolloutBackend(config, advantages)
    from agl.algorithm.verl.ray_backend import VerlRayBackend

    return VerlRayBackend(config, advantages)


def _rollout_metrics(rollouts: Sequence[Rollout]) -> Dict[str, float]:
    """The counts of a step's rollouts, reported whether or not the step trains."""
    rewards = [r.final_reward for r in rollouts if r.final_reward is not None]
    return {
        "agl/rollouts": float(len(rollouts)),
        "agl/rollouts_failed": float(sum(r.status != "succeeded" for r in rollouts)),
        "agl/reward_mean": float(sum(rewards) / len(rewards)) if rewards else math.nan,
    }


def _format_metrics(metrics: Mapping[str, float]) -> str:
    keys = [k for k in metrics if k.startswith(("agl/reward", "val/", "actor/pg_loss", "agl/batch/samples_out"))]
    return ", ".join(f"{k}={metrics[k]:.4g}" for k in keys) or f"{len(metrics)} metrics"


__all__ = ["StepResult", "TrainingSummary", "VERL"]
