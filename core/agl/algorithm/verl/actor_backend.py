"""verl's actor workers driven one update at a time: what the two rollout engines share.

``agl.VERL`` trains with verl's own code whichever engine generates: verl's ``RayPPOTrainer`` step pieces
(``_balance_batch``, ``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``compute_advantage``) and its
actor workers' ``update_actor``, but not its ``fit``: rollouts come from agl's runners through the proxy,
and there is no dataset on the verl side. A subclass starts the workers and the engine
(:meth:`VerlActorBackend.start`) and moves the new weights to it (:meth:`VerlActorBackend.sync_weights`):

- :class:`agl.algorithm.verl.ray_backend.VerlRayBackend`: ``rollout.name=vllm``, verl's vLLM servers on GPUs;
- :class:`agl.algorithm.verl.agl_rollout.AglRolloutBackend`: ``rollout.name=agl``, agl's policy server
  (a CPU, a small GPU, or no vLLM).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Mapping, Optional

from agl.algorithm.verl.backend import Serving
from agl.algorithm.verl.config import VERLConfig

logger = logging.getLogger("agl.verl")


class VerlActorBackend:
    """The per-update part of a :class:`~agl.algorithm.verl.backend.PolicyBackend`; see the module docstring."""

    def __init__(self, config: VERLConfig, advantages: str) -> None:
        self.config = config
        self.advantages = advantages
        self.trainer: Any = None  # verl's RayPPOTrainer (agl's subclass), set by start()

    def start(self, total_steps: int) -> Serving:
        raise NotImplementedError

    def start_ray(self) -> None:
        """The Ray cluster verl's workers need; ``start`` calls it when nobody did before (runners on Ray do)."""
        self.init_ray()

    def sync_weights(self, step: int) -> Dict[str, float]:
        """Move the actor's weights after ``step`` updates to the engine; it serves them when this returns."""
        raise NotImplementedError

    def before_update(self) -> None:
        """What the engine does before the actor trains (vLLM hands its GPU memory over)."""

    def data_parallel_size(self) -> int:
        return int(self.trainer._get_dp_size(self.trainer.actor_rollout_wg, "actor"))

    def update(self, batch: Any, step: int, mini_batches: int) -> Dict[str, float]:
        import torch
        from verl.trainer.ppo.metric_utils import compute_data_metrics
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
        from verl.utils.metric import reduce_metrics

        from agl.algorithm.verl.batch import apply_loss_weights

        t = self.trainer
        cfg = self.config.dictconfig
        t.global_steps = step
        metrics: Dict[str, float] = {}
        self.before_update()
        batch.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
        if cfg.trainer.balance_batch:
            t._balance_batch(batch, metrics=metrics)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        batch.meta_info["images_seqlens"] = []

        old_log_prob, _ = t._compute_old_log_prob(batch)
        old_log_prob.batch.pop("entropys")
        batch = batch.union(old_log_prob)
        if t.use_reference_policy:
            batch = batch.union(t._compute_ref_log_prob(batch))
        if cfg.algorithm.use_kl_in_reward:
            batch, kl_metrics = apply_kl_penalty(
                batch, kl_ctrl=t.kl_ctrl_in_reward, kl_penalty=cfg.algorithm.kl_penalty
            )
            metrics.update(kl_metrics)
        if self.advantages == "verl":
            batch = compute_advantage(
                batch,
                adv_estimator=cfg.algorithm.adv_estimator,
                gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam,
                num_repeat=cfg.actor_rollout_ref.rollout.n,
                norm_adv_by_std_in_grpo=cfg.algorithm.get("norm_adv_by_std_in_grpo", True),
                config=cfg.algorithm,
            )
        apply_loss_weights(batch)
        actor_output = t.update_actor_in(batch, mini_batches)
        metrics.update(self.sync_weights(step))  # the engine serves the new weights again
        metrics.update(reduce_metrics(actor_output.meta_info["metrics"]))
        real = ~batch.non_tensor_batch["agl_padding"].astype(bool)
        metrics.update(compute_data_metrics(batch=batch.select_idxs(real), use_critic=False))
        return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

    def save_checkpoint(self, step: int) -> None:
        t = self.trainer
        cfg = self.config.dictconfig
        folder = os.path.join(cfg.trainer.default_local_dir, f"global_step_{step}", "actor")
        keep = cfg.trainer.get("max_actor_ckpt_to_keep", None)
        t.actor_rollout_wg.save_checkpoint(folder, None, step, max_ckpt_to_keep=keep)
        logger.info("saved the actor checkpoint of step %d to %s", step, folder)

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()

    # -- for subclasses ----------------------------------------------------------------------------------------
    def init_ray(self, env: Optional[Mapping[str, str]] = None, fake_gpus: int = 0) -> None:
        """``ray.init`` as verl's ``main_ppo`` calls it (``ray_kwargs.ray_init``, verl's runtime env), plus
        ``env`` for every worker and ``fake_gpus`` GPU resources (workers on CPU still ask Ray for GPUs);
        :func:`~agl.algorithm.verl.ray_cluster.start_ray` checks that workers start."""
        import ray
        from omegaconf import OmegaConf
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

        from agl.algorithm.verl.ray_cluster import start_ray

        cfg = self.config.dictconfig
        OmegaConf.resolve(cfg)
        if ray.is_initialized():
            return
        ray_init = OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True)
        runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), ray_init.pop("runtime_env", None) or {})
        runtime_env = OmegaConf.to_container(runtime_env)
        runtime_env.setdefault("env_vars", {}).update(env or {})
        if fake_gpus:
            ray_init["num_gpus"] = fake_gpus
        start_ray(ray_init, runtime_env)

    def make_trainer(self, total_steps: int) -> Any:
        """verl's trainer with the worker roles and resource pools verl's own TaskRunner sets up (minus the
        critic); its workers are not started yet."""
        from verl.trainer.main_ppo_v0 import BaseTaskRunner
        from verl.utils.config import omega_conf_to_dataclass

        cfg = self.config.dictconfig
        runner = BaseTaskRunner()
        runner.add_actor_rollout_worker(cfg)
        runner.add_reward_model_resource_pool(cfg)
        runner.add_teacher_model_resource_pool(cfg)
        pools = runner.init_resource_pool_mgr(cfg)
        model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
        return agl_trainer_class()(
            config=cfg,
            tokenizer=model_config.tokenizer,
            processor=model_config.processor,
            role_worker_mapping=runner.role_worker_mapping,
            resource_pool_manager=pools,
            total_training_steps=total_steps,
        )


