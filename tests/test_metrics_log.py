"""The training console line and metrics.csv of agl.algorithm.metrics (no torch needed)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

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
