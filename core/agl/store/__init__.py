"""Stores: where trainers and runners meet. ``open_store`` picks a backend from a URL or path."""

from __future__ import annotations

import os
import re
from typing import Optional

from agl.errors import StoreNotFoundError, UnsupportedStoreError
from agl.store.base import EnqueueRequest, LightningStore, StoreStats
from agl.store.memory import InMemoryLightningStore
from agl.store.sqlite import SqliteLightningStore

__all__ = [
    "DEFAULT_STORE_PATH",
    "EnqueueRequest",
    "InMemoryLightningStore",
    "LightningStore",
    "SqliteLightningStore",
    "StoreStats",
    "open_store",
]

#: Where ``open_store(None)`` keeps its SQLite file when ``$AGL_STORE`` is not set (relative to the cwd).
DEFAULT_STORE_PATH = os.path.join(".agl", "store.db")

_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
#: libpq's key=value connection strings ("host=db dbname=agl user=agl"): a known keyword, then '='
_LIBPQ_KEY_VALUE = re.compile(r"^(host|hostaddr|port|dbname|user|password|service|sslmode|options)\s*=", re.I)


def open_store(url_or_path: Optional[str] = None, *, create: bool = True) -> LightningStore:
    """The store ``url_or_path`` names. ``create=False`` (what only reads, e.g. ``agl inspect``): a SQLite file
    that does not exist raises :class:`~agl.errors.StoreNotFoundError` instead of becoming a new, empty store.

    - ``None``: ``$AGL_STORE`` if set (any form below), else the SQLite file ``./.agl/store.db``.
    - ``"memory"`` or ``"memory://"``: a new in-memory store (this process only).
    - ``"sqlite:///relative.db"``, ``"sqlite:////absolute.db"`` or a path ending in ``.db``, ``.sqlite`` or
      ``.sqlite3``: a SQLite file, created with its folder if missing.
    - ``"http://host:port"`` (or https): a store server (``agl store serve``), through
      :class:`~agl.store.remote.RemoteLightningStore`; the token comes from ``$AGL_STORE_TOKEN``.

    - ``"postgresql://user:password@host:5432/database"`` (or ``postgres://``), or a libpq ``key=value``
      string (``"host=db port=5432 dbname=agl user=agl"``): a PostgreSQL database, through
      :class:`~agl.store.postgres.PostgresLightningStore` (the ``postgres`` extra).
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
            raise ValueError(
                f"store URL {target!r} names no file: write sqlite:///relative/path.db or sqlite:////absolute/path.db "
                "(for a store in memory use 'memory')"
            )
        return _sqlite(path, create)
    if scheme in ("http", "https"):
        from agl.store.remote import RemoteLightningStore  # token from $AGL_STORE_TOKEN

        return RemoteLightningStore(target)
    if not scheme and target.lower().endswith(_SQLITE_SUFFIXES):
        return _sqlite(os.path.expanduser(target), create)
    if scheme in ("postgresql", "postgres") or (not scheme and _LIBPQ_KEY_VALUE.match(target)):
        try:
            from agl.store.postgres import PostgresLightningStore  # psycopg is the `postgres` extra
        except ImportError as exc:
            raise UnsupportedStoreError(f"store URL {target!r}: {exc}") from exc
        return PostgresLightningStore(target)
    raise ValueError(
        f"cannot tell which store {target!r} names: use 'memory', 'sqlite:///path.db' or a path ending in "
        f"{', '.join(_SQLITE_SUFFIXES)}, http://host:port (agl store serve), or postgresql://user@host/database "
        "(or libpq's 'host=... dbname=...')"
    )


def _sqlite(path: str, create: bool) -> SqliteLightningStore:
    if not create and not os.path.exists(path):
        raise StoreNotFoundError(
            f"no store at {path}: the file does not exist (the default is $AGL_STORE, else {DEFAULT_STORE_PATH} in "
            "the current folder; pass --store with the path the run wrote, e.g. its OUT/store.db)"
        )
    return SqliteLightningStore(path)
