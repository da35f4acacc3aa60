"""Fixtures for instrumentation tests: a list sink on the global tracer, a hooked client, rollout scopes."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterator, List

import openai
import pytest

import agl.instrumentation
from agl.context import RolloutScope, enter_scope, exit_scope
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.testing import FakeOpenAIServer
from agl.tracer import get_tracer
from agl.types import Span


class ListSink:
    """The smallest store: keeps every span it is given."""

    def __init__(self) -> None:
        self.spans: List[Span] = []

    def add_spans(self, spans: List[Span]) -> None:
        self.spans.extend(spans)

    def of(self, rollout_id: str, kind: str = "llm") -> List[Span]:
        """The rollout's spans of ``kind``, in the order they were made (flushes first)."""
        assert get_tracer().flush(10)
        spans = [s for s in self.spans if s.rollout_id == rollout_id and s.kind == kind]
        return sorted(spans, key=lambda s: s.sequence_id)


@pytest.fixture
def sink() -> Iterator[ListSink]:
    tracer = get_tracer()
    previous = tracer.store
    sink = ListSink()
    tracer.set_store(sink)
    yield sink
    tracer.flush(10)
    tracer.set_store(previous)


@pytest.fixture
def instrumentor() -> Iterator[OpenAIInstrumentor]:
    agl.instrumentation.uninstrument()  # a test elsewhere may have left agl.instrument() on
    inst = OpenAIInstrumentor()
    assert inst.instrument()
    yield inst
    inst.uninstrument()


@pytest.fixture
def client(fake_openai: FakeOpenAIServer, instrumentor: OpenAIInstrumentor) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(fake_openai: FakeOpenAIServer, instrumentor: OpenAIInstrumentor) -> Any:
    async with openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0) as c:
        yield c


@contextlib.contextmanager
def _rollout(rollout_id: str = "", attempt_id: str = "at-1", **options: Any) -> Iterator[RolloutScope]:
    scope = RolloutScope(rollout_id=rollout_id or f"ro-{uuid.uuid4().hex[:8]}", attempt_id=attempt_id, **options)
    token = enter_scope(scope)
    try:
        yield scope
    finally:
        exit_scope(token)


@pytest.fixture
def rollout() -> Any:
    """``with rollout() as scope:`` runs the block in a rollout with a fresh id (tests never share spans)."""
    return _rollout
