"""agl's side of the side-by-side workloads (run.py runs it with agl's venv; see run.py for what each one does).

    python agl_side.py WORKLOAD --out results.json [--quick]

Only agl's public API: ``agl.instrument``, ``agl.rollout_scope``, ``agl.get_tracer``, the stores
(``open_store``, ``SqliteLightningStore``, ``InMemoryLightningStore``, ``agl store serve``), ``agl.Runner`` and
``agl.Trainer``. The PostgreSQL server comes from agl.testing (``$AGL_TEST_POSTGRES_DSN`` or a throwaway one).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import agl_store
import common
import measure

import agl
from agl.store import InMemoryLightningStore, LightningStore, open_store

client = common.make_client()
plain = measure.original_create(client)  # taken before agl.instrument(): stays uninstrumented
RETURNED: List[float] = []  # when the agent function returned (workload 2)


@contextlib.contextmanager
def served_store(tmp: str) -> Iterator[LightningStore]:
    """A client of ``agl store serve`` over a new SQLite file, the server in a process of its own."""
    port = common.free_port()
    argv = [sys.executable, "-m", "agl.cli", "store", "serve", "--store", f"{tmp}/served.db"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--insecure-no-auth"]
    with common.ServerProcess(argv, port, Path(tmp) / "server.log") as server:
        store = open_store(server.url)
        try:
            yield store
        finally:
            store.close()


@contextlib.contextmanager
def placements(tmp: str) -> Iterator[List[Tuple[str, LightningStore]]]:
    """The two store placements of workloads 1 and 2: in this process (in memory), and over HTTP."""
    with served_store(tmp) as remote:
        yield [("in-process", InMemoryLightningStore()), ("HTTP", remote)]


def new_attempt(store: LightningStore) -> Tuple[str, str]:
    store.enqueue_rollout(input={"q": "bench"})
    rollout = store.dequeue_rollout("bench")
    assert rollout is not None and rollout.attempt is not None
    return rollout.rollout_id, rollout.attempt.attempt_id


# -- workload 1 -------------------------------------------------------------------------------------------------
def tracer(results: common.Results, quick: bool) -> None:
    n, rounds = measure.TRACER_QUICK if quick else measure.TRACER_FULL
    agl.instrument()
    tracer = agl.get_tracer()

    def traced(ids: Tuple[str, str], calls: int) -> None:
        with agl.rollout_scope(*ids):
            for _ in range(calls):
                common.call(client)
        assert tracer.flush(60), "the tracer's flush timed out"

    with tempfile.TemporaryDirectory() as tmp, placements(tmp) as stores:
        for variant, store in stores:
            tracer.set_store(store)

            def check(ids: Tuple[str, str], calls: int, store: LightningStore = store) -> None:
                stored = sum(s.kind == "llm" for s in store.query_spans(ids[0]))
                assert stored == calls, f"{stored} LLM spans stored of {calls}"

            traced(new_attempt(store), 10)  # warm up
            measure.paired_blocks(
                results, variant, rounds, n, plain, functools.partial(new_attempt, store), traced, check
            )
        measure.paired_blocks(
            results,
            "outside a rollout",
            rounds,
            n,
            plain,
            lambda: None,
            lambda _, k: common.calls(client, k),
            lambda *_: None,
        )
    results.note("agl: spans to an InMemoryLightningStore (in-process) or to `agl store serve` over SQLite (HTTP)")


# -- workload 2 -------------------------------------------------------------------------------------------------
@agl.rollout
def one_call_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    common.call(client)
    RETURNED.append(time.perf_counter())
    return 1.0


def rollout_end(results: common.Results, quick: bool) -> None:
    count = 5 if quick else 30
    agl.instrument()
    with tempfile.TemporaryDirectory() as tmp, placements(tmp) as stores:
        for variant, store in stores:
            store.add_resources({"main_llm": agl.LLM(endpoint="http://bench.invalid/v1", model=common.MODEL)})
            runner = agl.Runner(one_call_agent, store)
            for i in range(count + 2):  # the first two warm up
                store.enqueue_rollout(input={"q": "bench"})
                rollout = store.dequeue_rollout(runner.runner_id)
                assert rollout is not None
                done = runner.run_rollout(rollout)
                ended = time.perf_counter()
                assert done.status == "succeeded", done.status
                if i >= 2:
                    results.add(measure.ROLLOUT_END, variant, [(ended - RETURNED[-1]) * 1e3])
            runner.close()


# -- workload 5 -------------------------------------------------------------------------------------------------
@agl.rollout
def server_agent(task: Dict[str, Any], llm: agl.LLM) -> float:
    return common.served_reward(llm.get_base_url(), llm.model, task["q"])


def dev(results: common.Results, quick: bool) -> None:
    agl.instrument()
    tasks = [{"q": f"question {i}"} for i in range(20)]
    with common.FakeModelServer() as server, tempfile.TemporaryDirectory() as tmp:
        for runners in (1, 4):
            trainer = agl.Trainer(
                n_runners=runners,
                store=f"{tmp}/dev-{runners}.db",
                initial_resources={"main_llm": agl.LLM(endpoint=server.base_url, model=common.MODEL)},
                progress=False,
            )
            start = time.perf_counter()
            rows = trainer.dev(server_agent, tasks, print_table=False)
            elapsed = time.perf_counter() - start
            ok = sum(r.status == "succeeded" for r in rows)
            assert ok == len(tasks), f"{ok} of {len(tasks)} rollouts succeeded"
            results.add(measure.dev_measure(runners), "agl, no polling", [elapsed])
    results.note("agl: Trainer.dev on a SQLite file; runners wait in the store's dequeue (no polling)")


WORKLOADS: Dict[str, Callable[[common.Results, bool], None]] = {
    "tracer": tracer,
    "rollout_end": rollout_end,
    "store_calls": lambda results, quick: agl_store.agl_store_calls(results, quick, real_span()),
    "store_http": lambda results, quick: agl_store.agl_store_http(results, quick, real_span(), served_store),
    "dev": dev,
}


def real_span() -> agl.Span:
    """The span agl's tracer stores for one call to the fake model (token ids, logprobs, 8 messages)."""
    agl.instrument()
    store = InMemoryLightningStore()
    agl.get_tracer().set_store(store)
    ids = new_attempt(store)
    with agl.rollout_scope(*ids):
        common.call(client)
    agl.get_tracer().flush(60)
    agl.get_tracer().set_store(None)
    (span,) = [s for s in store.query_spans(ids[0]) if s.kind == "llm"]
    agl.uninstrument()
    return span


def main() -> None:
    args = common.side_arguments()
    results = common.Results("agl", args.workload)
    WORKLOADS[args.workload](results, args.quick)
    results.write(args.out)


if __name__ == "__main__":
    main()
