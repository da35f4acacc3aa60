"""What the store server's HTTP layer costs per request, without sockets: CPU microseconds per request.

    python benchmarks/server_overhead.py [--requests 3000] [--cycles 1500] [--no-postgres]

The app of ``agl store serve`` (``create_app``) over an in-memory store is called as an ASGI app, in this
process, with the requests a runner makes (and ``/healthz``, which has no token check and no store call:
the floor of a request through FastAPI's stack, which the runner's hot requests skip, see DirectRoutes). No uvicorn,
no network, no client: the figure is FastAPI's routing, dependency solving,
validation and response, plus agl's handlers and a store call that costs a few microseconds. It is what
to measure when changing the server's HTTP layer; ``store_load.py`` gives the end-to-end figures.

Then a runner's rollout cycle (dequeue, add_spans of 4 spans, get_resources, complete_attempt: four
requests) through the same app over SQLite and over PostgreSQL (a throwaway server, fsync on), with the
store's calls on worker threads, as coroutines on the event loop (``AsyncRolloutCalls``, PostgreSQL's
default) and inline on the event loop (SQLite's default): the server process's CPU per cycle, which is
what bounds ``store_load.py`` on a small machine. PostgreSQL's own CPU is not in it (another process).

Prints process CPU time per request (median of 5 rounds) and exits 0: measurements, not assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

from pydantic_core import to_json

from agl.store import EnqueueRequest, InMemoryLightningStore, LightningStore, SqliteLightningStore
from agl.store.base import AsyncRolloutCalls
from agl.store.http.server import ServerLimits, TokenSet, create_app
from agl.types import LLM, Rollout

_spec = importlib.util.spec_from_file_location("store_benchmark", Path(__file__).parent / "store.py")
assert _spec and _spec.loader
_store_benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_store_benchmark)
make_span = _store_benchmark.make_span  # the span of the other store benchmarks

TOKEN = "bench-token"


def scope(method: str, path: str, body: bytes, query: bytes = b"") -> Dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [
            (b"host", b"bench"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def request(app: Any, method: str, path: str, body: bytes = b"") -> int:
    """One request through the ASGI app; returns the status code."""
    return (await answer(app, method, path, body))[0]


async def answer(app: Any, method: str, path: str, body: bytes = b"") -> Tuple[int, bytes]:
    """One request through the ASGI app; returns the status code and the body."""
    sent: List[Dict[str, Any]] = []
    received: List[bool] = []

    async def receive() -> Dict[str, Any]:
        if received:  # as a server does: after the body, wait for the client to go (it never does here)
            await asyncio.Event().wait()
        received.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    await app(scope(method, path, body), receive, send)
    return int(sent[0]["status"]), b"".join(m.get("body", b"") for m in sent[1:])


async def measure(n: int) -> List[Tuple[str, float]]:
    store = InMemoryLightningStore()
    await store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:1/v1", model="bench")})  # awaitable here
    app = create_app(store, tokens=TokenSet({"bench": TOKEN}))
    await store.enqueue_many([EnqueueRequest(input={"i": 1})])
    rollout = (await store.dequeue_many("bench", 1))[0]
    assert rollout.attempt is not None
    attempt = f"/v1/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt.attempt_id}"
    cases = [
        ("GET /healthz (FastAPI's floor: no token, no store)", "GET", "/healthz", b""),
        ("GET /v1/resources", "GET", "/v1/resources", b""),
        ("GET /v1/stats", "GET", "/v1/stats", b""),
        ("POST .../heartbeat", "POST", attempt + "/heartbeat", b""),
        (
            "POST /v1/rollouts/dequeue (nothing queued)",
            "POST",
            "/v1/rollouts/dequeue",
            b'{"runner_id": "bench", "limit": 1, "timeout": 0}',
        ),
    ]
    results = []
    async with app.router.lifespan_context(app):
        for label, method, path, body in cases:
            status = await request(app, method, path, body)
            assert status == 200, f"{label}: HTTP {status}"
            rounds = []
            for _ in range(5):
                start = time.process_time()
                for _ in range(n):
                    await request(app, method, path, body)
                rounds.append((time.process_time() - start) / n * 1e6)
            results.append((label, statistics.median(rounds)))
    return results


CYCLE_MODES: List[Tuple[str, ServerLimits]] = [
    ("worker threads", ServerLimits(inline_calls=False, async_calls=False)),
    ("async", ServerLimits(inline_calls=False, async_calls=True)),
    ("inline", ServerLimits(inline_calls=True)),
]


async def rollout_cycles(store: LightningStore, limits: ServerLimits, n: int) -> float:
    """Server CPU microseconds per rollout cycle (four requests) with the store's calls made as ``limits`` say."""
    resources = await store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:1/v1", model="bench")})
    app = create_app(store, tokens=TokenSet({"bench": TOKEN}), limits=limits)
    requests = [EnqueueRequest(input={"i": i}, resources_id=resources.resources_id) for i in range(n + 20)]
    await store.enqueue_many(requests)
    claim = b'{"runner_id": "bench", "limit": 1, "timeout": 0}'
    spent = 0.0
    async with app.router.lifespan_context(app):
        for i in range(n + 20):  # the first 20 warm up
            start = time.process_time()
            status, body = await answer(app, "POST", "/v1/rollouts/dequeue", claim)
            assert status == 200, body
            claimed = time.process_time()
            rollout = Rollout.model_validate(json.loads(body)["rollouts"][0])  # the client's work: not counted
            assert rollout.attempt is not None
            spans = b'{"spans": ' + to_json([make_span(rollout, k) for k in range(4)]) + b"}"
            attempt = f"/v1/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt.attempt_id}"
            resume = time.process_time()
            assert await request(app, "POST", "/v1/spans", spans) == 200
            assert await request(app, "GET", "/v1/resources", b"") == 200
            assert await request(app, "POST", attempt + "/complete", b'{"status": "succeeded", "reward": 1.0}') == 200
            if i >= 20:
                spent += (claimed - start) + (time.process_time() - resume)
    return spent / n * 1e6


