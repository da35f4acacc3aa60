"""LightningRL throughput: synthetic spans through tree -> transitions -> step rewards/AIR -> credit ->
advantages, at 10k, 100k and 1M spans. Prints spans/s per size and the per-span cost of the largest size
relative to the smallest (1.0 = perfectly linear; the smallest size is the baseline of the same run).
Each size is the best of up to 5 runs (5 at 10k, 3 at 100k, 1 at 1M); the ratio uses this process's CPU
time, which other work on a shared machine disturbs far less than wall time.

    python benchmarks/transitions.py [--sizes 10000 100000 1000000] [--spans-per-rollout 100]

The synthetic rollouts (agl.lightningrl.synthetic) are multi-agent turns of agent > operation > llm call
with a tool call > tool > step reward, 100 spans a rollout, 4 rollouts a task; discounted credit with AIR
on, GRPO. Spans are made lazily per rollout, so memory holds one rollout's spans plus the batch; the time
spent making them is clocked around each rollout's generation and subtracted.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from typing import List, Tuple

from agl.lightningrl import LightningRL
from agl.lightningrl.synthetic import synthetic_rollouts
from agl.types import Rollout

CONFIG = {"credit": "discounted", "gamma": 0.95, "air": {"tool_ok": 0.1}}


Clock = Tuple[float, float]  # (wall seconds, CPU seconds of this process)


def clock() -> Clock:
    return time.perf_counter(), time.process_time()


def since(start: Clock) -> Clock:
    now = clock()
    return now[0] - start[0], now[1] - start[1]


def measure(n_spans: int, spans_per_rollout: int) -> Tuple[int, int, Clock]:
    """(spans processed, samples, (wall, CPU) seconds of LightningRL work). The spans are made lazily
    inside the run; the time spent making them is clocked where it happens and subtracted."""
    rollouts: List[Rollout] = [r for r, _ in synthetic_rollouts(n_spans, spans_per_rollout=spans_per_rollout)]
    counted = 0
    making = [0.0, 0.0]

    def pairs():
        nonlocal counted
        made = synthetic_rollouts(n_spans, spans_per_rollout=spans_per_rollout)
        while True:
            start = clock()
            pair = next(made, None)
            wall, cpu = since(start)
            making[0] += wall
            making[1] += cpu
            if pair is None:
                return
            counted += len(pair[1])
            yield pair

    adapter = LightningRL.from_config(CONFIG)
    gc.collect()
    start = clock()
    batch = adapter.batch_from_spans(rollouts, pairs())
    wall, cpu = since(start)
    assert batch.report.accounted
    return counted, len(batch.samples), (wall - making[0], cpu - making[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--spans-per-rollout", type=int, default=100)
    args = parser.parse_args()

    print(f"config: {CONFIG}, {args.spans_per_rollout} spans per rollout")
    print(f"{'spans':>10} {'samples':>9} {'wall s':>8} {'spans/s':>10} {'CPU us/span':>12}")
    measure(min(args.sizes), args.spans_per_rollout)  # warm-up (imports, caches), not reported
    per_span: List[float] = []
    for size in args.sizes:
        # best of several runs for the small sizes: on a shared machine one run is mostly noise
        runs = [measure(size, args.spans_per_rollout) for _ in range(min(5, max(1, 300_000 // size)))]
        spans, samples, (wall, cpu) = min(runs, key=lambda run: run[2][1])
        per_span.append(cpu / spans)
        print(f"{spans:>10} {samples:>9} {wall:>8.2f} {spans / wall:>10,.0f} {1e6 * cpu / spans:>12.2f}")
    if len(per_span) > 1:
        print(
            f"per-span CPU cost, {args.sizes[-1]:,} vs {args.sizes[0]:,} spans: {per_span[-1] / per_span[0]:.2f}x "
            "(1.0 = linear)"
        )
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
