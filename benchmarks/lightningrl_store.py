"""LightningRL from a SQLite store to samples, against a baseline commit in the same run.

    python benchmarks/lightningrl_store.py [--sizes 10000 100000 1000000] [--baseline 8a58a22] [--repeat 3]

Each side (this tree, ``head``, and the baseline commit, exported with ``git archive`` to a temporary folder)
runs in its own subprocess with ``PYTHONPATH`` set to its own ``core``. Per size and side, one process writes
a store file with that side's code; then the sides take turns (baseline, head, baseline, ...) at the timed
part: ``query_rollouts``, then per rollout ``query_spans`` (read and decode) and LightningRL (tree,
transitions, step rewards with AIR, discounted credit, GRPO advantages). The samples of both sides are
digested and compared.

The spans are synthetic multi-agent rollouts (agl.lightningrl.synthetic, loaded from this tree's file by
both sides, so the workload is the same): 96 spans a rollout, 4 rollouts a task, each llm call with ~600
prompt and ~200 response ids from a 50k vocabulary and a logprob per response token. Spans are made and
written lazily, 100 rollouts at a time; reading is lazy per rollout, so memory holds the batch and one
rollout's spans. Each row is the best (least CPU) of ``--repeat`` runs at sizes up to 100k, one at 1M.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Tuple

CONFIG = {"credit": "discounted", "gamma": 0.95, "air": {"tool_ok": 0.1}}
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIDES = ("baseline", "head")
WRITE_BATCH = 100  # rollouts per enqueue, claim and add_spans


# -- the workload, run inside a side's subprocess -------------------------------------------------------------
def _synthetic() -> Any:
    """This tree's synthetic module, run against the side's ``agl`` (its Span, its semconv)."""
    path = os.path.join(REPO, "core", "agl", "lightningrl", "synthetic.py")
    spec = importlib.util.spec_from_file_location("_bench_synthetic", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def write_store(path: str, n_spans: int) -> Dict[str, Any]:
    """Enqueue, claim, add the spans of and complete every synthetic rollout, 100 rollouts at a time."""
    from agl.store import EnqueueRequest, SqliteLightningStore

    synthetic = _synthetic()
    made = synthetic.synthetic_rollouts(n_spans, spans_per_rollout=100, tokens=synthetic.TokenShape())
    spans = 0
    start = time.perf_counter()
    with SqliteLightningStore(path) as store:
        while True:
            chunk = [pair for _, pair in zip(range(WRITE_BATCH), made)]
            if not chunk:
                break
            store.enqueue_many([EnqueueRequest(rollout_id=r.rollout_id, task_id=r.task_id) for r, _ in chunk])
            claimed = store.dequeue_many("bench", len(chunk))
            attempts = {r.rollout_id: r.attempt.attempt_id for r in claimed if r.attempt is not None}
            batch = [s.model_copy(update={"attempt_id": attempts[r.rollout_id]}) for r, ss in chunk for s in ss]
            spans += store.add_spans(batch)
            for r, _ in chunk:
                store.complete_attempt(r.rollout_id, attempts[r.rollout_id], "succeeded", reward=r.final_reward)
    return {"spans": spans, "wall": time.perf_counter() - start, "bytes": os.path.getsize(path)}


Clock = Tuple[float, float]  # (wall seconds, CPU seconds of this process)


def clock() -> Clock:
    return time.perf_counter(), time.process_time()


def read_store(path: str) -> Dict[str, Any]:
    """Time the store's rollouts and spans to LightningRL's samples; the part spent in ``query_spans`` is
    clocked where it happens, so the split between reading and LightningRL is known."""
    from agl.lightningrl import LightningRL
    from agl.store import SqliteLightningStore

    adapter = LightningRL.from_config(CONFIG)
    reading = [0.0, 0.0]
    spans = 0
    with SqliteLightningStore(path, create=False) as store:

        def pairs(rollouts: List[Any]) -> Iterator[Tuple[Any, Any]]:
            nonlocal spans
            for rollout in rollouts:
                wall, cpu = clock()
                attempt_spans = store.query_spans(rollout.rollout_id)
                reading[0] += time.perf_counter() - wall
                reading[1] += time.process_time() - cpu
                spans += len(attempt_spans)
                yield rollout, attempt_spans

        start = clock()
        rollouts = store.query_rollouts(status=["succeeded"])
        batch = adapter.batch_from_spans(rollouts, pairs(rollouts))
        wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    assert batch.report.accounted and batch.samples, batch.report
    return {
        "spans": spans,
        "samples": len(batch.samples),
        "wall": wall,
        "cpu": cpu,
        "read_cpu": reading[1],
        "read_wall": reading[0],
        "digest": digest(batch.samples),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def digest(samples: List[Any]) -> str:
    """A hash of every field of every sample, to tell whether both sides built the same batch."""
    h = hashlib.sha256()
    for s in samples:
        fields = (s.rollout_id, s.task_id, s.policy, s.prompt_ids, s.response_ids, s.response_mask, s.reward)
        rest = (s.advantage, s.loss_weight, s.response_logprobs, s.span_ids, s.mode)
        h.update(repr(fields + rest).encode())
    return h.hexdigest()[:16]


def worker(action: str, path: str, size: int, root: str) -> None:
    """One side's run; prints its figures as one JSON line. Refuses to measure code from another tree."""
    result = write_store(path, size) if action == "write" else read_store(path)
    files = {name: getattr(module, "__file__", None) or root for name, module in list(sys.modules.items())}
    strays = [name for name, file in files.items() if name.split(".")[0] == "agl" and not file.startswith(root)]
    if strays:
        raise SystemExit(f"{action} imported agl modules from outside {root}: {strays[:5]}")
    print(json.dumps(result))


