"""Fixtures for the store contract suite: every test runs against each backend."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest
from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore
from agl.types import Rollout, Span

BACKENDS = ["memory", "sqlite"]

_span_ids = itertools.count(1)


def make_store(backend: str, directory: Path) -> LightningStore:
    if backend == "memory":
        return InMemoryLightningStore()
    return SqliteLightningStore(directory / "store.db")


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LightningStore]:
    """A fresh store of each backend (SQLite on a real file)."""
    s = make_store(request.param, tmp_path)
    yield s
    s.close()


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
