"""A disk that fills up and empties again, for SQLite stores, without root: SQLite's ``PRAGMA max_page_count``
makes SQLite itself fail a write that would grow the file with SQLITE_FULL ("database or disk is full"), the
error of a full disk, and raising the limit again frees the "disk".

Once :func:`limited` replaces ``SqliteDatabase._begin_operation`` in a process, every store operation there
sets the limit on its connection: the file's current size while the ``control`` file exists, none otherwise.
``auto_vacuum = FULL`` (which only a new store's first operation takes, before its tables exist) gives freed
pages back to the file system at each commit, so a write that needs a page finds none free and fails, as on a
full disk, instead of reusing the pages of an earlier one.

Run as a script, it is ``agl ARGS...`` with that done first, the control file named by ``$AGL_TEST_DISK_FULL``:
``agl runner`` in a child process on a disk the test fills and empties.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Callable

from agl.store.sqlite.database import SqliteDatabase

CONTROL_ENV = "AGL_TEST_DISK_FULL"
NO_LIMIT = 1_073_741_823  # pages: SQLite's default max_page_count


def limited(control: Path) -> Callable[[SqliteDatabase], sqlite3.Connection]:
    """``SqliteDatabase._begin_operation`` on a disk that is full while ``control`` exists."""
    begin = SqliteDatabase._begin_operation

    def begin_on_a_disk_that_fills(store: SqliteDatabase) -> sqlite3.Connection:
        conn = begin(store)
        conn.execute("PRAGMA auto_vacuum = FULL")
        # a limit below the file's size is raised to its size: no page can be added
        conn.execute(f"PRAGMA max_page_count = {1 if control.exists() else NO_LIMIT}")
        return conn

    return begin_on_a_disk_that_fills


if __name__ == "__main__":
    setattr(SqliteDatabase, "_begin_operation", limited(Path(os.environ[CONTROL_ENV])))  # noqa: B010
    from agl.cli import main

    sys.exit(main(sys.argv[1:]))