# -- the driver ---------------------------------------------------------------------------------------------
def export_baseline(commit: str, folder: str) -> str:
    """The baseline's ``core`` and ``integrations`` from git (``git archive``: nothing in this tree changes)."""
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", commit, "core", "integrations"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def run_side(root: str, action: str, path: str, size: int) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "core"), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, os.path.abspath(__file__), "--worker", action, path, str(size), root]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{action} at {size} spans on {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(roots: Dict[str, str], folder: str, size: int, repeat: int) -> Dict[str, Dict[str, Any]]:
    """The best (least CPU) run of each side at ``size`` spans, sides alternating."""
    paths = {side: os.path.join(folder, f"{side}-{size}.db") for side in SIDES}
    for side in SIDES:
        written = run_side(roots[side], "write", paths[side], size)
        size_mib = written["bytes"] / 2**20
        print(f"  {side} wrote {written['spans']:,} spans in {written['wall']:.1f} s, {size_mib:,.0f} MiB", flush=True)
    runs: Dict[str, List[Dict[str, Any]]] = {side: [] for side in SIDES}
    for _ in range(repeat):
        for side in SIDES:
            runs[side].append(run_side(roots[side], "read", paths[side], size))
    for side in SIDES:
        os.remove(paths[side])
    return {side: min(runs[side], key=lambda run: run["cpu"]) for side in SIDES}


def row(size: int, side: str, run: Dict[str, Any]) -> str:
    n = run["spans"]
    read_share = run["read_cpu"] / run["cpu"]
    return (
        f"{size:>9,} {side:>8} {n / run['cpu']:>12,.0f} {n / run['wall']:>12,.0f} {1e6 * run['cpu'] / n:>9.2f}"
        f" {1e6 * run['read_cpu'] / n:>9.2f} {1e6 * (run['cpu'] - run['read_cpu']) / n:>9.2f} {read_share:>6.0%}"
        f" {run['rss_mib']:>8,.0f} {run['digest']:>17}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--baseline", default="8a58a22", help="the commit to compare with (default 8a58a22)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per side at sizes up to 100k")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="agl-lrl-store-") as folder:
        baseline = export_baseline(args.baseline, tempfile.mkdtemp(dir=folder, prefix="baseline-"))
        roots = {"baseline": baseline, "head": REPO}
        print(f"config: {CONFIG}; baseline {args.baseline}; load {os.getloadavg()[0]:.1f}")
        results = []
        for size in args.sizes:
            print(f"{size:,} spans:", flush=True)
            results.append(measure(roots, folder, size, args.repeat if size <= 100_000 else 1))
    print(
        f"{'spans':>9} {'side':>8} {'spans/CPU s':>12} {'spans/s':>12} {'CPU us':>9} {'read us':>9}"
        f" {'LRL us':>9} {'read':>6} {'RSS MiB':>8} {'samples digest':>17}"
    )
    for size, best in zip(args.sizes, results):
        for side in SIDES:
            print(row(size, side, best[side]))
    for size, best in zip(args.sizes, results):
        cpu = best["baseline"]["cpu"] / best["head"]["cpu"]
        wall = best["baseline"]["wall"] / best["head"]["wall"]
        same = "same samples" if best["baseline"]["digest"] == best["head"]["digest"] else "SAMPLES DIFFER"
        print(f"{size:>9,} head vs {args.baseline}: {cpu:.2f}x spans/CPU s, {wall:.2f}x spans/s wall; {same}")
    if len(results) > 1:
        for side in SIDES:
            first, last = (results[i][side] for i in (0, -1))
            ratio = (last["cpu"] / last["spans"]) / (first["cpu"] / first["spans"])
            print(f"{side}: CPU per span at {args.sizes[-1]:,} vs {args.sizes[0]:,} spans: {ratio:.2f}x (1.0 = linear)")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()