@contextlib.contextmanager
def cycle_stores(postgres: bool) -> Iterator[List[Tuple[str, Callable[[], LightningStore]]]]:
    """(label, fresh store) for the rollout-cycle rows."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        counter = iter(range(1000))
        stores: List[Tuple[str, Callable[[], LightningStore]]] = [
            ("SQLite", lambda: SqliteLightningStore(os.path.join(tmp, f"cycles-{next(counter)}.db")))
        ]
        if postgres:
            try:
                from agl.store.postgres.store import PostgresLightningStore
                from agl.testing.postgres import TemporaryPostgres

                server = stack.enter_context(TemporaryPostgres(durable=True))
                stores.append(("PostgreSQL", lambda: PostgresLightningStore(server.create_database())))
            except Exception as exc:  # noqa: BLE001 - say so and measure the rest
                print(f"PostgreSQL: not measured ({type(exc).__name__}: {exc})")
        yield stores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per round (5 rounds per endpoint)")
    parser.add_argument("--cycles", type=int, default=1500, help="rollout cycles per store and mode")
    parser.add_argument("--no-postgres", action="store_true", help="skip the PostgreSQL rows")
    args = parser.parse_args()
    print(f"{'request (in-process ASGI, in-memory store)':<50} {'CPU us/request':>15}")
    for label, micros in asyncio.run(measure(args.requests)):
        print(f"{label:<50} {micros:>15.1f}")
    print()
    print(f"{'rollout cycle, 4 requests (server process CPU)':<50}" + "".join(f" {m:>15}" for m, _ in CYCLE_MODES))
    with cycle_stores(not args.no_postgres) as stores:
        for label, make in stores:
            cells = []
            for mode, limits in CYCLE_MODES:
                store = make()
                try:
                    if mode == "async" and not isinstance(store, AsyncRolloutCalls):
                        cells.append("n/a")
                    else:
                        cells.append(f"{asyncio.run(rollout_cycles(store, limits, args.cycles)):.0f}")
                finally:
                    store.close()
            print(f"{label + ' (us per cycle)':<50}" + "".join(f" {c:>15}" for c in cells))


if __name__ == "__main__":
    main()
