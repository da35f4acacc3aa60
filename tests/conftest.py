"""Shared fixtures: one fake OpenAI server per test session, reset for every test that uses it."""

from __future__ import annotations

from collections.abc import Iterator
import pytest

from agl.testing import FakeOpenAIServer, ListSink, tracer_writes_to


@pytest.fixture(scope="session", autouse=True)
def _openai_api_key() -> Iterator[None]:
    """Frameworks refuse to build an OpenAI client without a key; a dummy one keeps real keys out of logs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENAI_API_KEY", "x")
        yield


@pytest.fixture(scope="session")
def _fake_openai_server() -> Iterator[FakeOpenAIServer]:
    """Started once: uvicorn's startup is the slow part, and a reset makes the server as good as new."""
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
def fake_openai(_fake_openai_server: FakeOpenAIServer) -> Iterator[FakeOpenAIServer]:
    """The running fake OpenAI server, its script and request log empty (point clients at ``.base_url``)."""
    _fake_openai_server.reset()
    yield _fake_openai_server
    _fake_openai_server.always_token_ids = False


@pytest.fixture
def sink() -> Iterator[ListSink]:
    """The global tracer writes to a fresh ListSink during the test."""
    with tracer_writes_to(ListSink()) as list_sink:
        yield list_sink
