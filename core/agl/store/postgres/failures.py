"""What a failed statement or connection means for the PostgreSQL store: retry it (nothing was committed),
report the commit's outcome as unknown, or raise the server's refusal (and a refused connection that
waiting will not cure)."""

from __future__ import annotations

from typing import Any, NoReturn, Optional

import psycopg
from psycopg import errors as pg_errors

from agl.errors import AglError, StoreStorageError

# The server rolled the transaction back and it may simply be run again.
_ROLLED_BACK = (pg_errors.TransactionRollback, pg_errors.DeadlockDetected, pg_errors.SerializationFailure)

# The server ended the session (shutdown, pg_terminate_backend) and said so: a statement it was running was
# aborted, not committed (a commit that completed was answered before the session ended).
_SESSION_ENDED = (pg_errors.AdminShutdown, pg_errors.CrashShutdown, pg_errors.CannotConnectNow)
# libpq before 17 (psycopg-binary < 3.2.4, or an older system libpq) reports that goodbye as a plain
# OperationalError without its SQLSTATE ("consuming input failed: terminating connection due to ..."); the
# server's words are still there (in English; a server in another language falls back to "commit unknown").
_SESSION_ENDED_WORDS = (
    "terminating connection due to administrator command",  # 57P01
    "terminating connection because of crash of another server process",  # 57P02
    "the database system is shutting down",  # 57P03
)

# The server's disk is full (53100) or failed a read or write (58030): the statement failed and its transaction
# was rolled back. An outage that passes once there is room, not a refusal of the operation.
_STORAGE_FAILED = (pg_errors.DiskFull, pg_errors.IoError)

# What the server says when it refuses a connection for good (libpq gives no SQLSTATE for a failed connection,
# only the server's words, in English; a server in another language falls back to being retried as an outage).
_REFUSED_FOR_GOOD_WORDS = (
    "does not exist",  # 3D000 (database), 28000 (role)
    "password authentication failed",  # 28P01
    "no pg_hba.conf entry",  # 28000
    "is not permitted to log in",  # 28000
    "permission denied for database",  # 42501: no CONNECT privilege
)


def _session_ended(exc: BaseException) -> bool:
    """Whether the server said it ended the session (so a statement it was running did not commit)."""
    if isinstance(exc, _SESSION_ENDED):
        return True
    return type(exc) is psycopg.OperationalError and any(words in str(exc) for words in _SESSION_ENDED_WORDS)


def _oneline(exc: Optional[BaseException]) -> str:
    """An error's message on one line (libpq's span several)."""
    return " ".join(str(exc).split())


class _CommitUnknown(Exception):
    """Internal: the connection died while a transaction was committing."""


def _raise_failure(exc: BaseException, conn: Any, committing: bool) -> NoReturn:
    """What a statement that failed with ``exc`` on ``conn`` means for the caller, raised: ``exc`` itself when
    nothing was committed and it may be retried, ``_CommitUnknown`` when the connection died while it may
    have been committing, StoreStorageError when the server's disk is full or failing, else an AglError (the
    server refused the operation)."""
    if committing and (conn.closed or conn.broken) and not _session_ended(exc):
        raise _CommitUnknown() from exc
    if isinstance(exc, _ROLLED_BACK) or conn.closed or conn.broken:
        raise exc  # nothing was committed: the caller retries
    if isinstance(exc, _STORAGE_FAILED):
        raise StoreStorageError(
            f"PostgreSQL could not store this change: its disk is full or failing ({_oneline(exc)}). Nothing of this "
            "call was stored. Free space on the database server's disk; runners wait for the store (up to their "
            "outage timeout) and the store server answers 503 meanwhile"
        ) from exc
    raise AglError(f"PostgreSQL refused the operation: {_oneline(exc)}") from exc


def _data_error(exc: BaseException) -> ValueError:
    return ValueError(
        f"PostgreSQL cannot store this value ({_oneline(exc)}); text must not contain NUL (\\x00) characters"
    )
