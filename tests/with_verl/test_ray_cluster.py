"""The local Ray cluster starts, or says why not, instead of waiting forever on workers that crash at start.

Real Ray clusters. nox (like tox) points ``TMPDIR`` into the session's virtualenv, and Ray's workers refuse a
temp folder there: each one crashes at start, and ``ray.init`` itself never returns (CI hung there).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import ray

from agl.algorithm.verl.config import VERLConfigError
from agl.algorithm.verl.ray_cluster import start_ray, temp_dir_outside_virtualenv


@pytest.fixture
def venv_with_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A virtualenv folder with ``TMPDIR`` inside it, as nox sets them (short: Ray's socket paths have a limit)."""
    venv = Path(tempfile.mkdtemp(prefix="v", dir="/tmp"))
    (venv / "tmp").mkdir()
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    monkeypatch.setenv("TMPDIR", str(venv / "tmp"))
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    yield venv
    ray.shutdown()
    shutil.rmtree(venv, ignore_errors=True)


def test_a_temp_folder_inside_the_virtualenv_is_moved_out_unless_the_user_chose_one(tmp_path: Path) -> None:
    venv = str(tmp_path / "venv")
    inside = {"VIRTUAL_ENV": venv, "TMPDIR": f"{venv}/tmp"}
    assert temp_dir_outside_virtualenv({}, inside) == "/tmp/ray"
    assert temp_dir_outside_virtualenv({"_temp_dir": "/data/ray"}, inside) is None
    assert temp_dir_outside_virtualenv({}, {**inside, "RAY_TMPDIR": "/data"}) is None
    assert temp_dir_outside_virtualenv({}, {"VIRTUAL_ENV": venv, "TMPDIR": "/scratch"}) is None
    assert temp_dir_outside_virtualenv({}, {"TMPDIR": f"{venv}/tmp"}) is None


def test_workers_crashing_at_start_fail_with_rays_reason_instead_of_hanging() -> None:
    # a runtime env that breaks the workers' Python: each one dies at start, and Ray would retry without end
    broken = {"env_vars": {"PYTHONHOME": "/nonexistent"}}
    try:
        with pytest.raises(VERLConfigError, match="no worker process within 20 s; Ray's log says: .*encodings"):
            start_ray({"num_cpus": 1, "include_dashboard": False}, broken, timeout_s=20)
    finally:
        ray.shutdown()


def test_start_ray_in_such_a_virtualenv_starts_workers(venv_with_tmpdir: Path) -> None:
    start_ray({"num_cpus": 1, "include_dashboard": False}, {}, timeout_s=60)

    @ray.remote(num_cpus=0)
    def where() -> str:
        return os.environ.get("VIRTUAL_ENV", "")

    assert ray.get(where.remote(), timeout=60) == str(venv_with_tmpdir)
