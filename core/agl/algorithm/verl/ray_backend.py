"""verl 0.9.1's Ray workers and vLLM servers as agl's :class:`~agl.algorithm.verl.backend.PolicyBackend`
(``actor_rollout_ref.rollout.name=vllm``).

Needs CUDA GPUs, ``verl[verl-core]`` and ``vllm`` (docs/verl.md). Written against verl 0.9.1's legacy
``RayPPOTrainer`` (``verl/trainer/ppo/ray_trainer.py``): agl uses its worker setup (``init_workers``: FSDP
actor, optional reference policy, the vLLM replicas and the checkpoint engine that moves weights between
them) and the per-step pieces :class:`~agl.algorithm.verl.actor_backend.VerlActorBackend` shares with the
``agl`` rollout engine.

Per update (colocated "hybrid engine", as verl runs it): vLLM replicas sleep (GPU memory to training), the
actor trains, and the weights are pushed back to the woken replicas.
"""

from __future__ import annotations

import logging
from typing import Dict

from agl.algorithm.verl.actor_backend import VerlActorBackend
from agl.algorithm.verl.backend import Serving

logger = logging.getLogger("agl.verl")


class VerlRayBackend(VerlActorBackend):
    def start(self, total_steps: int) -> Serving:
        import httpx

        self.init_ray()
        self.trainer = self.make_trainer(total_steps)
        self.trainer.init_workers()  # ends with the replicas asleep
        self.trainer.checkpoint_manager.update_weights(0)  # wake them with the initial weights

        upstreams = [f"http://{address}/v1" for address in self.trainer.llm_server_manager.get_addresses()]
        models = httpx.get(f"{upstreams[0]}/models", timeout=60).json()["data"]
        served = models[0]["id"]
        tokenizer = self.trainer.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        logger.info("verl serves %s at %s", served, ", ".join(upstreams))
        return Serving(upstreams=upstreams, model=served, pad_token_id=int(pad or 0))

    def before_update(self) -> None:
        self.trainer.checkpoint_manager.sleep_replicas()  # GPU memory goes to training

    def sync_weights(self, step: int) -> Dict[str, float]:
        self.trainer.checkpoint_manager.update_weights(step)  # push the new weights and wake the replicas
        return {}


__all__ = ["VerlRayBackend"]
