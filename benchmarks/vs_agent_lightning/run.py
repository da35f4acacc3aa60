"""agl and Agent Lightning 0.3.0 (the peer) side by side: the same workloads, in one run, alternating.

    python run.py --peer-python PATH [--quick] [--only NAME[,NAME]] [--json PATH]

(``nox -s vs_agent_lightning -- [--quick] ...`` makes both venvs and runs this.) Each workload runs as a
process with one side's venv Python (agl_side.py / peer_side.py), agl first in even rounds and the peer first
in odd ones. Each figure is printed as its median and middle half (quartiles; min-max under 4 samples) over
every sample of every round, with the ratio of the medians, agl / peer.

1. tracer: the real ``openai`` client calling an in-process fake (httpx MockTransport; a chat completion with
   600 prompt and 200 response token ids and their logprobs; 8 input messages). Paired blocks in one process
   (30 pairs of 20 calls), order alternating, each block after a full collection: N uninstrumented calls,
   then N calls instrumented inside a new rollout with every span stored before the block ends. Figures:
   process CPU time (time.process_time, all threads) instrumented / plain, and overhead per call in CPU and
   wall us. agl: ``agl.instrument()``, ``agl.rollout_scope``, the
   tracer's flush. Peer: AgentOpsTracer (AgentOps' OpenAI instrumentation with the peer's token-id patch)
   in ``trace_context(rollout_id=, attempt_id=)``. Placements: a store in the process (both: in memory), a
   store server in its own process over HTTP (agl: ``agl store serve`` over SQLite and its HTTP client; peer:
   its LightningStoreServer in memory, spans by OTLP). Also "outside a rollout": instrumented, no rollout.
2. rollout_end: an agent that makes one call (as in 1) and returns 1.0; time from its return to the runner
   handing back the completed rollout read from the store (agl: ``Runner.run_rollout``; peer:
   ``LitAgentRunner.step``), same placements as 1.
3. store_calls: per call, 100 calls per sample: enqueue one rollout, dequeue one, add one LLM span (the span
   each side's tracer stores for the call of 1; sizes printed), complete one attempt (peer: update_attempt).
   agl: in memory, SQLite file, PostgreSQL ($AGL_TEST_POSTGRES_DSN or a throwaway server; skipped with the
   reason printed if neither); peer: InMemoryLightningStore, its only embedded store. Bulk methods (batches
   of 100: enqueue_many, dequeue_many, add spans) on their own rows on both sides.
4. store_http: 8 client processes doing full rollout cycles (enqueue, dequeue, 4 spans each in its own
   request, complete: 7 requests per rollout on both sides) against each side's store server; rollouts/s
   and spans/s. agl's bulk row (4 spans in one request) has no peer counterpart: the peer's client sends
   one span per request.
5. dev: ``Trainer.dev`` on 20 one-call tasks (a fake model server on 127.0.0.1, started before timing), 1 and
   4 runners, wall time after import. The peer with its default polling (5 s) and with its polling tuned down.

Then agl's own figures that have no peer counterpart, each against its own reference in the same run
(``--no-agl-only`` skips them): bytes per stored span against the JSON agl stored before
(benchmarks/span_bytes.py) and LightningRL from a store to samples against commit 8a58a22
(benchmarks/lightningrl_store.py). The date and the machine's load at the start and the end are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import common

HERE = Path(__file__).parent
ROUNDS = {"tracer": 2, "rollout_end": 2, "store_calls": 2, "store_http": 2, "dev": 1}
SIDES = ("agl", "peer")

Merged = Dict[str, Dict[str, Dict[str, List[float]]]]  # measure -> side -> variant -> samples


def merge(runs: List[Dict[str, Any]]) -> Merged:
    """Every run's samples, pooled per measure, side and variant (measures in the order first seen)."""
    merged: Merged = {}
    for run in runs:
        for measure, variants in run["figures"].items():
            for variant, samples in variants.items():
                merged.setdefault(measure, {}).setdefault(run["side"], {}).setdefault(variant, []).extend(samples)
    return merged


def pair_variants(agl: List[str], peer: List[str]) -> List[Tuple[Optional[str], Optional[str]]]:
    """Which agl figure sits beside which peer figure: when one side has a single variant, that one beside each
    of the other's; else the same variant name, what is left having nothing beside it."""
    if len(peer) == 1:
        return [(a, peer[0]) for a in agl] or [(None, peer[0])]
    if len(agl) == 1:
        return [(agl[0], p) for p in peer] or [(agl[0], None)]
    pairs: List[Tuple[Optional[str], Optional[str]]] = [(a, a if a in peer else None) for a in agl]
    return pairs + [(None, p) for p in peer if p not in agl]


def rows(merged: Merged) -> List[Dict[str, Any]]:
    """One row per paired figure: label, each side's summary (or None) and the ratio of the medians."""
    out = []
    for measure, sides in merged.items():
        agl, peer = sides.get("agl", {}), sides.get("peer", {})
        for a, p in pair_variants(list(agl), list(peer)):
            label = a if a == p or p is None else (p if a is None else f"{a} vs {p}")
            agl_summary = common.summary(agl[a]) if a is not None else None
            peer_summary = common.summary(peer[p]) if p is not None else None
            row = {"measure": measure, "variant": label, "agl": agl_summary, "peer": peer_summary}
            out.append({**row, "ratio": common.ratio(agl_summary, peer_summary)})
    return out


