"""What the store server's HTTP layer costs per request, without sockets: CPU microseconds per request.

    python benchmarks/server_overhead.py [--requests 3000]

The app of ``agl store serve`` (``create_app``) over an in-memory store is called as an ASGI app, in this
process, with the requests a runner makes (and ``/healthz``, which has no token check and no store call,
as the floor). No uvicorn, no network, no client: the figure is FastAPI's routing, dependency solving,
validation and response, plus agl's handlers and a store call that costs a few microseconds. It is what
to measure when changing the server's HTTP layer; ``store_load.py`` gives the end-to-end figures.

Prints process CPU time per request (median of 5 rounds) and exits 0: measurements, not assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any, Dict, List, Tuple

from agl.store import EnqueueRequest, InMemoryLightningStore
from agl.store.server import TokenSet, create_app
from agl.types import LLM

TOKEN = "bench-token"


def scope(method: str, path: str, body: bytes, query: bytes = b"") -> Dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
        "headers": [(b"host", b"bench"), (b"authorization", f"Bearer {TOKEN}".encode()),
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {},
    }


async def request(app: Any, method: str, path: str, body: bytes = b"") -> int:
    """One request through the ASGI app; returns the status code."""
    sent: List[Dict[str, Any]] = []

    async def receive() -> Dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)

    await app(scope(method, path, body), receive, send)
    return int(sent[0]["status"])


async def measure(n: int) -> List[Tuple[str, float]]:
    store = InMemoryLightningStore()
    store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:1/v1", model="bench")})
    app = create_app(store, tokens=TokenSet({"bench": TOKEN}))
    store.enqueue_many([EnqueueRequest(input={"i": 1})])
    rollout = store.dequeue_many("bench", 1)[0]
    assert rollout.attempt is not None
    attempt = f"/v1/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt.attempt_id}"
    cases = [
        ("GET /healthz (floor: no token check, no store)", "GET", "/healthz", b""),
        ("GET /v1/resources", "GET", "/v1/resources", b""),
        ("GET /v1/stats", "GET", "/v1/stats", b""),
        ("POST .../heartbeat", "POST", attempt + "/heartbeat", b""),
        ("POST /v1/rollouts/dequeue (nothing queued)", "POST", "/v1/rollouts/dequeue",
         b'{"runner_id": "bench", "limit": 1, "timeout": 0}'),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per round (5 rounds per endpoint)")
    args = parser.parse_args()
    print(f"{'request (in-process ASGI, in-memory store)':<50} {'CPU us/request':>15}")
    for label, micros in asyncio.run(measure(args.requests)):
        print(f"{label:<50} {micros:>15.1f}")


if __name__ == "__main__":
    main()
