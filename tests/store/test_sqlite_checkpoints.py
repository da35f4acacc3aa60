"""SQLite WAL checkpoints run on agl's background thread, not inside the commits of store writes."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from agl.store import SqliteLightningStore
from agl.store.sqlite import database as sqlite_module
from agl.testing.spans import incompressible_text

fork = multiprocessing.get_context("fork")
HEAVY = {"payload": incompressible_text(9_000)}  # a row of ~9 KB, as a long LLM span is


def _write_heavy(store: SqliteLightningStore, make_span: Any, n: int, batch: int = 50) -> None:
    rollout = store.enqueue_rollout(input=None)
    rollout = store.dequeue_rollout("writer")
    assert rollout is not None
    for start in range(0, n, batch):
        store.add_spans([make_span(rollout, i, attributes=HEAVY) for i in range(start, min(start + batch, n))])


def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_pages_reach_the_database_file_without_a_commit_checkpointing(
    sqlite_store: SqliteLightningStore, make_span: Any
) -> None:
    # ~500 frames: far below the commits' backstop (BACKSTOP_PAGES), so only the background thread copies them
    path = Path(sqlite_store.path)
    before = path.stat().st_size
    _write_heavy(sqlite_store, make_span, 400)
    assert os.path.getsize(f"{path}-wal") > 3_000_000  # the writes went to the WAL
    assert _eventually(lambda: path.stat().st_size > before + 3_000_000), "no background checkpoint copied the WAL back"
    assert len(sqlite_store.query_spans(sqlite_store.query_rollouts()[0].rollout_id)) == 400


def test_back_to_back_writes_keep_the_wal_bounded(
    tmp_path: Path, make_span: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passive checkpoints alone never let the WAL restart while writes go on; the commits' backstop does."""
    monkeypatch.setattr(sqlite_module, "BACKSTOP_PAGES", 200)
    store = SqliteLightningStore(tmp_path / "store.db")
    try:
        _write_heavy(store, make_span, 2_000)  # ~2,500 frames of 8 KiB, back to back
        frames = os.path.getsize(tmp_path / "store.db-wal") // (8192 + 24)
        assert frames < 600, f"the WAL holds {frames} frames after 2,500 written with a backstop of 200"
    finally:
        store.close()


def test_closing_the_store_leaves_no_wal_behind(tmp_path: Path, make_span: Any) -> None:
    store = SqliteLightningStore(tmp_path / "store.db")
    _write_heavy(store, make_span, 100)
    db = tmp_path / "store.db"
    before = db.stat().st_size
    assert _eventually(lambda: db.stat().st_size > before)  # the background thread has a connection now
    store.close()
    assert not (tmp_path / "store.db-wal").exists()  # its connection closed first, the store's last
    reopened = SqliteLightningStore(db)
    try:
        assert reopened.stats().spans == 100
    finally:
        reopened.close()


def _child_writes(store: SqliteLightningStore, make_span: Any, done: Any) -> None:
    path = Path(store.path)
    before = path.stat().st_size
    _write_heavy(store, make_span, 400)
    if _eventually(lambda: path.stat().st_size > before + 3_000_000):
        done.set()


def test_a_forked_child_checkpoints_on_its_own_thread(sqlite_store: SqliteLightningStore, make_span: Any) -> None:
    _write_heavy(sqlite_store, make_span, 10)  # the parent's thread holds a connection across the fork
    done = fork.Event()
    child = fork.Process(target=_child_writes, args=(sqlite_store, make_span, done))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and done.is_set()
    assert sqlite_store.stats().spans == 410


def test_closed_stores_leave_nothing_behind_in_the_checkpoint_thread(tmp_path: Path, make_span: Any) -> None:
    """A process that opens and closes many store files (a test suite, a trainer making scratch stores)
    does not accumulate per-file state in the process-wide checkpoint thread."""
    from agl.store.sqlite.checkpoints import checkpointer

    for i in range(5):
        store = SqliteLightningStore(tmp_path / f"store-{i}.db")
        _write_heavy(store, make_span, 10)
        store.close()
    paths = {str(tmp_path / f"store-{i}.db") for i in range(5)}
    assert _eventually(lambda: not paths & (checkpointer._released | set(checkpointer._conns)))
