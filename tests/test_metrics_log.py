"""The training console line and metrics.csv of agl.algorithm.metrics (no torch needed)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from agl.algorithm.metrics import MetricsLog, format_line


def test_a_step_whose_rollouts_all_failed_says_so_on_its_console_line() -> None:
    """It printed a lone "±0.000" where the reward goes."""
    line = format_line({"step": 1, "reward_mean": float("nan"), "reward_std": 0.0, "success_rate": 0.0}, 2)
    assert "reward - success 0%" in line and "±" not in line
    assert "reward 0.500 ±0.100 success 50%" in format_line(
        {"step": 2, "reward_mean": 0.5, "reward_std": 0.1, "success_rate": 0.5}, 2
    )


def test_metrics_csv_shows_counts_as_counts_and_rows_keep_full_values(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    row = {"step": 1.0, "samples": 4.0, "loss": 0.123456789012345, "grad_norm": 1e-12}
    log.log(row)
    log.close()
    (written,) = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert written == {"step": "1", "samples": "4", "loss": "0.12345679", "grad_norm": "1e-12"}
    assert log.rows == [row]


def test_warnings_still_reach_the_console_while_the_log_file_is_written(tmp_path: Path) -> None:
    """The log file's handler made Python's last-resort stderr handler stand down: during training every agl
    warning (no training step ran, rollouts failing) went to train.log only, unless the app configured logging."""
    script = (
        "import logging, sys\n"
        "from agl.algorithm.metrics import MetricsLog\n"
        f"log = MetricsLog({str(tmp_path)!r}, tensorboard=False)\n"
        "logging.getLogger('agl.train').warning('watch out')\n"
        "log.close()\n"
        "logging.getLogger('agl.train').warning('after close')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "watch out" in done.stderr and done.stderr.count("watch out") == 1
    assert "after close" in done.stderr  # the last-resort handler again
    assert "watch out" in (tmp_path / "train.log").read_text()

    configured = "import logging; logging.basicConfig(format='APP %(message)s')\n" + script
    done = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True, timeout=60)
    assert done.stderr.count("watch out") == 1 and "APP watch out" in done.stderr  # the app's own handler only


def test_metrics_csv_has_the_held_out_success_before_and_after_training(tmp_path: Path) -> None:
    """metrics.csv had no held-out column (only with eval_every): the before/after figures were in train.log only.
    The untrained policy's evaluations get a row of step 0; a resumed run's log gets them from its checkpoint."""
    log = MetricsLog(tmp_path, tensorboard=False, evaluations=[{"name": "val", "step": 0, "success": 0.06}])
    log.evaluated(0, "greedy", 0.56)
    for step in (1, 2):
        log.log({"step": step, "reward_mean": 0.5})
    log.evaluated(2, "val", 0.88)
    log.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["step"], r["val_success"], r["val_success_greedy"]) for r in rows] == [
        ("0", "0.06", "0.56"),
        ("1", "", ""),
        ("2", "0.88", ""),
    ]
    assert [row["step"] for row in log.rows] == [1, 2]  # the rows of the steps themselves stay the steps'


def test_train_log_marks_where_each_run_starts(tmp_path: Path) -> None:
    """train.log is appended to run after run, and nothing told where one ended and the next began."""
    for _ in range(2):
        MetricsLog(tmp_path, tensorboard=False).close()
    assert (tmp_path / "train.log").read_text().count("==== a run starts: ") == 2


def test_step_lines_count_to_the_steps_the_time_budget_fits() -> None:
    """The main job printed "step 3/40" when its budget fits about 11 steps."""
    row = {"step": 3, "reward_mean": 0.5}
    assert format_line(row, 40, 11).startswith("step 3/~11 [#####---------------] (time budget; at most 40) reward")
    assert format_line(row, 40, 40).startswith("step 3/40 [##--")  # the budget is not what ends it
    assert format_line(row, 40).startswith("step 3/40 [##--")


def test_progress_shows_as_plain_lines_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the output redirected to a file the main job showed no progress, only a warning a minute. A phase
    that ends at once (an export of two rollouts) prints nothing: its lines were noise before its one result."""
    from agl._util import progress
    from agl._util.progress import progress_bar

    with progress_bar("LightningRL batch", total=2) as advance:
        advance(1)
        advance(1)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "PLAIN_AFTER_S", 0.0)  # as if each item took a while
    with progress_bar("step 1: rollouts", total=16) as advance:
        for _ in range(16):
            advance(1)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"step 1: rollouts: {n}/16 done" for n in (4, 8, 12, 16)]
    with progress_bar("quiet", total=4, enabled=False) as advance:
        advance(4)
    assert capsys.readouterr().err == ""
