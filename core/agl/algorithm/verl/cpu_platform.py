"""A CPU platform for verl 0.9, so that verl's own actor workers train on a machine without a GPU.

verl ships platforms for NVIDIA, Ascend and ROCm only; without an accelerator it falls back to NVIDIA and
its worker fails at ``torch.cuda.set_device``. This module registers a ``cpu`` platform (device ``cpu``,
collective backend ``gloo``, Ray resource ``GPU`` so that verl's placement groups still work: the driver
declares as many "GPUs" as workers), makes verl's process-group setup use plain ``gloo`` and pinning memory
a no-op (the reference model's CPU offload pins).

It is loaded in every process that imports verl through ``VERL_USE_EXTERNAL_MODULES`` and selected with
``VERL_PLATFORM=cpu`` (see :data:`CPU_ENV`); :mod:`agl.algorithm.verl.agl_rollout` sets both for its Ray
workers. Importing it changes nothing for a process that does not select the platform.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

logger = logging.getLogger("agl.verl")

NAME = "cpu"

#: What a process needs in its environment, before it imports verl, to run verl's workers on CPU.
#: ``VERL_ENGINE_DEVICE=cuda`` picks verl's FSDP engine, which verl registers for cuda and npu only; on
#: this platform its tensors still go to the device the platform names (``cpu``).
CPU_ENV: Dict[str, str] = {
    "VERL_PLATFORM": NAME,
    "VERL_USE_EXTERNAL_MODULES": __name__,
    "VERL_ENGINE_DEVICE": "cuda",
}


class _CPUDevice(ModuleType):
    """What verl calls on its device module (``torch.cuda`` on NVIDIA), answered for the CPU."""

    def __init__(self) -> None:
        super().__init__("agl_verl_cpu_device")

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def get_device_name(self, *args: Any, **kwargs: Any) -> str:
        return "cpu"

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_rng_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    def mem_get_info(self, *args: Any, **kwargs: Any) -> Tuple[int, int]:
        import psutil  # a dependency of Ray, which verl needs

        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Everything else (synchronize, empty_cache, memory counters...) has no meaning on the CPU: a no-op
        answering 0, which is what verl's memory logs then show."""
        if name.startswith("__"):
            raise AttributeError(name)
        logger.debug("verl asked the CPU device for %s: a no-op", name)
        return lambda *args, **kwargs: 0


_DEVICE = _CPUDevice()


class CPUPlatform(PlatformBase):
    """verl's platform contract for the CPU (verl/plugin/platform/platform_base.py)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> Tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # verl's placement groups ask for GPUs; the driver declares fake ones on a CPU machine

    def ray_noset_envvars(self) -> List[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _use_plain_gloo() -> None:
    """verl asks torch for the backend ``"cpu:gloo,<device>:<collective>"``, which on this platform reads
    ``"cpu:gloo,cpu:gloo"`` and torch refuses (duplicate device type): make its default plain ``gloo``."""
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_agl_gloo", False):
        return

    def initialize_global_process_group_ray(
        timeout_second: Optional[float] = None, backend: Optional[str] = None
    ) -> Any:
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._agl_gloo = True  # type: ignore[attr-defined]  # marks the patch as applied
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    workers: Any = sys.modules.get("verl.workers.engine_workers")  # imported the name before this ran
    if workers is not None:
        workers.initialize_global_process_group_ray = initialize_global_process_group_ray


def _pinning_is_a_no_op() -> None:
    """verl builds its reference model (forward only) with FSDP2's ``CPUOffloadPolicy(pin_memory=True)``, and
    pinning raises without an accelerator. Pinned memory only speeds up copies to a device, which this
    platform never makes: a tensor stays as it is."""
    if torch.accelerator.is_available() or getattr(torch.Tensor.pin_memory, "_agl_cpu", False):
        return

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    pin_memory._agl_cpu = True  # type: ignore[attr-defined]  # marks the patch as applied
    torch.Tensor.pin_memory = pin_memory  # see the docstring


PlatformRegistry.register(platform=NAME)(CPUPlatform)
if os.environ.get("VERL_PLATFORM", "").strip().lower() == NAME:
    _use_plain_gloo()
    _pinning_is_a_no_op()
