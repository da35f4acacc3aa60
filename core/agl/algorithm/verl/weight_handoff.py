"""How verl's actor hands its weights to agl's policy server: a verl ``CheckpointEngine`` that writes them.

verl's ``ActorRolloutRefWorker.update_weights`` gives a checkpoint engine the actor's full parameters, one
tensor at a time under their Hugging Face names (FSDP shards gathered). This engine, registered in verl as
:data:`BACKEND`, writes them on rank 0 to ``<folder>/step-<n>.safetensors``; the driver then loads that file
into the served model (:meth:`agl.serving.server.PolicyServer.load_weights`) and deletes it. Every rank reads
the whole generator, because gathering a shard is a collective.

verl imports this module in its workers (``rollout.checkpoint_engine.custom_backend_module``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterable, Optional, Tuple

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "agl_file"


def handoff_path(folder: str, step: int) -> str:
    """Where the weights after ``step`` updates are written."""
    return os.path.join(folder, f"step-{step:06d}.safetensors")


@CheckpointEngineRegistry.register(BACKEND)
class SafetensorsHandoff(CheckpointEngine):
    """Writes the actor's weights for a server on the same machine (``engine_kwargs.agl_file.folder``)."""

    def __init__(self, bucket_size: int, is_master: bool = False, folder: str = "") -> None:
        if not folder:
            raise ValueError(
                f"the {BACKEND} checkpoint engine needs actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs."
                f"{BACKEND}.folder (agl sets it)"
            )
        self.is_master = is_master
        self.folder = folder

    def prepare(self) -> Dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, *args: Any, **kwargs: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(
        self, weights: Iterable[Tuple[str, Any]], global_steps: Optional[int] = None
    ) -> Dict[str, float]:
        from safetensors.torch import save_file

        started = time.monotonic()
        tensors = {}
        for name, tensor in weights:  # every rank: full_tensor() inside the generator is a collective
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.is_master:
                tensors[name] = tensor.detach().to("cpu").clone()  # own storage: safetensors refuses shared
        if not self.is_master:
            return {}
        os.makedirs(self.folder, exist_ok=True)
        path = handoff_path(self.folder, int(global_steps or 0))
        save_file(tensors, path + ".part")
        os.replace(path + ".part", path)  # the driver never reads a half-written file
        return {"agl/weight_sync/write_s": time.monotonic() - started, "agl/weight_sync/tensors": float(len(tensors))}

    async def receive_weights(self, global_steps: Optional[int] = None) -> None:
        raise NotImplementedError("agl's policy server loads the written file itself")
