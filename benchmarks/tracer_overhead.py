"""What the OpenAI instrumentation costs the agent: per call, and at the end of a rollout.

    python benchmarks/tracer_overhead.py [--calls 100] [--rounds 30]

The real ``openai`` client talks to an in-process transport (``MockTransport``, no network) that returns
a canned chat completion with vLLM token ids, so the client's own work is the whole baseline. Spans go to
a real store: SQLite on a temp file when ``agl.store.SqliteLightningStore`` exists, else an in-memory
list (the output says which). Every span is checked to be in the store.

1. Hot path: agl's own CPU time per call on the calling thread. The instrumentation wrapper runs around a
   ``create`` that returns a parsed completion at once, so nothing but agl's code (span start and end,
   request and response reading, the hand-off to the writer) is timed.
2. End to end: rounds alternate ``--calls`` real client calls uninstrumented and ``--calls`` instrumented
   inside a rollout (a fresh one per round), which of the two goes first alternating too; the figure is
   the median of the paired per-round differences of wall time per call, the end-of-round ``flush()``
   included (every span stored), and the middle half of those differences shows how noisy the machine
   was. Also printed: the flush's own share (the last, partial batch of the round, which the writer had
   not yet taken) and the calling thread's CPU time alone (agl's code in a real call, the client's work on
   the fields agl adds to the request). Two transports:
   - ``--latency`` ms (default 2) per answer, as a model server's answer takes time (the wait releases
     the GIL, as a socket read does): what an agent sees. The writer works during the waits.
   - 0 ms, a CPU-bound loop: the worst case for a GIL-bound language, where the writer's work (encoding
     and storing every span) is charged to the agent too. CPython starves a background thread while
     another thread runs Python without blocking (the openai client's brief GIL releases, e.g. uuid4's
     os.urandom, keep resetting the waiter's switch request), so here the writer works mostly in the
     flush. Also given as calling-thread CPU time (the loop alone).
   Both include the garbage collections the instrumentation causes; the count is printed.
3. End-of-rollout flush: last call returned -> ``flush()`` returned, after a 2,000-call rollout on each
   transport (the writer having worked during the rollout, as it does).
   The same again with OTLP export on (``agl.instrument(otlp_endpoint=...)``) to a real receiver on
   127.0.0.1: the hand-off to the exporter's queue is all it adds here; its thread encodes and sends.
4. Writer throughput: 2,000 spans queued with no store attached, then one flush: the writer's full cost
   per span (encoding, SQLite insert), a worst case no real rollout hits.

Prints figures against the targets (<= 50 us per call, <= 50 ms per 2,000-span flush); exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import openai
import wrapt

from agl.instrumentation import openai_client
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.testing.otlp_receiver import OtlpReceiver
from agl.tracing.context import RolloutScope, enter_scope, exit_scope
from agl.tracing.tracer import get_tracer

try:
    import httpx2 as httpx_module  # what openai >= 3 uses
except ImportError:  # pragma: no cover - openai 1.x/2.x
    import httpx as httpx_module  # type: ignore[no-redef]

CALL_TARGET_US = 50.0
FLUSH_TARGET_MS = 50.0
FLUSH_SPANS = 2_000
HOT_CALLS = 1_000
LATENCY_S = 0.002
PROMPT_TOKENS = 600
RESPONSE_TOKENS = 200

MESSAGES = [{"role": "system", "content": "You are a careful assistant that uses tools."}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "some words " * 20} for i in range(7)
]


def canned_completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": "bench-model",
            "prompt_token_ids": list(range(100_000, 100_000 + PROMPT_TOKENS)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "word " * (RESPONSE_TOKENS // 2)},
                    "finish_reason": "stop",
                    "logprobs": None,
                    "token_ids": list(range(100_000, 100_000 + RESPONSE_TOKENS)),
                }
            ],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": RESPONSE_TOKENS, "total_tokens": 800},
        }
    ).encode()


def make_client(latency: float = 0.0) -> openai.OpenAI:
    body = canned_completion()
    headers = {"content-type": "application/json"}

    def handler(request: Any) -> Any:
        if latency:
            time.sleep(latency)
        return httpx_module.Response(200, content=body, headers=headers)

    http_client = httpx_module.Client(transport=httpx_module.MockTransport(handler))
    return openai.OpenAI(base_url="http://bench.invalid/v1", api_key="x", max_retries=0, http_client=http_client)


class ListSink:
    def __init__(self) -> None:
        self.spans: List[Any] = []

    def add_spans(self, spans: List[Any]) -> int:
        self.spans.extend(spans)
        return len(spans)


class Store:
    """The span sink under test, and where each rollout comes from."""

    def __init__(self, tmp: str) -> None:
        try:
            from agl.store import SqliteLightningStore
        except ImportError:
            self.sqlite: Any = None
            self.sink: Any = ListSink()
            self.label = "in-memory list (agl.store.SqliteLightningStore is not importable)"
        else:
            self.sqlite = SqliteLightningStore(os.path.join(tmp, "bench.db"))
            self.sink = self.sqlite
            self.label = "SqliteLightningStore on a temp file"
        self._rollouts = 0

    def new_rollout(self) -> Tuple[str, str]:
        if self.sqlite is None:
            self._rollouts += 1
            return f"ro-{self._rollouts}", "at-1"
        self.sqlite.enqueue_rollout(input=None)
        rollout = self.sqlite.dequeue_rollout("bench")
        return rollout.rollout_id, rollout.attempt.attempt_id

    def count(self, rollout_id: str) -> int:
        if self.sqlite is None:
            return sum(1 for s in self.sink.spans if s.rollout_id == rollout_id)
        return len(self.sqlite.query_spans(rollout_id))


def calls(client: openai.OpenAI, n: int) -> Tuple[float, float]:
    """(wall, calling-thread CPU) seconds for n calls."""
    create = client.chat.completions.create
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        create(model="bench-model", messages=MESSAGES, temperature=0.7)
    return time.perf_counter() - wall, time.thread_time() - cpu


def hot_path(store: Store, instrumentor: OpenAIInstrumentor, n: int, rounds: int) -> Tuple[float, int]:
    """Calling-thread CPU microseconds per call spent in agl's wrapper around an instant ``create``.

    Returns the median over ``rounds`` rollouts of ``n`` calls, and how many spans were stored.
    """
    completion = make_client().chat.completions.create(model="bench-model", messages=MESSAGES)

    def create(**kwargs: Any) -> Any:
        return completion

    traced = wrapt.FunctionWrapper(create, openai_client._sync_wrapper(openai_client.CHAT, instrumentor))

    def run(fn: Callable[..., Any]) -> Tuple[float, float]:
        cpu = time.thread_time()
        for _ in range(n):
            fn(model="bench-model", messages=MESSAGES, temperature=0.7)
        return 0.0, time.thread_time() - cpu

    per_call: List[float] = []
    stored = 0
    for _ in range(rounds):
        (_, plain), _ = in_rollout(store, lambda: run(create))
        (_, instrumented), rollout_id = in_rollout(store, lambda: run(traced))
        per_call.append((instrumented - plain) / n * 1e6)
        get_tracer().flush(120)
        stored += store.count(rollout_id)
    return statistics.median(per_call), stored


def hot_path_with_otlp(store: Store, instrumentor: OpenAIInstrumentor, rounds: int) -> Tuple[float, int]:
    """:func:`hot_path` with the tracer also exporting to a real OTLP receiver on 127.0.0.1 (agl.testing's);
    returns its figure and how many spans the receiver decoded."""
    tracer = get_tracer()
    with OtlpReceiver(keep=False) as receiver:
        tracer.set_otlp(receiver.url)
        try:
            us, _ = hot_path(store, instrumentor, HOT_CALLS, rounds)
            assert tracer.otlp is not None and tracer.otlp.flush(120)
        finally:
            tracer.set_otlp(None)
        return us, receiver.received


def in_rollout(store: Store, fn: Callable[[], Tuple[float, float]]) -> Tuple[Tuple[float, float], str]:
    rollout_id, attempt_id = store.new_rollout()
    return scoped(rollout_id, attempt_id, fn), rollout_id


def scoped(rollout_id: str, attempt_id: str, fn: Callable[[], Tuple[float, float]]) -> Tuple[float, float]:
    """``fn()`` inside the rollout scope of an existing rollout."""
    token = enter_scope(RolloutScope(rollout_id, attempt_id))
    try:
        return fn()
    finally:
        exit_scope(token)


def timed_flush() -> float:
    start = time.perf_counter()
    assert get_tracer().flush(120), "flush timed out"
    return (time.perf_counter() - start) * 1e3


class GcCounter:
    """Counts the garbage collections that run while it is active (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.active = False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Dict[str, int]) -> None:
        if self.active and phase == "start":
            self.collections[info["generation"]] += 1


def end_to_end(
    store: Store, client: openai.OpenAI, instrumentor: OpenAIInstrumentor, n: int, rounds: int, gcs: GcCounter
) -> Dict[str, Any]:
    """Paired rounds of n plain and n instrumented calls: median overhead per call (wall and CPU), and the
    quartiles of the wall overhead. The order within a pair alternates, so that a drift in the machine's
    speed (frequent on a shared VM) adds to as many pairs as it takes from."""
    wall_diff: List[float] = []
    cpu_diff: List[float] = []
    flush_share: List[float] = []
    plain_wall: List[float] = []
    stored = 0
    for i in range(rounds):
        if i % 2 == 0:
            plain = calls(client, n)
        rollout_id, attempt_id = store.new_rollout()  # outside the timing: the trainer's work, not the tracer's
        instrumentor.instrument()
        gcs.active = True
        start = time.perf_counter()
        traced = scoped(rollout_id, attempt_id, lambda: calls(client, n))
        flushing = time.perf_counter()
        get_tracer().flush(120)  # the writer's work belongs to the overhead, also what it left for the flush
        end = time.perf_counter()
        traced = (end - start, traced[1])
        flush_share.append((end - flushing) / n * 1e6)
        gcs.active = False
        instrumentor.uninstrument()
        if i % 2 == 1:
            plain = calls(client, n)
        plain_wall.append(plain[0] / n * 1e6)
        wall_diff.append((traced[0] - plain[0]) / n * 1e6)
        cpu_diff.append((traced[1] - plain[1]) / n * 1e6)
        stored += store.count(rollout_id)
    return {
        "base": statistics.median(plain_wall),
        "wall": statistics.median(wall_diff),
        "wall_quartiles": statistics.quantiles(wall_diff, n=4)[::2],
        "cpu": statistics.median(cpu_diff),
        "flush": statistics.median(flush_share),
        "stored": stored,
    }


def rollout_then_flush(store: Store, client: openai.OpenAI) -> Tuple[float, str]:
    """A FLUSH_SPANS-call rollout, then the time its ``flush()`` takes."""
    _, rollout_id = in_rollout(store, lambda: calls(client, FLUSH_SPANS))
    return timed_flush(), rollout_id


def measure_writer(
    writer: str,
    store: Store,
    fast: openai.OpenAI,
    slow: openai.OpenAI,
    instrumentor: OpenAIInstrumentor,
    args: argparse.Namespace,
) -> Dict[str, Any]:
    """Every writer-dependent figure for one span writer (``thread`` or ``process``)."""
    tracer = get_tracer()
    tracer.set_writer(writer)
    gcs = GcCounter()
    latent = end_to_end(store, slow, instrumentor, args.calls, args.rounds, gcs)
    cpu_bound = end_to_end(store, fast, instrumentor, args.calls, args.rounds, gcs)
    collections = [c / (2 * args.calls * args.rounds) * 1000 for c in gcs.collections]
    stored = latent["stored"] + cpu_bound["stored"]
    expected = 2 * args.calls * args.rounds

    instrumentor.instrument()
    flushes = {}
    for label, client in (("latent", slow), ("cpu", fast)):
        flushes[label], rollout_id = rollout_then_flush(store, client)
        stored += store.count(rollout_id)
        expected += FLUSH_SPANS
    tracer.set_store(None)  # every span of this rollout waits in the queue
    _, rollout_id = in_rollout(store, lambda: calls(fast, FLUSH_SPANS))
    tracer.set_store(store.sink)
    queued_flush_ms = timed_flush()
    stored += store.count(rollout_id)
    expected += FLUSH_SPANS
    instrumentor.uninstrument()
    return {
        "latent": latent,
        "cpu": cpu_bound,
        "collections": collections,
        "flushes": flushes,
        "queued_flush_ms": queued_flush_ms,
        "stored": stored,
        "expected": expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round and mode")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--latency", type=float, default=LATENCY_S * 1e3, help="model latency in ms")
    parser.add_argument("--writers", default="thread,process", help="agl span writers to measure, comma-separated")
    args = parser.parse_args()
    writers = [w.strip() for w in args.writers.split(",") if w.strip()]

    fast, slow = make_client(), make_client(args.latency / 1e3)
    tracer = get_tracer()
    instrumentor = OpenAIInstrumentor()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)
        tracer.set_store(store.sink)
        calls(fast, 200)  # warm up the client, pydantic and the store
        instrumentor.instrument()
        in_rollout(store, lambda: calls(fast, 200))
        tracer.flush(120)
        instrumentor.uninstrument()

        instrumentor.instrument()  # the wrapper passes calls through untraced while agl is not instrumenting
        hot_us, hot_stored = hot_path(store, instrumentor, HOT_CALLS, args.rounds)
        otlp_us, otlp_received = hot_path_with_otlp(store, instrumentor, args.rounds)
        instrumentor.uninstrument()
        results = {w: measure_writer(w, store, fast, slow, instrumentor, args) for w in writers}
        tracer.set_writer("thread")

    stats = tracer.stats()
    print(f"store: {store.label}")
    print(
        f"canned reply: {PROMPT_TOKENS} prompt + {RESPONSE_TOKENS} response token ids; {len(MESSAGES)} input messages; "
        f"{args.rounds} rounds x {args.calls} calls per mode (medians of paired rounds)"
    )
    print()
    per_call = f"<= {CALL_TARGET_US:.0f}"
    per_flush = f"<= {FLUSH_TARGET_MS:.0f}"
    latency = f"{args.latency:g} ms model latency"

    def quartiles(result: Dict[str, Any]) -> str:
        low, high = result["wall_quartiles"]
        return f"{low:.0f} to {high:.0f}"

    def ratio(result: Dict[str, Any]) -> str:
        return f"{(result['base'] + result['wall']) / result['base']:.3f}x"

    def per_writer(
        label: str,
        value: Callable[[Dict[str, Any]], str],
        target: str = "",
        ok: Optional[Callable[[Dict[str, Any]], bool]] = None,
    ) -> Tuple[str, List[str], str, List[Any]]:
        return (
            label,
            [value(results[w]) for w in writers],
            target,
            [None if ok is None else ok(results[w]) for w in writers],
        )

    def overhead_rows(key: str, base: str, overhead: str) -> List[Tuple[str, List[str], str, List[Any]]]:
        """The rows of one workload (``latent``: calls that wait on the model; ``cpu``: calls that do not)."""
        return [
            per_writer(f"uninstrumented call, {base}", lambda r: f"{r[key]['base']:.0f}"),
            per_writer(
                f"overhead per call, {overhead}",
                lambda r: f"{r[key]['wall']:.1f}",
                per_call,
                lambda r: r[key]["wall"] <= CALL_TARGET_US,
            ),
            per_writer("  middle half of the rounds (us)", lambda r: quartiles(r[key])),
            per_writer("  of which the end-of-round flush (us)", lambda r: f"{r[key]['flush']:.1f}"),
            per_writer("  calling thread CPU only (us)", lambda r: f"{r[key]['cpu']:.1f}"),
            per_writer("  ratio", lambda r: ratio(r[key])),
        ]

    rows = [
        (
            "hot path: agl code per call, calling thread (us)",
            [f"{hot_us:.1f}"] * len(writers),
            per_call,
            [hot_us <= CALL_TARGET_US] * len(writers),
        ),
        (
            "  the same with OTLP export on (us)",
            [f"{otlp_us:.1f}"] * len(writers),
            per_call,
            [otlp_us <= CALL_TARGET_US] * len(writers),
        ),
        *overhead_rows("latent", f"{latency} (us)", f"{latency}, flush included (us)"),
        *overhead_rows("cpu", "CPU-bound, 0 ms (us)", "CPU-bound, writer and flush included (us)"),
        per_writer(
            "GC collections per 1,000 instrumented calls (gen0/1/2)",
            lambda r: "/".join(f"{c:.1f}" for c in r["collections"]),
        ),
        per_writer(
            f"end-of-rollout flush, {FLUSH_SPANS} calls, {latency} (ms)",
            lambda r: f"{r['flushes']['latent']:.1f}",
            per_flush,
            lambda r: r["flushes"]["latent"] <= FLUSH_TARGET_MS,
        ),
        per_writer(
            f"end-of-rollout flush, {FLUSH_SPANS} calls, CPU-bound (ms)",
            lambda r: f"{r['flushes']['cpu']:.1f}",
            per_flush,
            lambda r: r["flushes"]["cpu"] <= FLUSH_TARGET_MS,
        ),
        per_writer(f"writer: {FLUSH_SPANS} spans all queued, one flush (ms)", lambda r: f"{r['queued_flush_ms']:.0f}"),
        per_writer("  = per span (us)", lambda r: f"{r['queued_flush_ms'] * 1e3 / FLUSH_SPANS:.0f}"),
        per_writer(
            "spans stored / expected",
            lambda r: f"{r['stored']}/{r['expected']}",
            "all",
            lambda r: r["stored"] == r["expected"],
        ),
    ]
    hot_ok = hot_stored == HOT_CALLS * args.rounds
    header = "".join(f" {w + ' writer':>15} met" for w in writers)
    print(f"{'measure':<62}{header} {'target':>8}")
    for name, values, target, oks in rows:
        cells = "".join(f" {v:>15} {'' if ok is None else ('yes' if ok else 'NO'):<3}" for v, ok in zip(values, oks))
        print(f"{name:<62}{cells} {target:>8}")
    print(f"hot-path spans stored: {hot_stored}/{HOT_CALLS * args.rounds} {'yes' if hot_ok else 'NO'}")
    otlp_ok = otlp_received == HOT_CALLS * args.rounds
    print(
        f"hot-path spans at the OTLP receiver: {otlp_received}/{HOT_CALLS * args.rounds} {'yes' if otlp_ok else 'NO'}"
    )
    print(f"(tracer: dropped={stats.dropped} export_errors={stats.export_errors} rejected={stats.rejected})")


if __name__ == "__main__":
    main()
