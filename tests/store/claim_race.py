"""Runners racing for one store's queue: each claims rollouts (in batches of 1 to 3) and completes them until
the queue is empty, all starting at the same moment."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any, List

from agl.store import LightningStore

fork = multiprocessing.get_context("fork")


def drain(store: LightningStore, runner_id: str, out: List[str], start: Any) -> None:
    """Once ``start`` is set, claim and complete (reward 1.0) until the queue is empty; the ids go to ``out``."""
    start.wait(30)
    while True:
        batch = store.dequeue_many(runner_id, 1 + len(out) % 3)
        if not batch:
            return
        for rollout in batch:
            assert rollout.attempt is not None
            store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
            out.append(rollout.rollout_id)


def _drain_in_child(store: LightningStore, runner: int, out: Path, start: Any, close: bool) -> None:
    claimed: List[str] = []
    drain(store, f"process-{runner}", claimed, start)
    if close:
        store.close()  # closes the child's connections only
    out.write_text("\n".join(claimed))


def drain_in_forked_processes(store: LightningStore, directory: Path, close_in_child: bool = False) -> List[str]:
    """Three forked children drain ``store`` (the parent's object) together; the ids each claimed, in order."""
    outs = [directory / f"claimed-{i}.txt" for i in range(3)]
    start = fork.Event()
    procs = [
        fork.Process(target=_drain_in_child, args=(store, i, out, start, close_in_child)) for i, out in enumerate(outs)
    ]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    return [line for out in outs for line in out.read_text().split("\n") if line]
