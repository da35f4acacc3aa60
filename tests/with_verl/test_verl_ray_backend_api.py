"""The GPU backend cannot run here (no CUDA, no vLLM); this checks that every verl entry point it calls
exists in the installed verl with the parameters it passes, so a verl upgrade that moves them fails on CPU
instead of on the GPU box."""

from __future__ import annotations

import inspect

from agl.algorithm.verl.actor_backend import agl_trainer_class


def test_agl_trainer_is_verls_ray_ppo_trainer_with_the_steps_agl_drives() -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    cls = agl_trainer_class()
    assert issubclass(cls, RayPPOTrainer)
    for method in ("init_workers", "_compute_old_log_prob", "_compute_ref_log_prob", "_balance_batch", "_get_dp_size"):
        assert callable(getattr(cls, method)), method
    init = inspect.signature(RayPPOTrainer.__init__).parameters
    for name in ("config", "tokenizer", "processor", "role_worker_mapping", "resource_pool_manager"):
        assert name in init, name
    assert list(inspect.signature(RayPPOTrainer._create_dataloader).parameters)[1:] == [
        "train_dataset",
        "val_dataset",
        "collate_fn",
        "train_sampler",
    ]


def test_worker_setup_and_weight_sync_entry_points_exist() -> None:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.workers.rollout.llm_server import LLMServerManager

    for method in (
        "add_actor_rollout_worker",
        "add_reward_model_resource_pool",
        "add_teacher_model_resource_pool",
        "init_resource_pool_mgr",
    ):
        assert callable(getattr(BaseTaskRunner, method)), method
    assert callable(CheckpointEngineManager.sleep_replicas) and callable(CheckpointEngineManager.update_weights)
    assert callable(LLMServerManager.get_addresses)


def test_step_helpers_take_the_arguments_agl_passes() -> None:
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    assert {"adv_estimator", "gamma", "lam", "num_repeat", "norm_adv_by_std_in_grpo", "config"} <= set(
        inspect.signature(compute_advantage).parameters
    )
    assert {"kl_ctrl", "kl_penalty"} <= set(inspect.signature(apply_kl_penalty).parameters)
    assert "use_critic" in inspect.signature(compute_data_metrics).parameters
    for fn in (get_ppo_ray_runtime_env, reduce_metrics, rename_dict, tu.assign_non_tensor, tu.get):
        assert callable(fn)
