"""Rollouts/s of runners as Ray actors against the same number of ``agl runner`` processes, same store server.

    python benchmarks/scale_out.py [--runners 1,2,4] [--backends sqlite,postgres] [--rollouts 300] [--work-ms 20]

Needs the ``ray`` extra (and ``postgres`` for PostgreSQL), as ``nox -s ray`` installs them. For each
backend, ``agl store serve`` runs in its own process over a fresh store (``store_load.py``'s server). For
each runner count, in the same run: a :class:`~agl.runtime.runner_pool.RunnerPool` of processes and a
:class:`~agl.runtime.ray_runners.RayRunnerPool` of actors (on a local Ray cluster started here, one CPU
per actor), each against the server's URL, run ``--rollouts`` rollouts of a one-span agent that works
``--work-ms`` (a sleep). A warm-up batch runs first, so start-up (forks, actor placement) is not timed;
then the rollouts are enqueued and timed until the last one succeeded.

Prints rollouts/s for both and the extra time per rollout that Ray costs; checks that every rollout
succeeded once. These are measurements, not assertions (machines differ); exits 1 only if one was lost.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import agl
from agl.store.http.client import RemoteLightningStore
from agl.types import Rollout

_here = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("store_load", _here / "store_load.py")
assert _spec and _spec.loader
store_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(store_load)


@agl.rollout
def one_span_agent(task: Dict[str, Any], rollout: Rollout) -> float:
    """One message span and ``task["work_ms"]`` of work: what every runner does per rollout, no model."""
    agl.emit_message(f"task {task['n']}")
    time.sleep(task["work_ms"] / 1000)
    return 1.0


def run_batch(store: RemoteLightningStore, pool: Any, n: int, work_ms: float) -> float:
    """Enqueue ``n`` rollouts, wait until all succeeded; seconds taken."""
    before = len(store.query_rollouts())
    started = time.monotonic()
    for i in range(n):
        store.enqueue_rollout({"n": i, "work_ms": work_ms})
    while True:
        rollouts = store.query_rollouts()[before:]
        if len(rollouts) == n and all(r.status in ("succeeded", "failed") for r in rollouts):
            break
        pool.check()
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    failed = [r.rollout_id for r in rollouts if r.status != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} rollouts did not succeed: {failed[:5]}")
    return elapsed


def measure(url: str, kind: str, n_runners: int, args: argparse.Namespace) -> float:
    from agl.runtime.ray_runners import RayRunnerPool
    from agl.runtime.runner_pool import RunnerPool

    store = RemoteLightningStore(url, token=store_load.TOKEN)
    agent = importlib.import_module("scale_out").one_span_agent  # by module name: Ray actors import it so
    pool: Any
    if kind == "ray":
        pool = RayRunnerPool(agent, store, n_runners, resources={"num_cpus": 1})
    else:
        pool = RunnerPool(agent, store, n_runners, mode="process")
    with pool:
        run_batch(store, pool, 2 * n_runners, args.work_ms)  # warm-up: every runner started and ran one
        elapsed = run_batch(store, pool, args.rollouts, args.work_ms)
    store.close()
    return args.rollouts / elapsed


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", default="1,2,4", help="comma-separated runner counts")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--rollouts", type=int, default=300, help="timed rollouts per measurement")
    parser.add_argument("--work-ms", type=float, default=20.0, help="the agent's work per rollout (a sleep)")
    args = parser.parse_args(argv)
    import ray

    counts = [int(c) for c in args.runners.split(",")]
    ray.init(num_cpus=max(counts), include_dashboard=False, log_to_driver=False)
    print(
        f"{os.cpu_count()} CPUs; {args.rollouts} rollouts of {args.work_ms:g} ms work each; agl store serve over HTTP"
    )
    print(f"{'backend':<9} {'runners':>7} {'processes/s':>12} {'ray actors/s':>13} {'ray extra ms/rollout':>21}")
    try:
        with tempfile.TemporaryDirectory() as tmp, store_load.store_locations(args.backends.split(","), tmp) as where:
            for backend, fresh in where.items():
                for n in counts:
                    rates = {}
                    for kind in ("process", "ray"):
                        server = store_load.Server(fresh(), Path(tmp) / f"server-{backend}-{n}-{kind}.log")
                        try:
                            rates[kind] = measure(server.url, kind, n, args)
                        finally:
                            server.stop()
                    extra_ms = (1 / rates["ray"] - 1 / rates["process"]) * 1000 * n  # per rollout, per runner
                    print(
                        f"{backend:<9} {n:>7} {rates['process']:>12.1f} {rates['ray']:>13.1f} {extra_ms:>21.2f}",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    print("'ray extra ms/rollout': how much longer each runner takes per rollout as a Ray actor than as a process")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(_here))
    sys.exit(main())
