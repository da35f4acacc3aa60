"""Fixtures for instrumentation tests: a list sink on the global tracer, a hooked client, rollout scopes."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterator, List, Optional

import openai
import pytest

import agl.instrumentation
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.testing import FakeOpenAIServer, ListSink, tracer_writes_to
from agl.tracing.context import RolloutScope, enter_scope, exit_scope
from agl.types import Span


class LlmSink(ListSink):
    """These tests look at llm spans: ``of`` returns those unless told otherwise."""

    def of(self, rollout_id: str, kind: Optional[str] = "llm") -> List[Span]:
        return super().of(rollout_id, kind)


@pytest.fixture
def sink() -> Iterator[LlmSink]:
    with tracer_writes_to(LlmSink()) as llm_sink:
        yield llm_sink


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
        scope.end_open_work()  # as agl.tracing.context.rollout_scope and the runner do


@pytest.fixture
def rollout() -> Any:
    """``with rollout() as scope:`` runs the block in a rollout with a fresh id (tests never share spans)."""
    return _rollout
