"""Agent Lightning 0.3.0's side of the side-by-side workloads (run.py runs it in the peer's own venv).

    python peer_side.py WORKLOAD --out results.json [--quick]

Only the peer's public API: ``AgentOpsTracer`` (its default tracer: AgentOps's OpenAI instrumentation plus the
peer's patch that records token ids and logprobs) inside ``trace_context(rollout_id=..., attempt_id=...)``,
``InMemoryLightningStore``, ``LightningStoreServer`` (its ``agentlightning.cli.store``) with
``LightningStoreClient``, ``LitAgentRunner.step``, ``Trainer.dev`` with ``Baseline``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
os.environ.setdefault("AGENTOPS_LOG_LEVEL", "ERROR")

import agentlightning as al
import common
import measure
import peer_store
from agentlightning.store import InMemoryLightningStore, LightningStore, LightningStoreClient

client = common.make_client()
plain = measure.original_create(client)  # taken before the tracer instruments: stays uninstrumented
loop = asyncio.new_event_loop()
run = loop.run_until_complete
RETURNED: List[float] = []  # when the agent function returned (workload 2)
LLM_SPAN = "openai.chat.completion"
TUNED_POLL = 0.05  # seconds: the tuned-down polling of workload 5


@contextlib.contextmanager
def served_store(tmp: str) -> Iterator[LightningStore]:
    """A LightningStoreClient of the peer's store server (in memory) in a process of its own."""
    port = common.free_port()
    argv = [sys.executable, "-m", "agentlightning.cli.store", "--host", "127.0.0.1", "--port", str(port)]
    with common.ServerProcess([*argv, "--log-level", "WARNING"], port, Path(tmp) / "server.log") as server:
        store = LightningStoreClient(server.url)
        try:
            yield store
        finally:
            run(store.close())


@contextlib.contextmanager
def placements(tmp: str) -> Iterator[List[Tuple[str, LightningStore]]]:
    """The two store placements of workloads 1 and 2: in this process (in memory), and over HTTP."""
    with served_store(tmp) as remote:
        yield [("in-process", InMemoryLightningStore(thread_safe=True)), ("HTTP", remote)]


def new_attempt(store: LightningStore) -> Tuple[str, str]:
    rollout = run(store.start_rollout(input={"q": "bench"}))
    return rollout.rollout_id, rollout.attempt.attempt_id


# -- workload 1 -------------------------------------------------------------------------------------------------
def tracer(results: common.Results, quick: bool) -> None:
    n, rounds = measure.TRACER_QUICK if quick else measure.TRACER_FULL
    tracer = al.AgentOpsTracer()
    tracer.init()

    async def in_context(ids: Tuple[str, str], calls: int) -> None:
        async with tracer.trace_context(rollout_id=ids[0], attempt_id=ids[1]):
            for _ in range(calls):
                common.call(client)

    def traced(ids: Tuple[str, str], calls: int) -> None:
        run(in_context(ids, calls))  # each span is stored as it ends: nothing is left to flush

    with tempfile.TemporaryDirectory() as tmp, placements(tmp) as stores:
        for variant, store in stores:
            tracer.init_worker(0, store)

            def check(ids: Tuple[str, str], calls: int, store: LightningStore = store) -> None:
                stored = sum(s.name == LLM_SPAN for s in run(store.query_spans(ids[0])))
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
    results.note(
        "peer: AgentOpsTracer; spans to InMemoryLightningStore(thread_safe=True) in-process (each written as it "
        "ends), or by OTLP to its store server over HTTP (its choice for a server)"
    )


# -- workload 2 -------------------------------------------------------------------------------------------------
@al.rollout
def one_call_agent(task: Dict[str, Any], llm: al.LLM) -> float:
    common.call(client)
    RETURNED.append(time.perf_counter())
    return 1.0


def rollout_end(results: common.Results, quick: bool) -> None:
    count = 5 if quick else 30
    runner = al.LitAgentRunner(tracer=al.AgentOpsTracer())
    runner.init(one_call_agent)
    with tempfile.TemporaryDirectory() as tmp, placements(tmp) as stores:
        for variant, store in stores:
            run(store.add_resources({"main_llm": al.LLM(endpoint="http://bench.invalid/v1", model=common.MODEL)}))
            runner.init_worker(0, store)
            for i in range(count + 2):  # the first two warm up
                done = run(runner.step({"q": "bench"}))
                ended = time.perf_counter()
                assert done.status == "succeeded", done.status
                if i >= 2:
                    results.add(measure.ROLLOUT_END, variant, [(ended - RETURNED[-1]) * 1e3])


# -- workload 5 -------------------------------------------------------------------------------------------------
@al.rollout
def server_agent(task: Dict[str, Any], llm: al.LLM) -> float:
    return common.served_reward(llm.get_base_url(), llm.model, task["q"])


def dev(results: common.Results, quick: bool) -> None:
    tasks = [{"q": f"question {i}"} for i in range(20)]
    tunings: List[Tuple[str, Dict[str, Any], Dict[str, Any]]] = [
        ("peer, default polling (5 s)", {}, {}),
        (
            f"peer, polling tuned to {TUNED_POLL} s",
            {"polling_interval": TUNED_POLL},
            {"poll_interval": TUNED_POLL, "interval_jitter": TUNED_POLL / 5},
        ),
    ]
    with common.FakeModelServer() as server:
        for runners in (1, 4):
            for variant, baseline, runner in tunings:
                trainer = al.Trainer(
                    n_runners=runners,
                    initial_resources={"main_llm": al.LLM(endpoint=server.base_url, model=common.MODEL)},
                    algorithm=al.Baseline(**baseline),
                    runner={"type": "agentlightning.LitAgentRunner", **runner},
                    port=common.free_port(),
                )
                start = time.perf_counter()
                trainer.dev(server_agent, train_dataset=tasks)
                results.add(measure.dev_measure(runners), variant, [time.perf_counter() - start])
                succeeded = run(trainer.store.query_rollouts(status_in=["succeeded"]))
                assert len(succeeded) == len(tasks), f"{len(succeeded)} of {len(tasks)} rollouts succeeded"
    results.note(
        f"peer: Trainer.dev with Baseline and LitAgentRunner, its client-server strategy; tuned: Baseline("
        f"polling_interval={TUNED_POLL}), LitAgentRunner(poll_interval={TUNED_POLL}, interval_jitter={TUNED_POLL / 5})"
    )


WORKLOADS: Dict[str, Callable[[common.Results, bool], None]] = {
    "tracer": tracer,
    "rollout_end": rollout_end,
    "store_calls": lambda results, quick: peer_store.store_calls(results, quick, real_span(), run),
    "store_http": lambda results, quick: peer_store.store_http(results, quick, real_span(), served_store),
    "dev": dev,
}


def real_span() -> al.Span:
    """The LLM span the peer's tracer stores for one call to the fake model (token ids, logprobs, 8 messages)."""
    tracer = al.AgentOpsTracer()
    tracer.init()
    store = InMemoryLightningStore(thread_safe=True)
    tracer.init_worker(0, store)
    ids = new_attempt(store)

    async def one() -> None:
        async with tracer.trace_context(rollout_id=ids[0], attempt_id=ids[1]):
            common.call(client)

    run(one())
    (span,) = [s for s in run(store.query_spans(ids[0])) if s.name == LLM_SPAN]
    tracer.teardown_worker(0)
    return span


def main() -> None:
    args = common.side_arguments()
    results = common.Results("peer", args.workload)
    WORKLOADS[args.workload](results, args.quick)
    results.write(args.out)


if __name__ == "__main__":
    main()
