"""agl's side of workloads 3 (single store calls, and agl's bulk calls apart) and 4 (8 HTTP clients)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any, Callable, ContextManager, Iterator, List, Tuple

import common
import measure

from agl.store import EnqueueRequest, InMemoryLightningStore, LightningStore, SqliteLightningStore, open_store
from agl.types import Rollout, Span

BATCH = 100  # calls per sample


def copies(span: Span, rollouts: List[Rollout], per_rollout: int = 1) -> List[Span]:
    """``span`` again for each rollout (``per_rollout`` times), with the rollout's ids and new span ids."""
    out: List[Span] = []
    for rollout in rollouts:
        assert rollout.attempt is not None
        for i in range(per_rollout):
            update = {"rollout_id": rollout.rollout_id, "attempt_id": rollout.attempt.attempt_id}
            out.append(span.model_copy(update={**update, "span_id": f"{len(out):016x}", "sequence_id": i + 1}))
    return out


@contextlib.contextmanager
def postgres(results: common.Results) -> Iterator[List[Tuple[str, Callable[[], LightningStore]]]]:
    """PostgreSQL: ``$AGL_TEST_POSTGRES_DSN``'s server, else a throwaway one (fsync on); none, with the reason
    printed, when neither is there."""
    try:
        from agl.testing.postgres import DSN_ENV, ExistingPostgres, PostgresUnavailableError, TemporaryPostgres
    except ImportError as exc:
        results.note(f"agl PostgreSQL skipped: {exc} (install agl's postgres extra)")
        yield []
        return
    dsn = os.environ.get(DSN_ENV)
    try:
        server: Any = ExistingPostgres(dsn) if dsn else TemporaryPostgres(durable=True).start()
    except PostgresUnavailableError as exc:
        results.note(f"agl PostgreSQL skipped: {exc}")
        yield []
        return
    try:
        yield [("PostgreSQL", lambda: open_store(server.create_database()))]
    finally:
        if not dsn:
            server.stop()


def single_calls(results: common.Results, variant: str, store: LightningStore, span: Span, samples: int) -> None:
    """BATCH single calls of each kind per sample: enqueue, dequeue, add one span, complete."""
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(BATCH):
            store.enqueue_rollout(input={"q": "bench"})
        measure.add_per_call(results, "3 store: enqueue one rollout", variant, time.perf_counter() - start, BATCH)
        start = time.perf_counter()
        rollouts = [store.dequeue_rollout("bench") for _ in range(BATCH)]
        measure.add_per_call(results, "3 store: dequeue one rollout", variant, time.perf_counter() - start, BATCH)
        spans = copies(span, [r for r in rollouts if r is not None])
        assert len(spans) == BATCH, "a dequeue found nothing"
        start = time.perf_counter()
        for one in spans:
            store.add_spans([one])
        measure.add_per_call(results, "3 store: add one LLM span", variant, time.perf_counter() - start, BATCH)
        start = time.perf_counter()
        for rollout in rollouts:
            assert rollout is not None and rollout.attempt is not None
            store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
        measure.add_per_call(results, "3 store: complete one attempt", variant, time.perf_counter() - start, BATCH)


def bulk_calls(results: common.Results, variant: str, store: LightningStore, span: Span, samples: int) -> None:
    """agl's batched paths, BATCH items per call: enqueue_many, dequeue_many, add_spans (per item)."""
    requests = [EnqueueRequest(input={"q": "bench"}) for _ in range(BATCH)]
    for _ in range(samples):
        start = time.perf_counter()
        store.enqueue_many(requests)
        measure.add_per_call(
            results,
            f"{measure.BULK} enqueue_many, per rollout",
            variant,
            time.perf_counter() - start,
            BATCH,
            "rollouts/s",
        )
        start = time.perf_counter()
        rollouts = store.dequeue_many("bench", BATCH)
        measure.add_per_call(
            results,
            f"{measure.BULK} dequeue_many, per rollout",
            variant,
            time.perf_counter() - start,
            BATCH,
            "rollouts/s",
        )
        spans = copies(span, rollouts)
        start = time.perf_counter()
        store.add_spans(spans)
        measure.add_per_call(
            results, f"{measure.BULK} add_spans, per span", variant, time.perf_counter() - start, BATCH, "spans/s"
        )
        for rollout in rollouts:
            assert rollout.attempt is not None
            store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")


def agl_store_calls(results: common.Results, quick: bool, span: Span) -> None:
    samples = 2 if quick else 10
    results.note(f"agl's LLM span: {len(span.model_dump_json()):,} bytes as JSON")
    with tempfile.TemporaryDirectory() as tmp, postgres(results) as pg:
        backends: List[Tuple[str, Callable[[], LightningStore]]] = [
            ("in-memory", InMemoryLightningStore),
            ("SQLite file", lambda: SqliteLightningStore(f"{tmp}/calls-{time.perf_counter_ns()}.db")),
            *pg,
        ]
        for variant, factory in backends:
            with factory() as store:
                single_calls(common.Results("agl", "warm-up"), variant, store, span, 1)
                single_calls(results, variant, store, span, samples)
            with factory() as store:
                bulk_calls(common.Results("agl", "warm-up"), variant, store, span, 1)
                bulk_calls(results, variant, store, span, samples)


def agl_store_http(
    results: common.Results, quick: bool, span: Span, served: Callable[[str], ContextManager[LightningStore]]
) -> None:
    per_client, reps = (5, 1) if quick else (25, 3)
    with tempfile.TemporaryDirectory() as tmp, served(tmp) as remote:
        url = remote.url

        def cycles(bulk: bool) -> Callable[[], Callable[[], bool]]:
            def make_cycle() -> Callable[[], bool]:
                store = open_store(url)

                def cycle() -> bool:
                    store.enqueue_rollout(input={"q": "bench"})
                    rollout = store.dequeue_rollout("bench")
                    assert rollout is not None and rollout.attempt is not None
                    spans = copies(span, [rollout], measure.STORE_HTTP_SPANS)
                    for batch in [spans] if bulk else [[one] for one in spans]:
                        store.add_spans(batch)
                    done = store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
                    return done.status == "succeeded"

                return cycle

            return make_cycle

        measure.concurrent_cycles(results, measure.STORE_HTTP, cycles(bulk=False), per_client, reps)
        measure.concurrent_cycles(results, measure.STORE_HTTP_BULK, cycles(bulk=True), per_client, reps)
    results.note("agl: `agl store serve` over a SQLite file; clients: RemoteLightningStore, one per process")
