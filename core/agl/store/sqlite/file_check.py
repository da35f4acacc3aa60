"""Whether a SQLite file is an agl store this agl can use, found out without writing to it: a mistyped
``--store`` must never alter another application's database."""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import urllib.parse
from typing import Dict, Tuple

from agl.errors import AglError, StoreAddressError, StoreNotFoundError
from agl.store.sqlite.schema import SCHEMA, SCHEMA_VERSION


@functools.cache
def _agl_tables() -> Dict[str, Tuple[str, ...]]:
    """agl's tables and their columns, read from an in-memory database made from ``SCHEMA`` (one source)."""
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        conn.executescript(SCHEMA)
        return _tables(conn)


def _tables(conn: sqlite3.Connection) -> Dict[str, Tuple[str, ...]]:
    """The file's own tables (not SQLite's internal ones) and their columns; reads only."""
    names = [
        row[0]
        for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY "
            "name"
        )
    ]
    return {name: tuple(c for (c,) in conn.execute("SELECT name FROM pragma_table_info(?)", (name,))) for name in names}


def _foreign_tables(conn: sqlite3.Connection) -> Dict[str, Tuple[str, ...]]:
    """The tables of the file that carry one of agl's table names with other columns (another application's
    ``spans``): agl would read that application's rows as its own and fail on its first write."""
    agl = _agl_tables()
    return {name: cols for name, cols in _tables(conn).items() if name in agl and cols != agl[name]}


def _not_a_store(path: str, tables: Dict[str, Tuple[str, ...]]) -> str:
    """Why the SQLite file at ``path`` (holding ``tables``) is not an agl store, and what to pass instead."""
    agl = _agl_tables()
    clashes = [
        f"its table {name!r} has other columns ({', '.join(cols)})"
        for name, cols in tables.items()
        if name in agl and cols != agl[name]
    ]
    what = (
        (
            f"a SQLite database (tables: {', '.join(tables)}) but not an agl store"
            + (f" ({'; '.join(clashes)})" if clashes else "")
        )
        if tables
        else "an empty SQLite file, not an agl store"
    )
    return (
        f"{path} is {what}; agl left it untouched: pass the store file an agl run wrote (e.g. its OUT/store.db), "
        "or a path that does not exist yet for a new store"
    )


def _newer_agl_error(path: str, version: int) -> AglError:
    return AglError(
        f"{path} was written by a newer agl (store schema {version}, this agl knows {SCHEMA_VERSION}): "
        "upgrade agl, or use another store file"
    )


def check_existing_store(path: str, busy_timeout: float = 30.0) -> None:
    """Raise unless ``path`` is an agl store this agl can read, writing nothing to the file: a missing file
    raises StoreNotFoundError, another application's SQLite database (or an empty file) StoreAddressError."""
    if not os.path.exists(path):
        raise StoreNotFoundError(f"no store at {path}: the file does not exist")
    uri = f"file:{urllib.parse.quote(path)}?mode=rw"  # never creates the file
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=busy_timeout)) as conn:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = _tables(conn)
    if version > SCHEMA_VERSION:
        raise _newer_agl_error(path, version)
    agl = _agl_tables()
    if version == 0 or any(tables.get(name) != cols for name, cols in agl.items()):
        raise StoreAddressError(_not_a_store(path, tables))