def agl_trainer_class() -> type:
    """verl's RayPPOTrainer without a dataset on its side, and with a mini-batch count chosen per step."""
    import warnings

    from omegaconf import open_dict
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import tensordict_utils as tu
    from verl.utils.py_functional import rename_dict
    from verl.workers.utils.padding import left_right_2_no_padding

    class AglRayPPOTrainer(RayPPOTrainer):
        def __init__(self, *args: Any, total_training_steps: int, **kwargs: Any) -> None:
            self._agl_total_steps = total_training_steps
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # "RayPPOTrainer is deprecated": agl drives it
                super().__init__(*args, **kwargs)

        def _create_dataloader(self, *args: Any, **kwargs: Any) -> None:
            # Tasks come from agl's dataset and runners; verl only needs the step count for its schedulers.
            self.total_training_steps = self._agl_total_steps
            with open_dict(self.config):
                self.config.actor_rollout_ref.actor.optim.total_training_steps = self._agl_total_steps

        def update_actor_in(self, batch: DataProto, mini_batches: int) -> DataProto:
            """``_update_actor`` with ``mini_batches`` equal mini batches of the (padded) batch, since
            LightningRL's sample count per step varies (one sample per LLM call)."""
            rollout_config = self.config.actor_rollout_ref.rollout
            actor_config = self.config.actor_rollout_ref.actor
            batch.meta_info["multi_turn"] = rollout_config.multi_turn.enable
            batch.meta_info["temperature"] = rollout_config.temperature
            data = left_right_2_no_padding(batch.to_tensordict())
            mini_batch_size = len(batch) // mini_batches
            tu.assign_non_tensor(
                data,
                calculate_entropy=actor_config.calculate_entropy or actor_config.entropy_coeff != 0.0,
                distillation_use_topk=False,
                distillation_only=False,
                global_batch_size=mini_batch_size,
                mini_batch_size=mini_batch_size,
                epochs=actor_config.ppo_epochs,
                seed=actor_config.data_loader_seed,
                dataloader_kwargs={"shuffle": actor_config.shuffle},
                compute_loss=True,
            )
            output = tu.get(self.actor_rollout_wg.update_actor(data), "metrics")
            output = rename_dict(output, "actor/")
            output["perf/mfu/actor"] = output.pop("actor/mfu")
            return DataProto.from_single_dict(data={}, meta_info={"metrics": output})

    return AglRayPPOTrainer
