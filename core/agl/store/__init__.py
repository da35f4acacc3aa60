"""Stores: where trainers and runners meet. ``open_store`` picks a backend from a URL or path."""

from __future__ import annotations

import os
import re
import sqlite3
from typing import Any, Optional

from agl.errors import StoreAddressError, StoreNotFoundError, UnsupportedStoreError
from agl.store.base import (
    EnqueueRequest,
    LightningStore,
    LightningStoreCapabilities,
    LightningStoreStatistics,
    StoreStats,
)
from agl.store.memory import InMemoryLightningStore
from agl.store.sqlite.store import SqliteLightningStore

__all__ = [
    "DEFAULT_STORE_PATH",
    "CollectionBasedLightningStore",
    "EnqueueRequest",
    "InMemoryLightningStore",
    "LightningStore",
    "LightningStoreCapabilities",
    "LightningStoreClient",
    "LightningStoreServer",
    "LightningStoreStatistics",
    "LightningStoreThreaded",
    "MongoLightningStore",
    "SqliteLightningStore",
    "StoreStats",
    "open_store",
]

#: Agent Lightning's store classes (agl.store.peer), imported when first asked for: they need the HTTP client.
_PEER = frozenset(
    {
        "CollectionBasedLightningStore",
        "LightningStoreClient",
        "LightningStoreServer",
        "LightningStoreThreaded",
        "MongoLightningStore",
    }
)


def __getattr__(name: str) -> Any:
    if name in _PEER:
        from agl.store import peer

        return getattr(peer, name)
    raise AttributeError(f"module 'agl.store' has no attribute {name!r}")


#: Where ``open_store(None)`` keeps its SQLite file when ``$AGL_STORE`` is not set (relative to the cwd).
DEFAULT_STORE_PATH = os.path.join(".agl", "store.db")

_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
#: libpq's key=value connection strings ("host=db dbname=agl user=agl"): a known keyword, then '='
_LIBPQ_KEY_VALUE = re.compile(r"^(host|hostaddr|port|dbname|user|password|service|sslmode|options)\s*=", re.I)
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d+/?$")  # a store server's address without http://
_KINDS = (
    f"'memory', 'sqlite:///path.db' or a path ending in {', '.join(_SQLITE_SUFFIXES)}, http://host:port "
    "(agl store serve), or postgresql://user@host/database (or libpq's 'host=... dbname=...')"
)


def open_store(url_or_path: Optional[str] = None, *, create: bool = True) -> LightningStore:
    """The store ``url_or_path`` names. ``create=False`` (what only reads, e.g. ``agl inspect``): a SQLite file
    that does not exist raises :class:`~agl.errors.StoreNotFoundError` instead of becoming a new, empty store,
    and an existing SQLite file that is not an agl store (another application's, an empty one)
    :class:`~agl.errors.StoreAddressError`, without anything written to it.

    - ``None``: ``$AGL_STORE`` if set (any form below), else the SQLite file ``./.agl/store.db``.
    - ``"memory"`` or ``"memory://"``: a new in-memory store (this process only).
    - ``"sqlite:///relative.db"``, ``"sqlite:////absolute.db"`` or a path ending in ``.db``, ``.sqlite`` or
      ``.sqlite3``: a SQLite file, created with its folder if missing.
    - ``"http://host:port"`` (or https): a store server (``agl store serve``), through
      :class:`~agl.store.http.client.RemoteLightningStore`; the token comes from ``$AGL_STORE_TOKEN``.

    - ``"postgresql://user:password@host:5432/database"`` (or ``postgres://``), or a libpq ``key=value``
      string (``"host=db port=5432 dbname=agl user=agl"``): a PostgreSQL database, through
      :class:`~agl.store.postgres.store.PostgresLightningStore` (the ``postgres`` extra).
    """
    if url_or_path is None:
        url_or_path = os.environ.get("AGL_STORE") or DEFAULT_STORE_PATH
    target = url_or_path.strip()
    scheme = target.split("://", 1)[0].lower() if "://" in target else ""
    if target.lower() in ("memory", "memory://"):
        return InMemoryLightningStore()
    if scheme == "sqlite":
        path = target[len("sqlite:///") :] if target.startswith("sqlite:///") else ""
        if not path or path == ":memory:":
            raise StoreAddressError(
                f"store URL {target!r} names no file: write sqlite:///relative/path.db or sqlite:////absolute/path.db "
                "(for a store in memory use 'memory')"
            )
        return _sqlite(path, create)
    if scheme in ("http", "https"):
        from agl.store.http.client import RemoteLightningStore  # token from $AGL_STORE_TOKEN

        return RemoteLightningStore(target)
    if not scheme and target.lower().endswith(_SQLITE_SUFFIXES):
        return _sqlite(os.path.expanduser(target), create)
    if scheme in ("postgresql", "postgres") or (not scheme and _LIBPQ_KEY_VALUE.match(target)):
        try:
            from agl.store.postgres.store import PostgresLightningStore  # psycopg is the `postgres` extra
        except ImportError as exc:
            raise UnsupportedStoreError(f"store URL {target!r}: {exc}") from exc
        return PostgresLightningStore(target)
    raise StoreAddressError(_unknown(target, scheme))


def _unknown(target: str, scheme: str) -> str:
    """Why ``target`` names no store, and what to pass instead (the CLI prints it as its one line)."""
    if _HOST_PORT.match(target):
        return f"store {target!r} has no scheme: for a store server write http://{target.rstrip('/')}"
    if scheme:
        return f"store URL {target!r}: agl has no {scheme}:// stores; use {_KINDS}"
    if os.path.isdir(target):
        return _folder(target)
    return f"cannot tell which store {target!r} names (a SQLite store's file name ends in .db): use {_KINDS}"


def _folder(path: str) -> str:
    return f"store {path!r} is a folder, not a store file: pass a file in it, e.g. {os.path.join(path, 'store.db')}"


def _sqlite(path: str, create: bool) -> SqliteLightningStore:
    """The SQLite store at ``path``; a folder, or a file SQLite cannot read, raises StoreAddressError (in the
    CLI, one line saying so) rather than sqlite3's own error from deep inside the store."""
    if os.path.isdir(path):
        raise StoreAddressError(_folder(path))
    if not create and not os.path.exists(path):
        raise StoreNotFoundError(
            f"no store at {path}: the file does not exist (the default is $AGL_STORE, else {DEFAULT_STORE_PATH} in "
            "the current folder; pass --store with the path the run wrote, e.g. its OUT/store.db)"
        )
    try:
        return SqliteLightningStore(path, create=create)
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError):  # locked, no permission: not a question of the address
            raise
        raise StoreAddressError(
            f"{path} is not a SQLite store ({exc}): pass a store file agl made, or a path that does not exist yet "
            "for a new store"
        ) from exc
