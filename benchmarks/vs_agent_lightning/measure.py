"""How both sides measure: the same code times agl and the peer (each side passes its own calls in), and the
names of the measures, which pair the two sides' figures up in run.py. Standard library only, as common.py."""

from __future__ import annotations

import gc
import multiprocessing
import time
from typing import Any, Callable, Tuple

from common import MESSAGES, MODEL, Results

# workload 1's measures (the same names on both sides pair the figures up)
TRACER_RATIO = "1 tracer: process CPU, instrumented / plain (x)"
TRACER_CPU = "1 tracer: CPU overhead per call (us)"
TRACER_WALL = "1 tracer: wall overhead per call (us)"
PLAIN_CPU = "1 tracer: plain call, CPU (us)"
ROLLOUT_END = "2 rollout end: agent returned -> rollout complete (ms)"
# workload 1's (calls per block, pairs of blocks): many short pairs, each block starting from a collected heap,
# so that a full collection landing in one block of a pair weighs on one pair out of many, not on the median
TRACER_QUICK = (20, 2)
TRACER_FULL = (20, 30)


def dev_measure(runners: int) -> str:
    return f"5 Trainer.dev, 20 one-call tasks, {runners} runner(s): wall (s)"


def cpu_wall() -> Tuple[float, float]:
    """(process CPU time of all threads, wall time), in seconds."""
    return time.process_time(), time.perf_counter()


def alternate(i: int, first: Callable[[], Any], second: Callable[[], Any]) -> Tuple[Any, Any]:
    """Both results, ``first``'s run first on even ``i`` and second on odd: a drift in the machine's speed then
    adds to as many pairs as it takes from."""
    if i % 2 == 0:
        a = first()
        return a, second()
    b = second()
    return first(), b


def original_create(client: Any) -> Callable[[], Any]:
    """One call through the client's ``create`` as it is now: taken before instrumenting, it stays uninstrumented
    (both sides' instrumentations patch the class), so plain and instrumented blocks share one process."""
    completions = client.chat.completions
    create = type(completions).__dict__["create"]
    return lambda: create(completions, model=MODEL, messages=MESSAGES, temperature=0.7)


def paired_blocks(
    results: Results,
    variant: str,
    rounds: int,
    n: int,
    plain: Callable[[], Any],
    prepare: Callable[[], Any],
    traced: Callable[[Any, int], None],
    check: Callable[[Any, int], None],
) -> None:
    """Workload 1's measurement, the same on both sides: ``rounds`` pairs of a block of ``n`` plain calls and a
    block of ``n`` instrumented ones (``traced(context, n)``, every span stored before it returns), the order
    alternating. ``prepare()`` (a new rollout) and ``check(context, n)`` (the spans are in the store) are not
    timed. Figures: process CPU time (all threads) instrumented / plain, and the overhead per call in CPU and
    wall microseconds."""

    def plain_block() -> Tuple[float, float]:
        gc.collect()
        cpu, wall = cpu_wall()
        for _ in range(n):
            plain()
        end_cpu, end_wall = cpu_wall()
        return end_cpu - cpu, end_wall - wall

    def traced_block() -> Tuple[float, float]:
        context = prepare()
        gc.collect()
        cpu, wall = cpu_wall()
        traced(context, n)
        end_cpu, end_wall = cpu_wall()
        check(context, n)
        return end_cpu - cpu, end_wall - wall

    plain_block()  # warm up (the side warmed up the traced path)
    for i in range(rounds):
        (plain_cpu, plain_wall), (cpu, wall) = alternate(i, plain_block, traced_block)
        results.add(TRACER_RATIO, variant, [cpu / plain_cpu])
        results.add(TRACER_CPU, variant, [(cpu - plain_cpu) / n * 1e6])
        results.add(TRACER_WALL, variant, [(wall - plain_wall) / n * 1e6])
        results.add(PLAIN_CPU, variant, [plain_cpu / n * 1e6])


STORE_HTTP_CLIENTS = 8
STORE_HTTP_SPANS = 4  # spans per rollout
STORE_HTTP = "4 store over HTTP, 8 clients, 4 spans per rollout, one request each"
STORE_HTTP_BULK = "4 store over HTTP, 8 clients, agl bulk: 4 spans per rollout in one request"
BULK = "3 store, bulk (batches of 100):"


def add_per_call(
    results: Results, measure: str, variant: str, seconds: float, calls: int, rate: str = "calls/s"
) -> None:
    """``measure`` as microseconds per call (or item) and as ``rate`` (workload 3)."""
    results.add(f"{measure} (us)", variant, [seconds / calls * 1e6])
    results.add(f"{measure} ({rate})", variant, [calls / seconds])


def _client(make_cycle: Callable[[], Callable[[], bool]], per_client: int, ready: Any, start: Any, done: Any) -> None:
    """One client process of :func:`concurrent_cycles`: connected and warm, it waits for the start, then runs
    its cycles and reports how many succeeded and when it ended."""
    cycle = make_cycle()
    cycle()  # its connection is open before the start
    ready.put(True)
    start.wait()
    ok = sum(bool(cycle()) for _ in range(per_client))
    done.put((ok, time.perf_counter()))


def concurrent_cycles(
    results: Results, measure: str, make_cycle: Callable[[], Callable[[], bool]], per_client: int, reps: int
) -> None:
    """Workload 4, the same on both sides: STORE_HTTP_CLIENTS client processes (forked), each doing
    ``per_client`` rollout cycles (``make_cycle()`` in the child gives one cycle: enqueue, dequeue, add
    STORE_HTTP_SPANS spans, complete; True when the rollout ended as succeeded). Timed from the start signal
    to the last client's end; ``reps`` times. Every cycle must succeed."""
    context = multiprocessing.get_context("fork")
    for _ in range(reps):
        start = context.Event()
        ready: Any = context.Queue()
        done: Any = context.Queue()
        client_args = (make_cycle, per_client, ready, start, done)
        processes = [context.Process(target=_client, args=client_args) for _ in range(STORE_HTTP_CLIENTS)]
        for process in processes:
            process.start()
        for _ in processes:
            ready.get(timeout=120)
        began = time.perf_counter()
        start.set()
        ends = [done.get(timeout=600) for _ in processes]
        for process in processes:
            process.join()
        ok = sum(e[0] for e in ends)
        total = STORE_HTTP_CLIENTS * per_client
        if ok != total:
            raise RuntimeError(f"{measure}: {ok} of {total} rollouts succeeded")
        seconds = max(e[1] for e in ends) - began
        results.add(f"{measure}: rollout cycles/s", "HTTP", [total / seconds])
        results.add(f"{measure}: spans/s", "HTTP", [total * STORE_HTTP_SPANS / seconds])
