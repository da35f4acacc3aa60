"""The multi-turn job runs end to end (tiny random model, two steps): an OpenAI Agents SDK agent whose tool
results go back into its next LLM call, the policy server's tool calls, LightningRL with every call of a
rollout a sample, TorchGRPO with LLM calls per rollout and tool-call validity per step. Whether it learns is
measured with SmolLM2 by the job (docs/training.md), not asserted here."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest
from example_jobs import job_module

import agl
from agl.algorithm.tool_calls import ToolCallStats

JOB = Path(__file__).resolve().parents[2] / "examples" / "multi_turn"


@pytest.fixture
def job() -> Any:
    with job_module("multi_turn") as module:
        yield module


def test_reward_wants_the_right_number_from_the_last_tool_or_the_structured_answer(job: Any) -> None:
    agent = sys.modules["calculator_agent"]
    assert agent.reward(63, 63) == 1.0  # the second tool result ends the run as its answer
    assert agent.reward(agent.Answer(answer=63), 63) == 1.0  # answered without (enough) tools
    assert agent.reward(agent.Answer(answer=64), 63) == 0.0 and agent.reward(64, 63) == 0.0
    assert agent.reward("63", 63) == 0.0 and agent.reward(True, 1) == 0.0  # a number, not text or a bool


def test_multi_turn_job_runs_end_to_end_with_the_tiny_model(
    job: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "job"
    assert job.main(["--model", "tiny", "--steps", "2", "--heldout", "3", "--no-greedy-eval", "--out", str(out)]) == 0

    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert int(row["rollouts"]) == 16 and row["failed_rollouts"] == "0"  # a cut or looping answer is reward 0
        calls = float(row["llm_calls_per_rollout"])
        assert 1 <= calls <= 2  # the run ends at its second tool result
        assert float(row["samples"]) == round(calls * 16)  # every LLM call of every rollout is a sample
    with agl.open_store(str(out / "store.db")) as store:
        spans = [store.query_spans(r.rollout_id) for r in store.query_rollouts()]
    # The tool results went back to the model: rollouts with a tool call and a later LLM call that read it. The
    # grammar keeps the tiny model's calls well formed, so every tool call it tried ran.
    assert any(
        sum(s.kind == "llm" for s in attempt) >= 2 and any(s.kind == "tool" for s in attempt) for attempt in spans
    )
    assert ToolCallStats.of(spans).validity == 1.0
    told = capsys.readouterr().out
    assert "held-out success: " in told and "tool-call validity: " in told
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"
