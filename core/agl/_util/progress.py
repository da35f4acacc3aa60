"""Console output for long work: a progress bar and the dev results table (rich, to stderr/stdout)."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from agl.trainer import RolloutSummary


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``. Draws a bar on a terminal, nothing when disabled or not a TTY (CI logs)."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


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
