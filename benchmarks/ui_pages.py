"""How fast the web view (agl.ui) answers on a big store: the rollouts list's first, middle and last pages
(LIMIT/OFFSET through ``query_rollouts``), a filtered page, and the training view.

    python benchmarks/ui_pages.py [--rollouts 100000] [--store PATH] [--repeat 5]

The store is a temporary SQLite file holding ``--rollouts`` finished rollouts in 50 steps (one resources
version each, a tenth of them in val mode), made with ``enqueue_many``/``dequeue_many``/``complete_attempt``;
``--store`` keeps it (and reuses it when it exists). Each page is fetched through FastAPI's TestClient,
``--repeat`` times, and the median is printed: figures, not assertions (machines differ). The pages count the
rollouts with ``stats()`` at most every 5 s, so the medians leave that out; its own time is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

from fastapi.testclient import TestClient

from agl.store import EnqueueRequest, SqliteLightningStore
from agl.ui import create_ui

STEPS = 50
BATCH = 1000


def fill(store: SqliteLightningStore, n: int) -> None:
    """``n`` finished rollouts, ``n / STEPS`` per resources version; every seventh fails, rewards 0, 0.5, 1."""
    per_step = max(BATCH, n // STEPS)
    made = 0
    while made < n:
        resources_id = store.add_resources({}).resources_id
        for _ in range(0, per_step, BATCH):
            size = min(BATCH, n - made)
            if size <= 0:
                break
            modes = ["val" if (made + i) % 10 == 0 else "train" for i in range(size)]
            store.enqueue_many(
                [
                    EnqueueRequest(task_id=f"task-{(made + i) % 500}", mode=m, resources_id=resources_id)
                    for i, m in enumerate(modes)
                ]  # type: ignore[arg-type]
            )
            for i, rollout in enumerate(store.dequeue_many("bench", limit=size)):
                assert rollout.attempt is not None
                status = "failed" if i % 7 == 0 else "succeeded"
                store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status, reward=(i % 3) / 2)  # type: ignore[arg-type]
            made += size


def median_ms(get: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        get()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--store", default=None, help="keep the store here (reused when it exists)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    path = args.store or os.path.join(tempfile.mkdtemp(prefix="agl-ui-bench-"), "store.db")
    fresh = not os.path.exists(path)
    store = SqliteLightningStore(path)
    if fresh:
        started = time.perf_counter()
        fill(store, args.rollouts)
        print(f"filled {args.rollouts} rollouts in {time.perf_counter() - started:.1f} s ({path})")
    total = sum(store.stats().rollouts.values())
    client = TestClient(create_ui(store))
    pages = {
        "list, first page": "/",
        "list, middle page": f"/?offset={total // 2}",
        "list, last page": f"/?offset={max(0, total - 50)}",
        "list, failed, last page": f"/?status=failed&offset={max(0, store.stats().rollouts.get('failed', 0) - 50)}",
        "list, val mode, page 100": "/?mode=val&offset=5000",
        "training view (newest 5000)": "/training",
    }
    print(f"{total} rollouts; median of {args.repeat} fetches:")
    for name, page in pages.items():
        answer = client.get(page)
        assert answer.status_code == 200, (page, answer.status_code)
        print(f"  {name:30s} {median_ms(lambda page=page: client.get(page), args.repeat):8.1f} ms")
    stats_ms = median_ms(store.stats, args.repeat)
    print(f"  {'(store.stats(), once per 5 s)':30s} {stats_ms:8.1f} ms")
    store.close()


if __name__ == "__main__":
    main()
