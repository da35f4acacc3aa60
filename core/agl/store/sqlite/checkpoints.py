"""SQLite WAL checkpoints on a background thread, so that no store write waits for one.

Why: SQLite's automatic checkpoint runs inside the commit that takes the WAL past its threshold. It copies
the WAL's pages back into the database file and syncs it: ~60 ms for 4,000 pages of 8 KiB on this
project's development machine, while the caller of that commit waits (an end-of-rollout ``flush()`` that
hits one takes ~55 ms instead of ~2). Here one daemon thread per process runs a *passive* checkpoint (it
never blocks readers or writers, and releases the GIL while it copies) on its own connection shortly after
each burst of writes.

The stores' own connections keep an automatic checkpoint as a backstop (``BACKSTOP_PAGES``): while writes
go on back to back, passive checkpoints alone never let the WAL restart from its beginning (a writer only
restarts it when every frame has been copied back), so it would grow without bound. The backstop's
checkpoint, in a commit, then finds almost everything copied already. ``journal_size_limit`` truncates the
WAL file when it restarts, so a burst does not leave it large on disk.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from typing import Any, Dict, Optional, Set

from agl._util.fork_safety import hold_across_fork, keep_unused

logger = logging.getLogger("agl.store")

BACKSTOP_PAGES = 16_000  # PRAGMA wal_autocheckpoint of the stores' connections (128 MB of 8 KiB pages)
WAL_SIZE_LIMIT = 64 << 20  # PRAGMA journal_size_limit: the WAL file is truncated to this when it restarts
DELAY = 0.05  # seconds from a write to its checkpoint: one checkpoint for a burst of commits
IDLE_CLOSE = 10.0  # seconds without writes after which the thread closes its connection to a file


class Checkpointer:
    """The process's checkpoint thread and its connections, one per store file written in this process.

    Stores call :meth:`written` after each commit (well under a microsecond) and :meth:`release` when they
    close. After ``os.fork`` the child starts with no thread and no connections: the parent's are kept in
    ``agl._util.fork_safety``, never used or closed there (closing would checkpoint the parent's file).
    """

    def __init__(self) -> None:
        self._reset()
        self._held_for_fork: Optional[Any] = None
        os.register_at_fork(after_in_child=self._reset)
        hold_across_fork(self)

    def _reset(self) -> None:
        self._dirty: Set[str] = set()  # written since their last checkpoint
        self._released: Set[str] = set()  # closed during the current round: not to be reopened by it
        self._dirty_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        self._conn_lock = threading.Lock()  # held while a connection is used or closed
        old = getattr(self, "_conns", None)
        if old:
            keep_unused(old.values())
        self._conns: Dict[str, sqlite3.Connection] = {}
        self._last_write: Dict[str, float] = {}

    def _before_fork(self) -> None:
        """No checkpoint or connection close runs across a fork (see ``agl._util.fork_safety``)."""
        self._held_for_fork = self._conn_lock
        self._held_for_fork.acquire()

    def _after_fork(self) -> None:
        lock, self._held_for_fork = self._held_for_fork, None
        if lock is not None:
            lock.release()

    def written(self, path: str) -> None:
        """A transaction was committed to ``path``: checkpoint it soon."""
        with self._dirty_lock:
            self._dirty.add(path)
            self._released.discard(path)
        if self._thread is None:
            self._start()
        if not self._wake.is_set():
            self._wake.set()

    def release(self, path: str) -> None:
        """A store of ``path`` closed: close this thread's connection to it, so that the last connection to
        close is the store's own (SQLite then folds the WAL back into the file and deletes it)."""
        with self._dirty_lock:
            self._dirty.discard(path)
            self._released.add(path)
        with self._conn_lock:
            self._drop(path)

    def _drop(self, path: str) -> None:
        """Close the thread's connection to ``path`` (under ``_conn_lock``)."""
        conn = self._conns.pop(path, None)
        self._last_write.pop(path, None)
        if conn is not None:
            conn.close()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name="agl-sqlite-checkpoints", daemon=True)
            self._thread = thread  # also when it cannot start: a commit must not retry (or fail) each time
            try:
                thread.start()
            except RuntimeError as exc:  # no threads left, or the interpreter is shutting down
                logger.warning("agl could not start its SQLite checkpoint thread (commits checkpoint instead): %s", exc)

    def _run(self) -> None:
        while True:
            if not self._wake.wait(IDLE_CLOSE if self._conns else None):
                self._close_idle()
                continue
            time.sleep(DELAY)
            self._wake.clear()  # before taking the set: a write after this wakes the next round
            with self._dirty_lock:
                paths, self._dirty = self._dirty, set()
            now = time.monotonic()
            for path in paths:
                self._last_write[path] = now
                self._checkpoint(path)
            with self._dirty_lock:  # a store closed before now is in no later round (release took it out of _dirty)
                self._released.clear()
            self._close_idle()

    def _checkpoint(self, path: str) -> None:
        with self._conn_lock:
            if path in self._released:  # closed while this round was starting
                return
            try:
                conn = self._conns.get(path)
                if conn is None:
                    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
                    conn.execute("PRAGMA synchronous = NORMAL")
                    self._conns[path] = conn
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:  # e.g. the file was deleted: the backstop still bounds the WAL
                logger.debug("agl: background checkpoint of %s failed: %s", path, exc)
                self._drop(path)

    def _close_idle(self) -> None:
        now = time.monotonic()
        for path, last in list(self._last_write.items()):
            if now - last > IDLE_CLOSE:
                with self._conn_lock:
                    self._drop(path)


checkpointer = Checkpointer()
