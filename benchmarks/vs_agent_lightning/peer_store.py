"""Agent Lightning's side of workloads 3 (single store calls on InMemoryLightningStore, its only embedded store,
and its bulk methods apart) and 4 (8 clients of its store server)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any, Awaitable, Callable, ContextManager, List

import common
import measure
from agentlightning.store import InMemoryLightningStore, LightningStore, LightningStoreClient
from agentlightning.types import EnqueueRolloutRequest, Span

BATCH = 100  # calls per sample
VARIANT = "in-memory"


def copies(span: Span, rollouts: List[Any], per_rollout: int = 1) -> List[Span]:
    """``span`` again for each rollout (``per_rollout`` times), with the rollout's ids and new span ids."""
    out: List[Span] = []
    for rollout in rollouts:
        for i in range(per_rollout):
            update = {"rollout_id": rollout.rollout_id, "attempt_id": rollout.attempt.attempt_id}
            out.append(span.model_copy(update={**update, "span_id": f"{len(out):016x}", "sequence_id": i + 1}))
    return out


async def single_calls(results: common.Results, store: LightningStore, span: Span, samples: int) -> None:
    """BATCH single calls of each kind per sample: enqueue, dequeue, add one span, complete (update_attempt)."""
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(BATCH):
            await store.enqueue_rollout(input={"q": "bench"})
        measure.add_per_call(results, "3 store: enqueue one rollout", VARIANT, time.perf_counter() - start, BATCH)
        start = time.perf_counter()
        rollouts = [await store.dequeue_rollout(worker_id="bench") for _ in range(BATCH)]
        measure.add_per_call(results, "3 store: dequeue one rollout", VARIANT, time.perf_counter() - start, BATCH)
        spans = copies(span, [r for r in rollouts if r is not None])
        assert len(spans) == BATCH, "a dequeue found nothing"
        start = time.perf_counter()
        for one in spans:
            await store.add_span(one)
        measure.add_per_call(results, "3 store: add one LLM span", VARIANT, time.perf_counter() - start, BATCH)
        start = time.perf_counter()
        for rollout in rollouts:
            await store.update_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status="succeeded")
        measure.add_per_call(results, "3 store: complete one attempt", VARIANT, time.perf_counter() - start, BATCH)


async def bulk_calls(results: common.Results, store: LightningStore, span: Span, samples: int) -> None:
    """The peer's batched methods, BATCH items per call: enqueue_many_rollouts, dequeue_many_rollouts,
    add_many_spans (per item)."""
    requests = [EnqueueRolloutRequest(input={"q": "bench"}) for _ in range(BATCH)]
    for _ in range(samples):
        start = time.perf_counter()
        await store.enqueue_many_rollouts(requests)
        seconds = time.perf_counter() - start
        measure.add_per_call(
            results, f"{measure.BULK} enqueue_many, per rollout", VARIANT, seconds, BATCH, "rollouts/s"
        )
        start = time.perf_counter()
        rollouts = await store.dequeue_many_rollouts(limit=BATCH, worker_id="bench")
        seconds = time.perf_counter() - start
        measure.add_per_call(
            results, f"{measure.BULK} dequeue_many, per rollout", VARIANT, seconds, BATCH, "rollouts/s"
        )
        spans = copies(span, list(rollouts))
        start = time.perf_counter()
        await store.add_many_spans(spans)
        seconds = time.perf_counter() - start
        measure.add_per_call(results, f"{measure.BULK} add_spans, per span", VARIANT, seconds, BATCH, "spans/s")
        for rollout in rollouts:
            await store.update_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status="succeeded")


def store_calls(results: common.Results, quick: bool, span: Span, run: Callable[[Awaitable[Any]], Any]) -> None:
    samples = 2 if quick else 10
    results.note(f"peer's LLM span: {len(span.model_dump_json()):,} bytes as JSON")
    store = InMemoryLightningStore()
    run(single_calls(common.Results("peer", "warm-up"), store, span, 1))
    run(single_calls(results, store, span, samples))
    store = InMemoryLightningStore()
    run(bulk_calls(common.Results("peer", "warm-up"), store, span, 1))
    run(bulk_calls(results, store, span, samples))
    results.note("peer: InMemoryLightningStore() as Trainer makes it in one process (thread_safe=False)")


def store_http(results: common.Results, quick: bool, span: Span, served: Callable[[str], ContextManager[Any]]) -> None:
    per_client, reps = (5, 1) if quick else (25, 3)
    with tempfile.TemporaryDirectory() as tmp, served(tmp) as remote:
        url = remote.server_address_root

        def make_cycle() -> Callable[[], bool]:
            loop = asyncio.new_event_loop()
            store = LightningStoreClient(url)

            async def cycle() -> bool:
                await store.enqueue_rollout(input={"q": "bench"})
                rollout = await store.dequeue_rollout(worker_id="bench")
                assert rollout is not None
                for one in copies(span, [rollout], measure.STORE_HTTP_SPANS):
                    await store.add_span(one)
                attempt = await store.update_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status="succeeded")
                return attempt.status == "succeeded"  # the rollouts' own status is counted at the end

            return lambda: loop.run_until_complete(cycle())

        measure.concurrent_cycles(results, measure.STORE_HTTP, make_cycle, per_client, reps)
        succeeded = asyncio.run(remote.query_rollouts(status_in=["succeeded"]))
        expected = reps * measure.STORE_HTTP_CLIENTS * (per_client + 1)  # + each client's first, untimed cycle
        assert len(succeeded) == expected, f"{len(succeeded)} of {expected} rollouts succeeded"
    results.note("peer: its store server (agentlightning.cli.store, in memory); clients: LightningStoreClient")
