"""verl 0.9.1's Ray workers and vLLM servers as agl's :class:`~agl.algorithm.verl.trainer.PolicyBackend`.

Needs CUDA GPUs, ``verl[verl-core]`` and ``vllm`` (docs/verl.md); not exercised by the CPU test suite,
only by ``examples/verl_gpu_train.py``. Written against verl 0.9.1's legacy ``RayPPOTrainer``
(``verl/trainer/ppo/ray_trainer.py``), the one verl trainer that lets the caller drive each step: agl
uses its worker setup (``init_workers``: FSDP actor, optional reference policy, the vLLM replicas and
the checkpoint engine that moves weights between them) and its per-step pieces
(``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``compute_advantage``), but not its ``fit``:
rollouts come from agl's runners through the proxy instead of verl's agent loop, and there is no dataset
on the verl side.

Per update (colocated "hybrid engine", as verl runs it): vLLM replicas sleep (GPU memory to training),
old log-probs (and reference log-probs with a KL term) are recomputed, advantages computed when verl
owns them, LightningRL's loss weights folded in, the actor trained, and the weights pushed back to the
woken replicas.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict

from agl.algorithm.verl.backend import Serving
from agl.algorithm.verl.config import VERLConfig

logger = logging.getLogger("agl.verl")


class VerlRayBackend:
    def __init__(self, config: VERLConfig, advantages: str) -> None:
        self.config = config
        self.advantages = advantages
        self.trainer: Any = None

    # -- start -------------------------------------------------------------------------------------------------
    def start(self, total_steps: int) -> Serving:
        import httpx
        import ray
        from omegaconf import OmegaConf
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
        from verl.trainer.main_ppo_v0 import BaseTaskRunner
        from verl.utils.config import omega_conf_to_dataclass

        cfg = self.config.dictconfig
        OmegaConf.resolve(cfg)
        if not ray.is_initialized():
            ray_init = OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True)
            runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), ray_init.pop("runtime_env", None) or {})
            ray.init(runtime_env=OmegaConf.to_container(runtime_env), **ray_init)

        # Worker roles and GPU pools exactly as verl's own TaskRunner sets them up (minus the critic).
        runner = BaseTaskRunner()
        runner.add_actor_rollout_worker(cfg)
        runner.add_reward_model_resource_pool(cfg)
        runner.add_teacher_model_resource_pool(cfg)
        pools = runner.init_resource_pool_mgr(cfg)
        model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
        tokenizer = model_config.tokenizer

        trainer_cls = _agl_trainer_class()
        self.trainer = trainer_cls(
            config=cfg,
            tokenizer=tokenizer,
            processor=model_config.processor,
            role_worker_mapping=runner.role_worker_mapping,
            resource_pool_manager=pools,
            total_training_steps=total_steps,
        )
        self.trainer.init_workers()  # ends with the replicas asleep
        self.trainer.checkpoint_manager.update_weights(0)  # wake them with the initial weights

        upstreams = [f"http://{address}/v1" for address in self.trainer.llm_server_manager.get_addresses()]
        models = httpx.get(f"{upstreams[0]}/models", timeout=60).json()["data"]
        served = models[0]["id"]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        logger.info("verl serves %s at %s", served, ", ".join(upstreams))
        return Serving(upstreams=upstreams, model=served, pad_token_id=int(pad or 0))

    def data_parallel_size(self) -> int:
        return int(self.trainer._get_dp_size(self.trainer.actor_rollout_wg, "actor"))

    # -- one update --------------------------------------------------------------------------------------------
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
        t.checkpoint_manager.sleep_replicas()  # GPU memory goes to training
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
        t.checkpoint_manager.update_weights(step)  # push the new weights and wake the replicas
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


def _agl_trainer_class() -> type:
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


__all__ = ["VerlRayBackend"]
