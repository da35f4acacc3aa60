"""Starting the local Ray cluster verl's workers run in, so that a broken start fails with its cause.

Ray starts worker processes on demand and, when they crash at start, retries without end: the caller of
``ray.get`` waits forever. agl therefore checks that a worker starts before verl places its workers, and
says why not from Ray's own log. The one cause seen in practice is handled before it happens: Ray's
workers refuse a temp folder inside the active virtualenv, and nox and tox point ``TMPDIR`` there.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional

from agl.algorithm.verl.config import VERLConfigError

#: How long the first worker process may take to start (seconds); a loaded machine takes a few.
WORKER_START_TIMEOUT_S = 180.0


def start_ray(ray_init: Dict[str, Any], runtime_env: Dict[str, Any], timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
    """``ray.init(runtime_env=runtime_env, **ray_init)`` with a temp folder Ray's workers accept, then a check
    that a worker process starts within ``timeout_s``."""
    import ray

    temp_dir = temp_dir_outside_virtualenv(ray_init)
    if temp_dir is not None:
        ray_init = {**ray_init, "_temp_dir": temp_dir}
    ray.init(runtime_env=runtime_env, **ray_init)
    check_a_worker_starts(timeout_s)


def temp_dir_outside_virtualenv(
    ray_init: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None
) -> Optional[str]:
    """A temp folder for Ray when its default lies inside ``$VIRTUAL_ENV`` (which its workers refuse);
    ``None`` when the default is fine or the user chose one (``_temp_dir`` or ``RAY_TMPDIR``)."""
    environ = os.environ if environ is None else environ
    venv = environ.get("VIRTUAL_ENV")
    if not venv or ray_init.get("_temp_dir") or environ.get("RAY_TMPDIR"):
        return None
    default = environ.get("TMPDIR") if sys.platform.startswith("linux") else None
    if default is None or not _inside(default, venv):
        return None
    for candidate in ("/tmp", tempfile.gettempdir()):
        if os.path.isdir(candidate) and os.access(candidate, os.W_OK) and not _inside(candidate, venv):
            return os.path.join(candidate, "ray")
    raise VERLConfigError(
        f"Ray's temp folder would be inside the virtualenv {venv} (TMPDIR={default}), which Ray's workers refuse: "
        "set ray_kwargs.ray_init._temp_dir or RAY_TMPDIR to a folder outside it"
    )


def check_a_worker_starts(timeout_s: float) -> None:
    """Run one empty task; if no worker process starts within ``timeout_s``, raise with Ray's reason."""
    import ray
    from ray.exceptions import GetTimeoutError

    @ray.remote(num_cpus=0)
    def _alive() -> int:
        return os.getpid()

    task = _alive.remote()
    try:
        ray.get(task, timeout=timeout_s)
    except GetTimeoutError:
        ray.cancel(task, force=True)
        reason = last_worker_error(_logs_dir())
        raise VERLConfigError(
            f"Ray started no worker process within {timeout_s:.0f} s"
            + (f"; Ray's log says: {reason}" if reason else "")
            + " (see the raylet logs in Ray's session folder)"
        ) from None


def last_worker_error(logs_dir: Optional[str]) -> Optional[str]:
    """The last error line a crashed worker left in Ray's raylet/worker ``.err`` logs, if any."""
    if not logs_dir:
        return None
    errors: List[str] = []
    for path in sorted(glob.glob(os.path.join(logs_dir, "*.err")), key=os.path.getmtime):
        try:
            lines = pathlib.Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        errors += [line.strip() for line in lines if line[:1].strip() and "error" in line.split(":")[0].lower()]
    return errors[-1] if errors else None


def _logs_dir() -> Optional[str]:
    try:
        import ray

        return str(ray._private.worker._global_node.get_logs_dir_path())  # Ray has no public accessor
    except Exception:  # noqa: BLE001 - only for a better message
        return None


def _inside(path: str, folder: str) -> bool:
    return pathlib.Path(path).resolve().is_relative_to(pathlib.Path(folder).resolve())


__all__ = [
    "WORKER_START_TIMEOUT_S",
    "check_a_worker_starts",
    "last_worker_error",
    "start_ray",
    "temp_dir_outside_virtualenv",
]
