"""The README's main job runs end to end (tiny random model, two steps): LangGraph agent, policy server,
SQLite store, LightningRL with agent_match on the graph's nodes, TorchGRPO, metrics files. The learning
itself is measured with SmolLM2 by the job (docs/training.md), not asserted here."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from typing import Any

import agl
import pytest

JOB = Path(__file__).resolve().parents[2] / "examples" / "main_job"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"main_job_{name}", JOB / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def job() -> Any:
    sys.path.insert(0, str(JOB))
    try:
        yield _load("train")
    finally:
        sys.path.remove(str(JOB))
        agl.uninstrument()


def test_reward_wants_the_exact_sentence_with_the_right_number() -> None:
    sys.path.insert(0, str(JOB))
    try:
        agent = _load("langgraph_math_agent")
    finally:
        sys.path.remove(str(JOB))
    assert agent.reward(" The answer is 52.\n", 52) == 1.0
    assert agent.reward("The answer is 52", 52) == 0.0  # right number, not the sentence: no partial credit
    assert agent.reward("The final answer is 52.", 52) == 0.0
    assert agent.reward("The answer is 152.", 52) == 0.0 and agent.reward("The answer is -52.", 52) == 0.0
    assert agent.calculate("Sure: 58 - 6 = 50") == (52, "58 - 6 = 52")  # the tool recomputes, exactly
    assert agent.calculate("fifty-eight minus six") == (None, "no expression found")


def test_main_job_runs_end_to_end_with_the_tiny_model(job: Any, tmp_path: Path) -> None:
    out = tmp_path / "job"
    assert job.main(["--model", "tiny", "--steps", "2", "--heldout", "3", "--out", str(out)]) == 0

    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        assert int(row["rollouts"]) == 16  # 4 tasks x 4 rollouts
        assert float(row["samples"]) == 2 * 16  # agent_match picks both LLM nodes (solve, answer) of each rollout
    assert (out / "reward_curve.png").stat().st_size > 1000
    log = (out / "train.log").read_text()
    assert "[val] held-out success" in log and "[greedy] held-out success" in log
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"


def test_main_job_that_cannot_train_in_its_budget_fails_and_says_what_to_do(
    job: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a busy machine the first evaluations used up the 10 minutes: the job trained nothing, evaluated the
    same weights again and exited 0 with "+0 points"."""
    out = tmp_path / "job"
    assert job.main(["--model", "tiny", "--minutes", "0.01", "--heldout", "2", "--no-greedy-eval", "--out", str(out)]) == 1
    told = capsys.readouterr()
    assert "no training step ran" in told.err and "--minutes" in told.err
    assert "after training" not in told.out
