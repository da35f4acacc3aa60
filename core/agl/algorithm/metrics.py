"""Training metrics: one row per step to the console, a CSV file, TensorBoard (when installed) and a log file;
a PNG reward curve at the end.

Rows are plain dicts of numbers, so any trainer can log through :class:`MetricsLog`; columns appear in the
CSV in first-seen order (a column first seen late is added and the file rewritten, so the CSV always has
one header that covers every row). Held-out evaluations add their success to the CSV row of their step
(``val_success``, ``val_success_<name>`` for the other evaluation settings), the untrained policy's in a row
of step 0 of its own.

The loss of an on-policy GRPO step is about 0 by construction (the ratio is 1 and the advantages of a group sum
to 0), so the console line shows what moves when the policy learns instead: the reward and success, the
share of clipped tokens, the KL between the sampling and the updated policy, and the gradient norm.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger("agl.train")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Columns the console line shows, with their format, in this order (others go to CSV/TensorBoard only).
_CONSOLE = (
    ("reward_mean", "reward {:.3f}"),
    ("reward_std", "±{:.3f}"),
    ("success_rate", "success {:.0%}"),
    ("failed_rollouts", "failed {:.0f}"),  # only when some failed (they count as reward 0 in reward_mean)
    ("val_success", "val {:.0%}"),
    ("grad_norm", "grad {:.3f}"),  # not the loss: on-policy it is ~0 whatever the policy learns (module doc)
    ("clip_frac", "clip {:.1%}"),
    ("kl_old", "kl_old {:.1e}"),
    ("kl_ref", "kl {:.4f}"),
    ("gen_tokens_per_s", "gen {:.0f} tok/s"),
    ("train_tokens_per_s", "train {:.0f} tok/s"),
    ("step_time_s", "{:.0f}s"),
    ("llm_calls_per_rollout", "calls/rollout {:.1f}"),  # agl.algorithm.tool_calls
    ("tool_call_validity", "tool calls ok {:.0%}"),  # only when the model tried tool calls
)


class MetricsLog:
    """Writes metric rows under ``directory`` (``metrics.csv``, ``train.log``, ``tensorboard/``).

    ``rows`` keeps every row in memory for the curve and for resuming (a resumed run passes the rows of the
    checkpoint back in, and its ``evaluations``: rows with ``name``, ``step`` and ``success``).
    """

    def __init__(
        self,
        directory: Path,
        *,
        rows: Optional[List[Dict[str, float]]] = None,
        evaluations: Sequence[Mapping[str, Any]] = (),
        tensorboard: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.directory / "metrics.csv"
        self.log_path = self.directory / "train.log"
        self.png_path = self.directory / "reward_curve.png"
        self.rows: List[Dict[str, float]] = list(rows or [])
        self._held_out: Dict[int, Dict[str, float]] = {}  # step: the held-out columns of its evaluations
        for evaluation in evaluations:
            self._held_out.setdefault(int(evaluation["step"]), {})[_held_out_column(evaluation.get("name", "val"))] = (
                evaluation["success"]
            )
        self._columns: List[str] = []
        for row in self._csv_rows():
            self._add_columns(row)
        self._rewrite_csv()
        # The log file gets every metrics line and note, plus agl's own warnings (failed rollouts, ...).
        self._log_handler = logging.FileHandler(self.log_path, encoding="utf-8")
        self._log_handler.setLevel(logging.WARNING)
        self._log_handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        self._console_handler = _console_warnings()
        logging.getLogger("agl").addHandler(self._log_handler)
        self._tb = _tensorboard_writer(self.directory / "tensorboard") if tensorboard else None
        # train.log is appended to run after run (a resumed one continues it): each run starts with this line
        self.note(f"==== a run starts: {time.strftime('%Y-%m-%d %H:%M:%S')}, process {os.getpid()} ====")

    def log(
        self, row: Dict[str, float], *, total_steps: Optional[int] = None, steps_that_fit: Optional[int] = None
    ) -> str:
        """Record one step's row; returns (and logs) its console line (``steps_that_fit``: see format_line)."""
        self.rows.append(dict(row))
        if self._add_columns(row) or int(row.get("step", -1)) in self._held_out:
            self._rewrite_csv()
        else:
            with self.csv_path.open("a", newline="", encoding="utf-8") as f:
                csv.DictWriter(f, fieldnames=self._columns).writerow(_cells(row))
        if self._tb is not None:
            step = int(row.get("step", len(self.rows)))
            for key, value in row.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        line = format_line(row, total_steps, steps_that_fit)
        self.note(line)
        return line

    def evaluated(self, step: int, name: str, success: float) -> None:
        """A held-out evaluation's success, as a column of the CSV row of its ``step`` (step 0: a row of its
        own; ``name``: the evaluation setting, "val" for the main one)."""
        self._held_out.setdefault(int(step), {})[_held_out_column(name)] = success
        for row in self._csv_rows():
            self._add_columns(row)
        self._rewrite_csv()

    def note(self, message: str) -> None:
        """A free-form line (evaluations, checkpoints) for the log file (and the ``agl.train`` logger)."""
        logger.info(message)
        record = logging.LogRecord("agl.train", logging.INFO, __file__, 0, message, None, None)
        self._log_handler.emit(record)  # emit skips the handler's WARNING level: these lines always go in

    def close(self) -> None:
        logging.getLogger("agl").removeHandler(self._log_handler)
        self._log_handler.close()
        if self._console_handler is not None:
            logging.getLogger("agl").removeHandler(self._console_handler)
        if self._tb is not None:
            self._tb.close()

    def _add_columns(self, row: Dict[str, Any]) -> bool:
        new = [k for k in row if k not in self._columns]
        self._columns.extend(new)
        return bool(new)

    def _rewrite_csv(self) -> None:
        """The CSV of ``rows``. With no row yet there is no column to write a header of: no file then (an
        earlier run's in this folder is removed, as its rows are no longer this run's), rather than one holding
        a blank line that CSV readers fail on."""
        if not self._columns:
            self.csv_path.unlink(missing_ok=True)
            return
        with self.csv_path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(_cells(row) for row in self._csv_rows())

    def _csv_rows(self) -> List[Dict[str, Any]]:
        """The step rows with their step's held-out columns; an evaluation at a step with no row (step 0, before
        training) gets a row of its own, in step order."""
        steps = {int(row.get("step", -1)) for row in self.rows}
        alone = [{"step": step, **cells} for step, cells in sorted(self._held_out.items()) if step not in steps]
        merged = [{**row, **self._held_out.get(int(row.get("step", -1)), {})} for row in self.rows]
        return sorted(alone + merged, key=lambda row: row.get("step", 0))


