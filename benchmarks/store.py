"""Throughput of the store backends from one client thread: full rollout cycles/s and spans/s.

    python benchmarks/store.py [--rollouts 5000] [--spans 100000] [--repeat 3] [--prefill 0] [--no-postgres]

A rollout cycle is what one training rollout costs the store: enqueued in batches (``enqueue_many``),
claimed in batches (``dequeue_many``), a few spans added in one call, and ``complete_attempt``. Span
throughput adds spans in batches of 1000, as the tracer's background writer does. The SQLite figures
use a temporary file. PostgreSQL runs in a throwaway server on 127.0.0.1 (``TemporaryPostgres``, with
fsync on), once with its defaults (each commit waits for its WAL flush) and once with
``synchronous_commit=off``, which like SQLite's ``synchronous=NORMAL`` does not wait for the disk at
commit. ``--prefill N`` measures the cycles on stores already holding N finished rollouts, as a store some
way into a training run does. In-process backends run ``--repeat`` times, each on a new store, and the
median is shown (a shared VM's speed drifts between runs). Prints figures against the SQLite targets and
always exits 0: these are measurements, not assertions (machines differ).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Callable, Iterator, List, Tuple

from agl.store import EnqueueRequest, InMemoryLightningStore, LightningStore, SqliteLightningStore
from agl.types import Rollout, Span

CYCLES_TARGET = 5_000  # rollout cycles/s on SQLite
SPANS_TARGET = 50_000  # spans/s on SQLite
BATCH = 100  # rollouts per enqueue_many / dequeue_many
SPANS_PER_ROLLOUT = 4
SPAN_BATCH = 1000


def make_span(rollout: Rollout, i: int) -> Span:
    assert rollout.attempt is not None
    now = time.time_ns()
    return Span(
        rollout_id=rollout.rollout_id,
        attempt_id=rollout.attempt.attempt_id,
        sequence_id=i,
        trace_id="0" * 32,
        span_id=f"{i:016x}",
        parent_id=None if i == 0 else f"{0:016x}",
        name="openai.chat" if i else "agent",
        kind="llm" if i else "agent",
        start_time=now,
        end_time=now + 1000,
        status="ok",
        attributes={
            "gen_ai.request.model": "tiny",
            "gen_ai.usage.prompt_tokens": 42,
            "gen_ai.prompt.0.content": "What is 6 times 7? Answer with a number only.",
            "gen_ai.completion.0.content": "42",
        },
    )


def rollout_cycles(store: LightningStore, n: int) -> float:
    """Rollout cycles per second."""
    requests = [EnqueueRequest(input={"question": "6*7", "answer": 42}) for _ in range(BATCH)]
    start = time.perf_counter()
    for _ in range(n // BATCH):
        store.enqueue_many(requests)
        for rollout in store.dequeue_many("bench", BATCH):
            assert rollout.attempt is not None
            store.add_spans([make_span(rollout, i) for i in range(SPANS_PER_ROLLOUT)])
            store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
    return (n // BATCH) * BATCH / (time.perf_counter() - start)


def prefill(store: LightningStore, n: int) -> None:
    """Make ``store`` hold ``n`` finished rollouts (a store some way into a training run)."""
    requests = [EnqueueRequest(input={"question": "6*7", "answer": 42}) for _ in range(1000)]
    for _ in range(n // 1000):
        store.enqueue_many(requests)
        for rollout in store.dequeue_many("prefill", 1000):
            assert rollout.attempt is not None
            store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)


def span_throughput(store: LightningStore, n: int) -> float:
    """Spans per second, added in batches of SPAN_BATCH to one running attempt each."""
    store.enqueue_many([EnqueueRequest() for _ in range(n // SPAN_BATCH)])
    rollouts = store.dequeue_many("bench", n // SPAN_BATCH)
    batches: List[List[Span]] = [[make_span(r, i) for i in range(SPAN_BATCH)] for r in rollouts]
    start = time.perf_counter()
    for batch in batches:
        store.add_spans(batch)
    return len(batches) * SPAN_BATCH / (time.perf_counter() - start)


Backend = Tuple[str, Callable[[], LightningStore]]


@contextlib.contextmanager
def postgres_backends() -> Iterator[List[Backend]]:
    """The PostgreSQL rows: a throwaway server (each measurement in a new database), or none with a note why."""
    try:
        from agl.store.postgres.store import PostgresLightningStore
        from agl.testing.postgres import PostgresUnavailableError, TemporaryPostgres
    except ImportError as exc:
        print(f"(PostgreSQL skipped: {exc})")
        yield []
        return
    try:
        server = TemporaryPostgres(durable=True).start()
    except PostgresUnavailableError as exc:
        print(f"(PostgreSQL skipped: {exc})")
        yield []
        return
    async_commit = "?options=-csynchronous_commit%3Doff"
    try:
        yield [
            ("PostgreSQL", lambda: PostgresLightningStore(server.create_database())),
            ("PG async", lambda: PostgresLightningStore(server.create_database() + async_commit)),
        ]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=5_000)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--prefill", type=int, default=0, help="finished rollouts in each store before its cycles")
    parser.add_argument("--repeat", type=int, default=3, help="runs per in-process backend (the median is shown)")
    parser.add_argument("--no-postgres", action="store_true", help="skip the PostgreSQL rows")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        backends: List[Backend] = [
            ("InMemory", InMemoryLightningStore),
            ("SQLite", lambda: SqliteLightningStore(os.path.join(tmp, f"bench-{time.perf_counter_ns()}.db"))),
        ]
        if not args.no_postgres:
            backends += stack.enter_context(postgres_backends())
        print(f"{'backend':<10} {'rollout cycles/s':>18} {'spans/s':>12}   (median of runs: all runs)")
        for name, factory in backends:
            runs = 1 if name.startswith("P") else args.repeat  # PostgreSQL's runs take tens of seconds each
            cycles, spans = [], []
            for _ in range(runs):
                with factory() as store:
                    prefill(store, args.prefill)
                    cycles.append(rollout_cycles(store, args.rollouts))
                with factory() as store:
                    spans.append(span_throughput(store, args.spans))
            every = f"{', '.join(f'{c:,.0f}' for c in cycles)} / {', '.join(f'{s:,.0f}' for s in spans)}"
            print(f"{name:<10} {statistics.median(cycles):>18,.0f} {statistics.median(spans):>12,.0f}   ({every})")
        print(f"{'target':<10} {CYCLES_TARGET:>18,} {SPANS_TARGET:>12,}   (SQLite)")
        print(
            f"({BATCH} rollouts per batch, {SPANS_PER_ROLLOUT} spans per rollout, span batches of {SPAN_BATCH}; "
            f"each run on a new store holding {args.prefill:,} finished rollouts; {args.repeat} runs in process, "
            "1 for PostgreSQL; PG async: PostgreSQL with synchronous_commit=off)"
        )


if __name__ == "__main__":
    main()
