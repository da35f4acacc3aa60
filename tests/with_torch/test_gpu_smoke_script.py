"""benchmarks/torch_gpu_smoke.py is what checks the CUDA path on a GPU machine, which CI never has: run it
here on the CPU (``--allow-cpu``) so an API change cannot break it unnoticed until the next GPU session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_gpu_smoke.py"


def _load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports its neighbour serve_throughput
    try:
        spec = importlib.util.spec_from_file_location("torch_gpu_smoke", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_gpu_smoke_runs_its_checks_on_the_cpu(tmp_path: Path, capsys) -> None:
    smoke = _load_script()
    assert smoke.main(["--model", "tiny", "--steps", "2", "--allow-cpu", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "16 concurrent" in out and "GPU smoke: passed" in out
    assert (tmp_path / "run" / "metrics.csv").read_text().count("\n") == 3  # header + 2 steps


def test_without_a_gpu_it_refuses_unless_told(tmp_path: Path, capsys) -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the smoke would run, not refuse")
    smoke = _load_script()
    assert smoke.main(["--model", "tiny", "--out", str(tmp_path / "run")]) == 1
    assert "no CUDA GPU here" in capsys.readouterr().out