def _held_out_column(name: str) -> str:
    """The CSV column of an evaluation's success: ``val_success``, ``val_success_greedy`` for ``extra_evals``'."""
    return "val_success" if name == "val" else f"val_success_{name}"


def _cells(row: Dict[str, Any]) -> Dict[str, Any]:
    """A row as metrics.csv shows it: whole numbers without ".0" (counts: ``samples 4``), other floats to 8
    significant digits (not 17); the rows themselves (``on_step``, tensorboard, checkpoints) keep full values."""
    out: Dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, float) and math.isfinite(value):
            value = int(value) if value.is_integer() else float(f"{value:.8g}")
        out[key] = value
    return out


def format_line(row: Dict[str, float], total_steps: Optional[int] = None, steps_that_fit: Optional[int] = None) -> str:
    """``step 3/12 [######------] reward 0.412 ±0.31 success 38% ...``; with a time budget that ends first,
    ``steps_that_fit`` (its estimate of the run's last step) replaces ``total_steps``: ``step 3/~11 (of 40)``."""
    step = int(row.get("step", 0))
    head = f"step {step}"
    if steps_that_fit is not None and total_steps and steps_that_fit < total_steps:
        done = min(20, round(20 * step / max(1, steps_that_fit)))
        head = f"step {step}/~{steps_that_fit} [{'#' * done}{'-' * (20 - done)}] (time budget; at most {total_steps})"
    elif total_steps:
        done = min(20, round(20 * step / total_steps))
        head = f"step {step}/{total_steps} [{'#' * done}{'-' * (20 - done)}]"
    parts = [head]
    no_reward = not _finite(row.get("reward_mean"))  # no rollout of the step has a reward (all failed)
    no_update = bool(row.get("samples")) and row.get("optimizer_steps") == 0  # every group agreed: none learned
    for key, fmt in _CONSOLE:
        value = row.get(key)
        if key == "grad_norm" and no_update:
            parts.append("no update")
        elif key == "reward_mean" and no_reward:
            parts.append("reward -")
        elif key == "failed_rollouts" and not value:
            continue
        elif _finite(value) and not (key == "reward_std" and no_reward):  # (no lone "±0.000")
            parts.append(fmt.format(value))
    return " ".join(parts)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _tensorboard_writer(path: Path) -> Any:
    """A SummaryWriter when the ``tensorboard`` package is installed, else None (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


def plot_reward_curve(
    rows: Sequence[Dict[str, float]],
    path: Path,
    *,
    evaluations: Sequence[Dict[str, Any]] = (),
    title: str = "agl GRPO training",
) -> Optional[Path]:
    """Save the training reward/success per step and the validation success as a PNG; None without
    matplotlib (logged, not raised: the CSV has the same numbers)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no reward curve PNG (pip install 'agl[torch]')")
        return None
    steps = [r["step"] for r in rows if "reward_mean" in r]
    learning = [key for key, _ in _LEARNING if any(_finite(r.get(key)) and r[key] > 0 for r in rows)]
    fig, axes = plt.subplots(2 if learning else 1, 1, figsize=(7, 6.5 if learning else 4), sharex=True, squeeze=False)
    ax = axes[0][0]
    plotted: List[float] = []
    if steps:
        rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
        success = [r.get("success_rate", float("nan")) for r in rows if "reward_mean" in r]
        # with 0/1 rewards the two coincide: the success line is drawn wide underneath, the reward on top of it
        ax.plot(steps, success, linewidth=5, alpha=0.35, label="train success")
        ax.plot(steps, rewards, marker=".", label="train reward (mean)")
        plotted += rewards + success
    names = list(dict.fromkeys(e.get("name", "val") for e in evaluations))
    for name in names:
        points = [e for e in evaluations if e.get("name", "val") == name]
        label = "held-out success" if name == "val" else f"held-out success ({name})"
        ax.plot([e["step"] for e in points], [e["success"] for e in points], marker="o", linestyle="--", label=label)
        plotted += [e["success"] for e in points]
    ax.set_ylim(*curve_y_limits(plotted))
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    if learning:
        _plot_learning(axes[1][0], rows, learning)
    axes[-1][0].set_xlabel("training step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


#: what shows an update at work, plotted under the rewards (the loss is ~0 on-policy: see the module doc)
_LEARNING = (("grad_norm", "grad norm"), ("clip_frac", "clipped tokens (share)"), ("kl_old", "KL(sampling || updated)"))


def _plot_learning(ax: Any, rows: Sequence[Dict[str, float]], keys: Sequence[str]) -> None:
    """The update's own gauges per step, on a log scale (they span orders of magnitude); a step with no update
    has none of them."""
    labels = dict(_LEARNING)
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if _finite(r.get(key)) and r[key] > 0]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=labels[key])
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")


