"""Shared fixtures: one fake OpenAI server per test session, reset for every test that uses it; the bundled
examples run as their docstrings say."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, List, Optional

import pytest

import agl
from agl.testing import FakeOpenAIServer, ListSink, tracer_writes_to
from agl.testing.extras import missing_for
from agl.types import Rollout

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TESTS = Path(__file__).resolve().parent
_LEFT_OUT: List[str] = []


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> Optional[bool]:
    """A run over a folder above one whose packages this venv lacks leaves it out, with a line in the summary
    (a run naming that folder itself still collects it, and fails on what is missing)."""
    line = missing_for(TESTS, collection_path)
    if line is None:
        return None
    above = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    if any(collection_path != path and collection_path.is_relative_to(path) for path in above):
        _LEFT_OUT.append(line)
    return True


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _LEFT_OUT:
        terminalreporter.write_line(line)


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
def instrumented() -> Iterator[None]:
    """``agl.instrument()`` for the test: the hooks stay in until it ends, as in a script that calls it."""
    agl.instrument()
    yield
    agl.uninstrument()


@pytest.fixture
def fake_trainer(fake_openai: FakeOpenAIServer) -> Callable[..., agl.Trainer]:
    """``fake_trainer(store, model="m", **options)``: an ``agl.Trainer`` on ``store`` with thread runners and no
    progress bar, whose ``main_llm`` is ``model`` on the fake OpenAI server; ``options`` add or override."""

    def make(store: Any, model: str = "m", **options: Any) -> agl.Trainer:
        llm = agl.LLM(endpoint=fake_openai.base_url, model=model)
        settings = {"runner_mode": "thread", "initial_resources": {"main_llm": llm}, "progress": False}
        return agl.Trainer(**{"store": store, **settings, **options})

    return make


@pytest.fixture
def chat_helpers(client: Any) -> Any:
    """The SDK's chat helpers (``parse``, ``stream``) of the test's ``client``: ``client.chat.completions``
    on openai >= 1.92, ``client.beta.chat.completions`` on the older releases agl supports (``nox -s lowest``)."""
    return client.chat.completions if hasattr(client.chat.completions, "parse") else client.beta.chat.completions


@pytest.fixture
def sink() -> Iterator[ListSink]:
    """The global tracer writes to a fresh ListSink during the test."""
    with tracer_writes_to(ListSink()) as list_sink:
        yield list_sink


@pytest.fixture
def dev_example(tmp_path: Path) -> Callable[[str, str], List[Rollout]]:
    """Runs ``agl dev examples/TARGET --data examples/data/calc_tasks.jsonl --fake-model`` (the command each
    example's docstring gives) in this process, into a temporary store, and checks what it must show: every
    task succeeds, the fake model (it calls the first tool, ``add``) is right on exactly the additions, and
    the ``agent_match`` the docstring names selects every LLM call of the agent (at least one per task).
    Returns the rollouts."""

    def run(target: str, agent_match: str) -> List[Rollout]:
        from agl.cli import main
        from agl.lightningrl.agent_match import select_llm_calls
        from agl.store import SqliteLightningStore

        db = tmp_path / "example.db"
        command = ["dev", str(EXAMPLES / target), "--data", str(EXAMPLES / "data" / "calc_tasks.jsonl"), "--fake-model"]
        assert main(command + ["--store", str(db), "--runner-mode", "thread"]) == 0
        store = SqliteLightningStore(db)
        try:
            rollouts = store.query_rollouts()
            for rollout in rollouts:
                spans = store.query_spans(rollout.rollout_id)
                calls = [s.span_id for s in spans if s.kind == "llm"]
                assert calls and [s.span_id for s in select_llm_calls(spans, agent_match)] == calls
        finally:
            store.close()
        assert len(rollouts) == 20 and {r.status for r in rollouts} == {"succeeded"}
        assert {r.input["question"]: r.final_reward for r in rollouts} == {
            r.input["question"]: float(" plus " in r.input["question"]) for r in rollouts
        }
        return rollouts

    return run
