"""``actor_rollout_ref.rollout.name=agl``: verl's actor workers train, agl's policy server generates.

For a CPU, a small GPU, or a machine without vLLM: verl's own FSDP actor (``ActorRolloutRefWorker`` with
the ``actor`` role, in a local Ray cluster) trains exactly as under ``rollout.name=vllm``
(:class:`~agl.algorithm.verl.actor_backend.VerlActorBackend`), while :class:`agl.serving.server.PolicyServer`
serves the policy to the agents through the same proxy. After each update verl's ``update_weights`` hands
the actor's full weights to a checkpoint engine (:mod:`agl.algorithm.verl.weight_handoff`) that writes
them; the server loads them in place and answers as the next policy version.

On a machine without CUDA the workers run on verl's CPU platform (:mod:`agl.algorithm.verl.cpu_platform`,
``gloo``) and the settings in :data:`CPU_SETTINGS` apply to every key the user left unset.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional

from agl.algorithm.verl.actor_backend import VerlActorBackend
from agl.algorithm.verl.backend import Serving
from agl.algorithm.verl.config import VERLConfig, VERLConfigError

logger = logging.getLogger("agl.verl")

_ACTOR = "actor_rollout_ref.actor"
_REF = "actor_rollout_ref.ref"
_MODEL = "actor_rollout_ref.model"
_ENGINE = "actor_rollout_ref.rollout.checkpoint_engine"

#: What verl's FSDP actor needs on a CPU (set unless the user set the key): FSDP2 (FSDP1 insists on GPU
#: parameters), float32, no torch.compile, torch's own attention instead of flash-attn, no packing.
CPU_SETTINGS: Dict[str, Any] = {
    "trainer.device": "cpu",
    f"{_ACTOR}.strategy": "fsdp2",
    f"{_ACTOR}.fsdp_config.strategy": "fsdp2",
    f"{_ACTOR}.fsdp_config.model_dtype": "fp32",
    f"{_ACTOR}.fsdp_config.dtype": "float32",
    f"{_ACTOR}.fsdp_config.use_torch_compile": False,
    f"{_ACTOR}.use_torch_compile": False,
    f"{_REF}.fsdp_config.strategy": "fsdp2",
    f"{_REF}.fsdp_config.dtype": "float32",
    f"{_REF}.fsdp_config.use_torch_compile": False,
    f"{_REF}.use_torch_compile": False,
    f"{_MODEL}.use_remove_padding": False,
    f"{_MODEL}.enable_gradient_checkpointing": False,
    f"{_MODEL}.override_config.attn_implementation": "sdpa",
}


#: A short run on one worker with the ``agl`` engine: GRPO, no validation, no checkpoints, one pass over the
#: tasks in order. What the CPU tests and ``benchmarks/verl_reward.py`` start from; add the model, the sizes
#: and ``trainer.default_local_dir``.
SMALL_RUN: Dict[str, Any] = {
    "algorithm.adv_estimator": "grpo",
    "data.shuffle": "false",
    "actor_rollout_ref.rollout.name": "agl",
    "trainer.n_gpus_per_node": 1,
    "trainer.val_before_train": "false",
    "trainer.test_freq": -1,
    "trainer.save_freq": -1,
    "trainer.total_epochs": 1,
}


class AglRolloutBackend(VerlActorBackend):
    """verl's actor workers plus agl's policy server; see the module docstring."""

    def __init__(self, config: VERLConfig, advantages: str) -> None:
        super().__init__(config, advantages)
        self.server: Any = None  # agl's PolicyServer, set by start()
        self._folder: Optional[str] = None  # where the actor writes its weights for the server
        self._syncs = 0  # weight syncs after an update: the server's policy version

    def start_ray(self) -> None:
        """The weight handoff's folder, the settings (CPU ones on a CPU) and Ray with the workers' environment
        and, on a CPU, as many fake GPUs as workers."""
        if self._folder is not None:
            return
        import torch

        on_cpu = not torch.cuda.is_available()
        self._folder = tempfile.mkdtemp(prefix="agl-verl-weights-")
        env = self._prepare(on_cpu)
        self.init_ray(env, fake_gpus=self.config.n_gpus if on_cpu else 0)

    def start(self, total_steps: int) -> Serving:
        import torch

        on_cpu = not torch.cuda.is_available()
        self.start_ray()
        t = self.trainer = self.make_trainer(total_steps)
        started = time.monotonic()
        self._start_workers()
        logger.info("verl's actor workers are up in %.1f s (%s)", time.monotonic() - started, t.device_name)
        self.server = self._serve(on_cpu)
        self.sync_weights(0)  # the server starts from the actor's weights, whatever verl did on loading
        pad = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else t.tokenizer.eos_token_id
        return Serving(upstreams=[self.server.base_url], model=self.server.model_name, pad_token_id=int(pad or 0))

    def _start_workers(self) -> None:
        """verl's worker class in the roles ``actor`` and, for a KL loss or KL in the reward, ``ref``: both in
        the same processes, as verl colocates them, but without the ``rollout`` role (no vLLM engine)."""
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
        from verl.single_controller.ray.base import create_colocated_worker_cls
        from verl.trainer.ppo.ray_trainer import Role

        t = self.trainer
        # verl maps the fused ActorRolloutRef role when it needs a reference model, ActorRollout otherwise
        role = Role.ActorRolloutRef if Role.ActorRolloutRef in t.role_worker_mapping else Role.ActorRollout
        roles = ["actor", "ref"] if t.use_reference_policy and not t.ref_in_actor else ["actor"]
        config = self.config.dictconfig.actor_rollout_ref
        cls = t.role_worker_mapping[role]
        t.resource_pool_manager.max_colocate_count = 1  # one worker group: a CPU and a GPU per worker
        t.resource_pool_manager.create_resource_pool()
        group = RayWorkerGroup(
            resource_pool=t.resource_pool_manager.get_resource_pool(role),
            ray_cls_with_init=create_colocated_worker_cls(
                class_dict={name: RayClassWithInitArgs(cls=cls, config=config, role=name) for name in roles}
            ),
            device_name=t.device_name,
        )
        groups = group.spawn(prefix_set=roles)
        if "ref" in groups:
            t.ref_policy_wg = groups["ref"]
            t.ref_policy_wg.init_model()
        t.actor_rollout_wg = groups["actor"]
        t.actor_rollout_wg.init_model()
        if t.ref_in_actor:  # LoRA: the reference is the actor without its adapter
            t.ref_policy_wg = t.actor_rollout_wg

    def sync_weights(self, step: int) -> Dict[str, float]:
        import ray

        from agl.algorithm.verl.weight_handoff import handoff_path

        assert self._folder is not None, "start() comes first"
        started = time.monotonic()
        written = ray.get(self.trainer.actor_rollout_wg.update_weights(global_steps=step))
        path = handoff_path(self._folder, step)
        loaded = time.monotonic()
        if step:  # step 0 is the initial sync: still version 0
            self._syncs += 1
        self.server.load_weights(path, version=self._syncs)
        os.remove(path)
        metrics = dict(written[0] or {})
        metrics["agl/weight_sync/load_s"] = time.monotonic() - loaded
        metrics["agl/weight_sync/s"] = time.monotonic() - started
        return metrics

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        super().stop()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _prepare(self, on_cpu: bool) -> Dict[str, str]:
        """Set the weight handoff (and on a CPU, :data:`CPU_SETTINGS`) in the config; the workers' environment."""
        from omegaconf import OmegaConf, open_dict

        from agl.algorithm.verl import weight_handoff

        settings: Dict[str, Any] = {
            f"{_ENGINE}.backend": weight_handoff.BACKEND,
            f"{_ENGINE}.custom_backend_module": weight_handoff.__name__,
            f"{_ENGINE}.engine_kwargs.{weight_handoff.BACKEND}": {"folder": self._folder},
        }
        if on_cpu:
            settings.update({k: v for k, v in CPU_SETTINGS.items() if k not in self.config.user_keys})
            if self.config.get(f"{_ACTOR}.strategy") == "fsdp" and f"{_ACTOR}.strategy" in self.config.user_keys:
                raise VERLConfigError(
                    f"{_ACTOR}.strategy=fsdp cannot train on a CPU (verl's FSDP1 needs GPU parameters): use fsdp2"
                )
        with open_dict(self.config.dictconfig):
            for key, value in settings.items():
                OmegaConf.update(self.config.dictconfig, key, value, force_add=True)
        if not on_cpu:
            return {}
        from agl.algorithm.verl.cpu_platform import CPU_ENV

        os.environ.update(CPU_ENV)  # this process too: verl reads them when it first asks for its platform
        return dict(CPU_ENV)

    def _serve(self, on_cpu: bool) -> Any:
        from agl.serving.models import load_policy
        from agl.serving.server import PolicyServer

        model, tokenizer = load_policy(self.config.model_path, dtype="float32" if on_cpu else None)
        server = PolicyServer(
            model, tokenizer, model_name=self.config.model_path, default_max_tokens=self.config.max_response_length
        )
        server.start()
        return server


__all__ = ["AglRolloutBackend", "CPU_SETTINGS", "SMALL_RUN"]
