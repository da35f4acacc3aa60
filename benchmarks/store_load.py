"""Load on the store server over HTTP (loopback): rollouts/s and spans/s for many concurrent runner clients.

    python benchmarks/store_load.py [--clients 1,8,10,100] [--backends sqlite,postgres] [--rollouts 2000]

For each backend, ``agl store serve`` runs in its own process over a fresh store (a SQLite file, or a
database of a throwaway PostgreSQL server). Clients are ``RemoteLightningStore`` objects, one per runner,
spread over at most ``--max-procs`` forked processes (threads inside a process beyond that), so client
CPU is real and separate from the server's: on a machine with few cores the clients compete with the
server, which is what a real deployment on one host would do too.

- rollouts/s: every client does what agl's Runner does per rollout, ``--rollouts`` in all: get_resources,
  one add_spans of ``--spans-per-rollout`` spans, and ``complete_and_dequeue``, whose completion claims
  the next rollout in the same request (a long-poll dequeue only when that found none).
  ``--separate-calls``: complete_attempt, then a long-poll dequeue, as two requests. The trainer enqueued
  the rollouts before (batches of 500). Timed from the start signal to the last client's end.
- spans/s: each client holds one running attempt and sends ``--span-batches`` batches of 1,000 spans
  (as the tracer's writer does).
- Then it checks that nothing was lost (every rollout succeeded exactly once with all its spans, every
  span sent is stored) and reads the server's memory (VmRSS, and the peak VmHWM) from /proc.

Prints figures against the issue's targets (8 clients: >= 500 rollouts/s, >= 20,000 spans/s) and always
exits 0 unless something was lost: these are measurements, not assertions (machines differ).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from agl.store import EnqueueRequest
from agl.store.http.client import RemoteLightningStore
from agl.types import LLM, Rollout, Span

TOKEN = "bench-token"
ROLLOUTS_TARGET = 500  # rollouts/s with 8 clients
SPANS_TARGET = 20_000  # spans/s with 8 clients, in batches
SPAN_BATCH = 1000

_here = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("store_benchmark", _here / "store.py")
assert _spec and _spec.loader
_store_benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_store_benchmark)
make_span = _store_benchmark.make_span  # the same span as the in-process benchmark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``agl store serve`` over ``store`` in a subprocess; its memory is read from /proc."""

    def __init__(self, store: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "agl.cli",
            "store",
            "serve",
            "--store",
            store,
            "--port",
            str(self.port),
            "--token",
            TOKEN,
        ]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        probe = RemoteLightningStore(self.url, token=TOKEN, retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                probe.stats()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the store server did not start:\n{log.read_text()}") from None
                time.sleep(0.1)

    def memory_mb(self) -> Tuple[float, float]:
        """(VmRSS, VmHWM) of the server process in MB."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
        return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far."""
        return process_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_now() -> Tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of the PostgreSQL processes) so far.

    Busy = every /proc/stat category but idle and iowait. The machine's figure is what one rollout costs
    here, all processes together (clients, server, database, the kernel's loopback work).
    """
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = (sum(fields) - fields[3] - fields[4]) / ticks
    postgres = sum(
        process_cpu_seconds(int(pid)) for pid in os.listdir("/proc") if pid.isdigit() and _comm(pid) == "postgres"
    )
    return busy, postgres


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def store_locations(backends: List[str], tmp: str) -> Iterator[Dict[str, Any]]:
    """backend -> a function returning a fresh store location (a .db path or a postgresql:// DSN)."""
    counter = iter(range(10**6))
    found: Dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if "sqlite" in backends:
            found["sqlite"] = lambda: os.path.join(tmp, f"load-{next(counter)}.db")
        if "postgres" in backends:
            try:
                from agl.testing.postgres import TemporaryPostgres

                server = stack.enter_context(TemporaryPostgres(durable=True))
                found["postgres"] = server.create_database
            except Exception as exc:  # noqa: BLE001 - say so and measure the rest
                print(f"postgres: not measured ({type(exc).__name__}: {exc})")
        yield found


# -- clients ------------------------------------------------------------------------------------------------


def _rollout_client(
    url: str, runner_id: str, quota: int, spans_per_rollout: int, separate: bool, go: Any, out: List[Any]
) -> None:
    """What agl's Runner does per rollout; ``separate``: complete, then dequeue, as two calls."""
    store = RemoteLightningStore(url, token=TOKEN)
    done = spans = 0
    claimed: List[Rollout] = []
    go.wait()
    while done < quota:
        rollout = claimed.pop(0) if claimed else store.dequeue_rollout(runner_id, timeout=10)
        if rollout is None:
            break  # the queue ran dry: counted as lost below if anything is missing
        assert rollout.attempt is not None
        store.get_resources(rollout.resources_id)
        spans += store.add_spans([make_span(rollout, i) for i in range(spans_per_rollout)])
        ids = (rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
        if separate or done + 1 == quota:
            store.complete_attempt(*ids, reward=1.0)
        else:
            _, claimed = store.complete_and_dequeue(*ids, reward=1.0, runner_id=runner_id)
        done += 1
    out.append((done, spans, time.perf_counter()))
    store.close()


def _span_client(url: str, rollout: Rollout, batches: int, go: Any, out: List[Any]) -> None:
    store = RemoteLightningStore(url, token=TOKEN)
    prepared = [[_span_in_batch(rollout, b, i) for i in range(SPAN_BATCH)] for b in range(batches)]
    go.wait()
    stored = sum(store.add_spans(batch) for batch in prepared)
    out.append((0, stored, time.perf_counter()))
    store.close()


def _span_in_batch(rollout: Rollout, batch: int, i: int) -> Span:
    span = make_span(rollout, i)
    return span.model_copy(update={"span_id": f"{batch:08x}{i:08x}", "sequence_id": batch * SPAN_BATCH + i})


def _process_main(jobs: List[Tuple[Any, ...]], go: Any, results: Any) -> None:
    """One client process: a thread per client; sends back (rollouts done, spans stored, end time) each."""
    out: List[Any] = []
    threads = [threading.Thread(target=job[0], args=job[1:] + (go, out)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put(out)


def run_clients(jobs: List[Tuple[Any, ...]], max_procs: int) -> Tuple[float, List[Any], str]:
    """Run the client jobs spread over at most ``max_procs`` processes; (seconds, results, layout)."""
    ctx = multiprocessing.get_context("fork")
    n_procs = min(len(jobs), max_procs)
    groups = [jobs[i::n_procs] for i in range(n_procs)]
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(group, go, results)) for group in groups]
    for proc in procs:
        proc.start()
    time.sleep(0.5 + 0.01 * len(jobs))  # let every client build its batches and reach the start line
    start = time.perf_counter()
    go.set()
    out = [item for _ in procs for item in results.get(timeout=600)]
    for proc in procs:
        proc.join(30)
    seconds = max(end for _, _, end in out) - start
    threads = max(len(g) for g in groups)
    layout = f"{n_procs} proc" + (f" x <= {threads} threads" if threads > 1 else "")
    return seconds, out, layout


# -- one measurement ----------------------------------------------------------------------------------------


def measure(location: str, n_clients: int, args: argparse.Namespace, log: Path) -> Dict[str, Any]:
    server = Server(location, log)
    trainer = RemoteLightningStore(server.url, token=TOKEN)
    try:
        resources = trainer.add_resources({"main_llm": LLM(endpoint="http://127.0.0.1:9/v1", model="m")})
        n_rollouts = max(args.rollouts, n_clients)
        quotas = [n_rollouts // n_clients + (1 if i < n_rollouts % n_clients else 0) for i in range(n_clients)]
        ids: List[str] = []
        for start in range(0, n_rollouts, 500):
            batch = [
                EnqueueRequest(input={"i": i}, resources_id=resources.resources_id)
                for i in range(start, min(n_rollouts, start + 500))
            ]
            ids += [r.rollout_id for r in trainer.enqueue_many(batch)]
        jobs = [
            (_rollout_client, server.url, f"runner-{i}", q, args.spans_per_rollout, args.separate_calls)
            for i, q in enumerate(quotas)
        ]
        cpu, (busy, db) = server.cpu_seconds(), cpu_now()
        rollout_s, out, layout = run_clients(jobs, args.max_procs)
        rollout_cpu = server.cpu_seconds() - cpu
        busy_after, db_after = cpu_now()
        finished = sum(done for done, _, _ in out)

        holders = trainer.enqueue_many([EnqueueRequest(input="span holder") for _ in range(n_clients)])
        held = trainer.dequeue_many("span-bench", n_clients)
        span_jobs = [(_span_client, server.url, rollout, args.span_batches) for rollout in held]
        cpu = server.cpu_seconds()
        span_s, span_out, _ = run_clients(span_jobs, args.max_procs)
        span_cpu = server.cpu_seconds() - cpu
        spans_sent = sum(stored for _, stored, _ in span_out)

        stats = trainer.stats()
        lost = _lost(trainer, ids, args.spans_per_rollout, stats, n_clients * args.span_batches * SPAN_BATCH)
        rss, peak = server.memory_mb()
        return {
            "clients": n_clients,
            "layout": layout,
            "rollouts/s": finished / rollout_s,
            "spans/s": spans_sent / span_s,
            "server rollouts/cpu-s": finished / rollout_cpu,
            "cpu ms": (
                1000 * (busy_after - busy) / finished,
                1000 * rollout_cpu / finished,
                1000 * (db_after - db) / finished,
            ),
            "server spans/cpu-s": spans_sent / span_cpu,
            "rss": rss,
            "peak": peak,
            "lost": lost,
            "rollouts": finished,
            "holders": len(holders),
        }
    finally:
        trainer.close()
        server.stop()


def _lost(store: RemoteLightningStore, ids: List[str], spans_per_rollout: int, stats: Any, span_phase: int) -> str:
    """'' when every rollout succeeded exactly once with all its spans and every span sent is stored."""
    problems = []
    done = store.query_rollouts(rollout_ids=ids)
    wrong = [r for r in done if r.status != "succeeded" or r.n_attempts != 1]
    if len(done) != len(ids) or wrong:
        problems.append(f"{len(ids) - len(done)} missing, {len(wrong)} not succeeded once")
    expected_spans = len(ids) * spans_per_rollout + span_phase
    if stats.spans != expected_spans:
        problems.append(f"{stats.spans} spans stored, {expected_spans} sent")
    short = [i for i in ids[:: max(1, len(ids) // 50)] if len(store.query_spans(i)) != spans_per_rollout]
    if short:
        problems.append(f"{len(short)} sampled rollouts miss spans")
    return "; ".join(problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8,10,100", help="comma-separated numbers of concurrent runner clients")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--rollouts", type=int, default=2000, help="rollouts per measurement")
    parser.add_argument("--spans-per-rollout", type=int, default=4)
    parser.add_argument("--span-batches", type=int, default=3, help="batches of 1,000 spans per client")
    parser.add_argument("--max-procs", type=int, default=8, help="client processes at most (threads beyond)")
    parser.add_argument(
        "--separate-calls",
        action="store_true",
        help="complete_attempt then dequeue as two calls, instead of complete_and_dequeue as the Runner does",
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    backends = [b.strip() for b in args.backends.split(",")]
    print(
        f"{os.cpu_count()} CPUs; server: `agl store serve` in its own process; clients: RemoteLightningStore, "
        f"one per runner, over at most {args.max_procs} processes"
    )
    print(
        f"{'backend':<9} {'clients':>7} {'client layout':<22} {'rollouts/s':>11} {'spans/s':>9} "
        f"{'per server CPU-s: rollouts':>27} {'spans':>8} {'CPU ms/rollout: all server db':>30} "
        f"{'server RSS / peak MB':>21}  lost"
    )
    any_lost = False
    with tempfile.TemporaryDirectory() as tmp, store_locations(backends, tmp) as locations:
        for backend, fresh in locations.items():
            for n in counts:
                row = measure(fresh(), n, args, Path(tmp) / f"server-{backend}-{n}.log")
                any_lost |= bool(row["lost"])
                print(
                    f"{backend:<9} {n:>7} {row['layout']:<22} {row['rollouts/s']:>11,.0f} {row['spans/s']:>9,.0f} "
                    f"{row['server rollouts/cpu-s']:>27,.0f} {row['server spans/cpu-s']:>8,.0f} "
                    f"{'':>12}{row['cpu ms'][0]:>6.2f} {row['cpu ms'][1]:>6.2f} {row['cpu ms'][2]:>4.2f} "
                    f"{row['rss']:>10,.0f} / {row['peak']:<8,.0f}  {row['lost'] or 'nothing'}",
                    flush=True,
                )
    print(
        f"targets with 8 clients: >= {ROLLOUTS_TARGET} rollouts/s, >= {SPANS_TARGET:,} spans/s (batches of "
        f"{SPAN_BATCH}); comparisons with Agent Lightning: `nox -s vs_agent_lightning`"
    )
    step = "complete_attempt, then dequeue" if args.separate_calls else "complete_and_dequeue (as agl's Runner)"
    print(
        f"a rollout = get_resources (read once per client and version) + add_spans({args.spans_per_rollout}) + "
        f"{step}; {args.rollouts} rollouts per row"
    )
    print(
        "'CPU ms/rollout': CPU time of the whole machine (all processes, clients included), of the server "
        "process, and of PostgreSQL's processes per rollout during the rollouts phase (where the time goes; it moves "
        "with the VM's speed too: compare within one run)"
    )
    print(
        "'per server CPU-s': work done per second of the server process's own CPU time, which the other "
        "processes on this machine do not skew (the server is one process: one core's worth at most)"
    )
    return 1 if any_lost else 0


if __name__ == "__main__":
    sys.exit(main())