def curve_y_limits(values: Sequence[float]) -> Tuple[float, float]:
    """The reward curve's y range: [0, 1] (success rates, 0/1 rewards) widened to every finite value plotted,
    so rewards outside it (counts, penalties, rewards in [-1, 1]) stay on the chart; 2% margin each side."""
    finite = [float(v) for v in values if _finite(v)]
    low, high = min([0.0, *finite]), max([1.0, *finite])
    margin = 0.02 * (high - low)
    return low - margin, high + margin


def ascii_curve(values: Sequence[float], *, width: int = 40, height: int = 8, label: str = "") -> str:
    """A small text plot of ``values`` in [0, 1] for the console (each column one step, resampled)."""
    if not values:
        return f"{label}: (no data)"
    n = len(values)
    cols = [values[min(n - 1, int(i * n / width))] for i in range(min(width, n))] if n > width else list(values)
    lines = []
    for level in range(height, 0, -1):
        threshold = (level - 0.5) / height
        lines.append(f"{level / height:4.2f} |" + "".join("#" if v >= threshold else " " for v in cols))
    lines.append("     +" + "-" * len(cols))
    return (f"{label}\n" if label else "") + "\n".join(lines)


def _console_warnings() -> Optional[logging.Handler]:
    """A stderr handler for agl's warnings while the log file's handler is attached, unless the application
    configured logging itself: Python prints a warning nobody handles to stderr (its last-resort handler),
    but not once any handler exists, so the file's handler alone would hide every warning from the console."""
    agl_logger = logging.getLogger("agl")
    if agl_logger.hasHandlers():
        return None
    handler = logging.StreamHandler()  # sys.stderr, as the last-resort handler
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    agl_logger.addHandler(handler)
    return handler


def console(text: str) -> None:
    """Print a trainer's message (a step's line, an evaluation, the summary) to stderr as it is: no markup,
    no highlighting, long lines not wrapped."""
    from rich.console import Console

    Console(stderr=True, highlight=False).print(text, markup=False, soft_wrap=True)
