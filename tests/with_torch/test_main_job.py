"""The README's main job runs end to end (tiny random model, two steps): LangGraph agent, policy server,
SQLite store, LightningRL with agent_match on the graph's nodes, TorchGRPO, metrics files. The learning
itself is measured with SmolLM2 by the job (docs/training.md), not asserted here."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from example_jobs import job_module, load

from agl.testing.interrupts import default_sigint

JOB = Path(__file__).resolve().parents[2] / "examples" / "main_job"


@pytest.fixture
def job() -> Any:
    with job_module("main_job") as module:
        yield module


def test_reward_wants_the_exact_sentence_with_the_right_number() -> None:
    sys.path.insert(0, str(JOB))
    try:
        agent = load("main_job", "langgraph_math_agent")
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
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # step 0: the untrained policy's held-out success
    assert rows[0]["val_success"] != "" and rows[0]["val_success_greedy"] != "" and rows[0]["rollouts"] == ""
    assert rows[2]["val_success"] != "" and rows[2]["val_success_greedy"] != ""  # after training
    for row in rows[1:]:
        assert int(row["rollouts"]) == 16  # 4 tasks x 4 rollouts
        assert float(row["samples"]) == 2 * 16  # agent_match picks both LLM nodes (solve, answer) of each rollout
    assert (out / "reward_curve.png").stat().st_size > 1000
    log = (out / "train.log").read_text()
    assert "[val] held-out success" in log and "[greedy] held-out success" in log
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"


def test_main_job_that_cannot_train_in_its_budget_fails_and_says_what_to_do(
    job: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine the first evaluations used up the 10 minutes: the job trained nothing, evaluated the
    same weights again and exited 0 with "+0 points". Then it said so in a paragraph citing a figure of
    docs/training.md as the README's, and the command to run instead had to be put together by hand."""
    monkeypatch.chdir(tmp_path)  # the command is given with the script's absolute path from outside the clone
    out = tmp_path / "job"
    assert (
        job.main(["--model", "tiny", "--minutes", "0.01", "--heldout", "2", "--no-greedy-eval", "--out", str(out)]) == 1
    )
    told = capsys.readouterr()
    assert "after training" not in told.out
    # one line says why (the machine is too busy for the budget, with its figures), one what to run instead
    (why,) = [line for line in (out / "train.log").read_text().splitlines() if "no training step ran" in line]
    assert "this machine is too busy or too slow for the time budget" in why and "load average" in why
    command = f"python {JOB / 'train.py'} --model tiny --out {out} --minutes 20 --heldout 20 --no-greedy-eval --resume"
    assert told.err.splitlines()[-1] == (
        f"main job: nothing trained; rerun with more time and fewer held-out tasks: {command}"
    )
    assert "README" not in told.err  # it cited a figure of docs/training.md as the README's


def test_main_job_out_of_budget_skips_the_greedy_evaluation_and_writes_no_empty_metrics(
    job: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The budget was spent by the sampled evaluation, yet the greedy one ran too (4 more minutes on a busy
    machine) before the job said no step fits; metrics.csv was left as one blank line ("\\r\\n", no header)."""
    out = tmp_path / "job"
    assert job.main(["--model", "tiny", "--minutes", "0.01", "--heldout", "2", "--out", str(out)]) == 1
    log = (out / "train.log").read_text()
    assert "[val] held-out success" in log and "[greedy] held-out success" not in log
    assert "skipping the untrained policy's greedy evaluation" in log and "no training step ran" in log
    # no step: only the untrained policy's row (it was one blank line, no header, that CSV readers fail on)
    assert [(r["step"], r["val_success"] != "") for r in csv.DictReader((out / "metrics.csv").open())] == [("0", True)]
    assert "--resume" in capsys.readouterr().err.splitlines()[-1]  # a plain rerun is refused: the folder holds the run
    assert job.main(["--model", "tiny", "--minutes", "0.01", "--heldout", "2", "--out", str(out), "--resume"]) == 1


def test_main_job_never_replaces_a_run_in_its_out_folder(job: Any, tmp_path: Path) -> None:
    """A second run of the README command deleted the first (checkpoints and store) without a word."""
    out = tmp_path / "job"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-000005")
    with pytest.raises(SystemExit) as exc:
        job.main(["--model", "tiny", "--steps", "0", "--heldout", "1", "--no-greedy-eval", "--out", str(out)])
    assert "already holds a training run: pass --resume" in str(exc.value.code)
    assert (out / "checkpoints" / "latest").read_text() == "step-000005"


@pytest.mark.parametrize("minutes", ["nan", "inf", "0"])
def test_main_job_wants_a_finite_positive_budget(job: Any, tmp_path: Path, minutes: str) -> None:
    """--minutes nan was no budget at all (every comparison with NaN is false)."""
    with pytest.raises(SystemExit, match="--minutes must be a positive, finite number"):
        job.main(
            [
                "--model",
                "tiny",
                "--steps",
                "0",
                "--heldout",
                "1",
                "--no-greedy-eval",
                "--minutes",
                minutes,
                "--out",
                str(tmp_path / "job"),
            ]
        )
    assert not (tmp_path / "job").exists()


def test_ctrl_c_of_the_main_job_says_how_to_resume_and_loses_no_step(tmp_path: Path) -> None:
    """Ctrl-C printed a 30-line traceback, no word of --resume, and lost the steps since the last of every
    5th checkpoint."""
    out = tmp_path / "job"
    args = ["--model", "tiny", "--steps", "8", "--heldout", "2", "--no-greedy-eval", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, str(JOB / "train.py"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=default_sigint,  # its Ctrl-C interrupts even where this test run ignores SIGINT
    )
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("step 3/8"):
                break
        proc.send_signal(signal.SIGINT)
        err, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "answered 500: generation failed" not in err, err[-3000:]  # the requests in flight: one line at most
    assert err.count("requests of running agents unanswered") <= 1
    command = f"python {JOB / 'train.py'} {' '.join(args)} --resume"
    assert err.splitlines()[-1].endswith(f"continue it from its last checkpoint with: {command}")
    steps = [int(row["step"]) for row in csv.DictReader((out / "metrics.csv").open())]
    saved = int((out / "checkpoints" / "latest").read_text().removeprefix("step-"))
    # a checkpoint every step: step 2's was saved before step 3 began (step 3's may be cut short by Ctrl-C)
    assert steps[-1] >= 3 and saved >= steps[-1] - 1