def number(value: float) -> str:
    """3 significant digits below 100, whole numbers with thousands separators above (no exponents)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def figure(summary: Optional[Dict[str, float]]) -> str:
    """``median [low to high]``, or a dash."""
    if summary is None:
        return "-"
    return f"{number(summary['median'])} [{number(summary['low'])} to {number(summary['high'])}]"


def table(all_rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'figure':<92} {'agl: median [middle half]':>28} {'peer: median [middle half]':>28} {'agl/peer':>8}"]
    for row in all_rows:
        ratio = "-" if row["ratio"] is None else number(row["ratio"])
        name = f"{row['measure']} | {row['variant']}"
        lines.append(f"{name:<92} {figure(row['agl']):>28} {figure(row['peer']):>28} {ratio:>8}")
    return "\n".join(lines)


def markdown(all_rows: List[Dict[str, Any]], header: str, notes: List[str]) -> str:
    """The rows as docs/benchmarks.md shows them: one table per figure, under ``header`` (date, load) and the
    run's notes (what each side ran)."""
    out = [header, "", *(f"- {note}" for note in notes)]
    for measure in dict.fromkeys(row["measure"] for row in all_rows):
        out += ["", f"### {measure}", "", "| | agl: median [middle half] | peer: median [middle half] | agl / peer |"]
        out.append("|---|---:|---:|---:|")
        for row in (r for r in all_rows if r["measure"] == measure):
            ratio = "-" if row["ratio"] is None else number(row["ratio"])
            out.append(f"| {row['variant']} | {figure(row['agl'])} | {figure(row['peer'])} | {ratio} |")
    return "\n".join(out) + "\n"


def run_side(side: str, python: str, workload: str, quick: bool, tmp: Path) -> Dict[str, Any]:
    """One side's run of one workload in its own process; its results, or an error note with its log's tail."""
    out, log = tmp / f"{side}-{workload}-{time.perf_counter_ns()}.json", tmp / f"{side}-{workload}.log"
    argv = [python, str(HERE / f"{side}_side.py"), workload, "--out", str(out), *(["--quick"] if quick else [])]
    with log.open("wb") as handle:
        code = subprocess.call(argv, stdout=handle, stderr=subprocess.STDOUT, cwd=tmp)
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        return {"side": side, "workload": workload, "figures": {}, "notes": [f"{side} {workload} FAILED: {tail[0]}"]}
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=os.environ.get("AGL_PEER_PYTHON"), help="the peer venv's python")
    parser.add_argument("--agl-python", default=sys.executable, help="agl's venv python (default: this one)")
    parser.add_argument("--quick", action="store_true", help="one round of small workloads: a smoke run")
    parser.add_argument("--only", default=",".join(common.WORKLOADS), help="workloads, comma-separated")
    parser.add_argument("--json", help="also write the rows and every sample here")
    parser.add_argument("--markdown", help="also write the tables here as docs/benchmarks.md shows them")
    parser.add_argument("--no-agl-only", action="store_true", help="skip agl's own figures (span bytes, LightningRL)")
    args = parser.parse_args()
    workloads = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(common.WORKLOADS))
    if unknown:
        common.fail(f"--only {','.join(unknown)}: no such workload; choose from {', '.join(common.WORKLOADS)}")
    if not args.peer_python or not Path(args.peer_python).exists():
        common.fail("give the peer venv's python: --peer-python PATH or $AGL_PEER_PYTHON (nox -s vs_agent_lightning)")
    pythons = {"agl": args.agl_python, "peer": args.peer_python}
    runs: List[Dict[str, Any]] = []
    started = time.perf_counter()
    header = f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load at the start {load()}"
    print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-agl-") as tmp:
        for workload in workloads:
            for r in range(1 if args.quick else ROUNDS[workload]):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    print(f"[{time.perf_counter() - started:6.0f} s] {workload}: {side}, round {r + 1}", flush=True)
                    runs.append(run_side(side, pythons[side], workload, args.quick, Path(tmp)))
    merged = merge(runs)
    all_rows = rows(merged)
    notes = list(dict.fromkeys(note for run in runs for note in run["notes"]))
    print()
    print(table(all_rows))
    print()
    for note in notes:
        print(f"- {note}")
    print(f"({os.cpu_count()} CPUs; {time.perf_counter() - started:.0f} s; {'quick' if args.quick else 'full'} run)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": all_rows, "notes": notes, "samples": merged}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(all_rows, f"{header}, at the end {load()}", notes))
    failed = any("FAILED" in note for note in notes)
    if not args.no_agl_only:
        failed = agl_only(args.agl_python, args.quick) or failed
    print(f"load at the end {load()}")
    return 1 if failed else 0


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


def agl_only(python: str, quick: bool) -> bool:
    """agl's figures without a peer counterpart, each script printing its own reference; True if one failed."""
    scripts = [
        ["span_bytes.py", *(["--spans", "200", "--rollouts", "32"] if quick else [])],
        ["lightningrl_store.py", *(["--sizes", "10000", "--repeat", "1"] if quick else [])],
    ]
    failed = False
    for script, *options in scripts:
        print(f"\n$ python benchmarks/{script} {' '.join(options)}", flush=True)
        failed = subprocess.call([python, str(HERE.parent / script), *options]) != 0 or failed
    return failed


if __name__ == "__main__":
    sys.exit(main())
