"""benchmarks/verl_reward.py and verl_gpu_smoke.py, which CI does not run for their figures: two real steps
here, through the saved-tokenizer path a GPU machine takes, so an API change cannot break them unnoticed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # verl_gpu_smoke imports its neighbour verl_reward
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_two_reward_steps_from_a_saved_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    smoke, reward = load("verl_gpu_smoke"), load("verl_reward")
    assert smoke.main(["--save-tokenizer", str(tmp_path / "tokenizer")]) == 0
    assert reward.main(["--steps", "2", "--device", "cpu", "--tokenizer", str(tmp_path / "tokenizer")]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"] and all(len(row) == 7 for row in rows), out
    assert "trained token ids == served token ids" in out and "too few steps to judge" in out


def test_the_gpu_smoke_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the smoke would run, not refuse")
    assert load("verl_gpu_smoke").main(["--steps", "2"]) == 1
    assert "torch sees no GPU" in capsys.readouterr().err
