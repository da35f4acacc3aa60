"""Fixtures for the store contract suite: every test runs against each backend."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerLimits, ServerThread, TokenSet, create_app
from agl.testing.postgres import PostgresServer, PostgresUnavailableError, postgres_for_tests
from agl.types import Rollout, Span

BACKENDS = ["memory", "sqlite", "http", "postgres", "http-postgres"]

_span_ids = itertools.count(1)


class ServedStore(RemoteLightningStore):
    """The HTTP backends under test: a real uvicorn server on 127.0.0.1 over a store (a SQLite file, or a
    PostgreSQL database, whose rollout-cycle calls the server makes on its event loop), and its client.
    Closing the client also stops the server and closes the store behind it. The server's reap timer is off
    (an hour): the contract tests call ``reap_expired()`` themselves and read what it returned, which the timer
    took first now and then; test_http_server.py tests the timer."""

    def __init__(self, backing: LightningStore) -> None:
        self.backing = backing
        app = create_app(self.backing, tokens=TokenSet({"test": "test-token"}), limits=ServerLimits(reap_interval=3600))
        self.server = ServerThread(app).start()
        super().__init__(self.server.url, token="test-token", retries=2)

    def close(self) -> None:
        super().close()
        if os.getpid() == self._pid:
            self.server.stop(wait=False)  # its thread ends by itself; the suite does not wait for it
            self.backing.close()


def make_store(backend: str, directory: Path, postgres: Optional[PostgresServer] = None) -> LightningStore:
    if backend in ("postgres", "http-postgres"):
        assert postgres is not None, f"make_store({backend!r}, ...) needs the postgres_server fixture"
        store = postgres.open_store()  # an empty database of its own, given back when the store is closed
        return ServedStore(store) if backend == "http-postgres" else store
    if backend == "memory":
        return InMemoryLightningStore()
    if backend == "http":
        return ServedStore(SqliteLightningStore(directory / "served.db"))
    return SqliteLightningStore(directory / "store.db")


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LightningStore]:
    """A fresh store of each backend (SQLite on a real file, PostgreSQL in an empty database of a real server)."""
    postgres = request.getfixturevalue("postgres_server") if "postgres" in request.param else None
    s = make_store(request.param, tmp_path, postgres)
    yield s
    s.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL: $AGL_TEST_POSTGRES_DSN's server if set, else a throwaway one started here.

    Without PostgreSQL the tests that need it fail (never skip), saying how to install it.
    """
    try:
        with postgres_for_tests() as server:
            yield server
    except PostgresUnavailableError as exc:
        pytest.fail(f"these store tests need a PostgreSQL server: {exc}", pytrace=False)


@pytest.fixture
def postgres_dsn(postgres_server: PostgresServer) -> Iterator[str]:
    """An empty database holding the store's schema, for this test only."""
    with postgres_server.store_database() as dsn:
        yield dsn


@pytest.fixture
def stores_of_every_backend(postgres_server: PostgresServer) -> Callable[[Path], List[LightningStore]]:
    """``f(directory)`` -> one fresh store per backend, in BACKENDS order (for the state-machine test)."""
    return lambda directory: [make_store(backend, directory / backend, postgres_server) for backend in BACKENDS]


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SqliteLightningStore]:
    s = SqliteLightningStore(tmp_path / "store.db")
    yield s
    s.close()


def build_span(
    rollout: Rollout,
    sequence_id: int = 0,
    *,
    span_id: Optional[str] = None,
    attempt_id: Optional[str] = None,
    attributes: Optional[Dict[str, Any]] = None,
) -> Span:
    """A span of ``rollout``'s current attempt (or ``attempt_id``), with a fresh span id unless given."""
    now = time.time_ns()
    return Span(
        rollout_id=rollout.rollout_id,
        attempt_id=attempt_id or (rollout.attempt.attempt_id if rollout.attempt else "at-none"),
        sequence_id=sequence_id,
        trace_id="ab" * 16,
        span_id=span_id or f"{next(_span_ids):016x}",
        name=f"step-{sequence_id}",
        kind="llm",
        start_time=now,
        end_time=now + 1_000,
        attributes=attributes if attributes is not None else {"gen_ai.request.model": "tiny", "n": sequence_id},
    )


@pytest.fixture(name="make_span")
def make_span_fixture() -> Any:
    """:func:`build_span`, for tests (conftest modules are not importable by name)."""
    return build_span


@pytest.fixture
def dev_an_agent_that_fails() -> Callable[[LightningStore, str, str], Any]:
    """:func:`_dev_an_agent_that_fails`, for tests of every backend."""
    return _dev_an_agent_that_fails


def _dev_an_agent_that_fails(store: LightningStore, message: str, error: str) -> Any:
    """``Trainer.dev`` of one rollout whose agent emits ``message`` and raises ``error`` (text a backend may not
    store as it is: NUL, lone surrogates); checks that the rollout failed at once (not after its 60 s
    heartbeat timeout, as when the runner died on the completion) and returns its row."""
    import agl

    @agl.rollout
    def agent(task: Any) -> float:
        agl.emit_message(message)
        raise RuntimeError(error)

    trainer = agl.Trainer(n_runners=1, runner_mode="thread", store=store, heartbeat_timeout=60, progress=False)
    started = time.monotonic()
    [row] = trainer.dev(agent, [{"id": 1}], print_table=False)
    assert row.status == "failed" and time.monotonic() - started < 30
    return row
