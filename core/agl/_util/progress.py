"""Console output for long work: a progress bar and the dev results table (rich, to stderr/stdout)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from agl.trainer import RolloutSummary


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``. Draws a bar on a terminal; with stderr redirected (a file, CI logs), where a bar
    cannot redraw, a plain line at each quarter of ``total`` (:func:`plain_progress`); nothing when disabled."""
    if not enabled:
        yield lambda n: None
        return
    if not sys.stderr.isatty():
        yield plain_progress(description, total)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


#: a phase that has run less than this prints no plain line (an export of a few rollouts takes no time)
PLAIN_AFTER_S = 5.0


def plain_progress(description: str, total: int) -> Callable[[int], None]:
    """``advance(n)`` that prints ``DESCRIPTION: 8/16 done (12 s)`` to stderr each time another quarter of
    ``total`` is done (every item when there are fewer than four) once the phase has run
    :data:`PLAIN_AFTER_S`, so a redirected log shows a slow phase move and a quick one stays quiet."""
    every = max(1, math.ceil(total / 4))
    started = time.monotonic()
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        before, done = done, done + n
        if time.monotonic() - started < PLAIN_AFTER_S:
            return
        if done // every > before // every or (done >= total > before):
            print(
                f"{description}: {done}/{total} done ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True
            )

    return advance


NO_LLM_CALLS = (
    "No rollout recorded an LLM call, so there is nothing to train on. agl records the calls an agent makes "
    "through the openai client (which every supported framework uses) and the frameworks' own steps; an agent "
    "that reaches its model another way (plain HTTP, another SDK) can send OpenTelemetry GenAI spans to the "
    "store server's /v1/traces (docs/store-server.md, OTLP). In a thread of its own (threading.Thread), a "
    "call needs agl.propagate (README)."
)


def print_rollout_table(rows: Sequence[RolloutSummary]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="agl dev: rollouts")
    for column in ("task", "status", "reward", "llm calls", "spans", "rollout"):
        table.add_column(column)
    for row in rows:
        reward = "-" if row.reward is None else f"{row.reward:g}"
        status = row.status if row.status == "succeeded" else f"[red]{row.status}[/red]"
        table.add_row(row.task_id, status, reward, str(row.llm_calls), str(row.spans), row.rollout_id)
    console = Console(width=max(100, Console().width))
    console.print(table)
    for row in rows:
        if row.error:
            console.print(f"[red]{row.task_id}[/red] {row.rollout_id}: {row.error}")
    if any(row.status == "succeeded" for row in rows) and not any(row.llm_calls for row in rows):
        console.print(NO_LLM_CALLS)
