"""A rollout that ran past its timeout sends the model server nothing more: not the openai SDK's own retries of a
call that was in flight at the timeout, and not a call made after the Trainer took out the hooks it set up.

Found by the timeout probe (session 26): with ``max_retries=3`` the SDK retried a call that the server failed
after the timeout, and all three retries reached the server beside the rollouts that replaced the timed-out one;
and a stuck agent's calls after ``dev()`` returned went through, as the Trainer had removed its own hooks (it
now keeps the OpenAI client hooked while such an agent runs)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List

import openai
import pytest

import agl
from agl.errors import RolloutTimedOutError
from agl.instrumentation.base import any_instrumented, is_hooked
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply

_TIMEOUT_S = 1.0  # the request is sent at once, so it is surely in flight when the rollout times out
_SEEN: List[BaseException] = []  # what the agent's model call raised
_AGENT_DONE = threading.Event()
_DEV_RETURNED = threading.Event()


def _ask(base_url: str, is_async: bool) -> None:
    """One model call with the SDK's retries on, as an OpenAI or an AsyncOpenAI client makes it."""
    messages = [{"role": "user", "content": "in flight"}]
    if is_async:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=2)
        asyncio.run(client.chat.completions.create(model="m", messages=messages))
    else:
        openai.OpenAI(base_url=base_url, api_key="x", max_retries=2).chat.completions.create(
            model="m", messages=messages
        )


def _recording(call: Callable[[], Any]) -> None:
    """Run the agent's model call and keep what it raised, for the test to read once the agent is done."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - kept for the test to read
        _SEEN.append(exc)
    finally:
        _AGENT_DONE.set()


@agl.rollout
def _retrying(task: Dict[str, Any], llm: agl.LLM) -> float:
    """A sync agent (the runner cannot stop it) whose call the SDK retries past the rollout's timeout."""
    _recording(lambda: _ask(llm.get_base_url(), task["async"]))
    return 1.0


@agl.rollout
def _calls_after_dev(task: Dict[str, Any], llm: agl.LLM) -> float:
    """A stuck agent holding ``create`` bound while the Trainer's hooks were in (a framework keeps such methods),
    which calls it after ``dev()`` returned and the hooks were taken out."""
    client = openai.OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0)
    create = client.chat.completions.create
    _DEV_RETURNED.wait(10)
    _recording(lambda: create(model=llm.model, messages=[{"role": "user", "content": "after dev"}]))
    return 1.0


@pytest.fixture
def run_one(tmp_path: Path, fake_openai: FakeOpenAIServer) -> Callable[[Any, Dict[str, Any]], Any]:
    """Runs ``agent`` on ``task`` in a thread runner with a short timeout; returns the rollout once its agent,
    which runs on past the timeout, is done."""
    _SEEN.clear()
    _AGENT_DONE.clear()
    _DEV_RETURNED.clear()

    def run(agent: Any, task: Dict[str, Any], after_dev: Callable[[], None] = lambda: None) -> Any:
        trainer = agl.Trainer(
            store=SqliteLightningStore(tmp_path / "s.db"),
            n_runners=1,
            runner_mode="thread",
            progress=False,
            rollout_timeout=_TIMEOUT_S,
            initial_resources={"llm": agl.LLM(endpoint=fake_openai.base_url, model="m")},
        )
        (row,) = trainer.dev(agent, [task], print_table=False)
        after_dev()
        _DEV_RETURNED.set()
        assert _AGENT_DONE.wait(20), "the agent's model call did not end"
        assert row.status in ("timeout", "failed") and "timeout" in (row.error or ""), row
        return row

    return run


@pytest.mark.parametrize("is_async", [False, True], ids=["OpenAI", "AsyncOpenAI"])
def test_the_sdk_does_not_retry_a_call_in_flight_at_the_timeout(
    fake_openai: FakeOpenAIServer, instrumented: Any, run_one: Any, is_async: bool
) -> None:
    # the server fails the call after the timeout; the SDK would retry it twice (500 is retried)
    fake_openai.script(FakeReply(status_code=500, delay=_TIMEOUT_S + 1.0), *[FakeReply(status_code=500)] * 2)
    row = run_one(_retrying, {"async": is_async})
    assert [r["body"]["messages"][0]["content"] for r in fake_openai.requests] == ["in flight"], "a retry was sent"
    assert len(_SEEN) == 1 and isinstance(_SEEN[0], RolloutTimedOutError), _SEEN
    assert row.rollout_id in str(_SEEN[0])


def test_a_method_bound_while_the_trainer_hooked_refuses_after_it_unhooked(
    fake_openai: FakeOpenAIServer, run_one: Any
) -> None:
    """The Trainer keeps the OpenAI client hooked while an agent it gave up on runs (tests/test_rollout_end.py);
    once the hooks are out anyway (here: agl.uninstrument()), a method bound while they were in still refuses."""
    assert not any_instrumented(), "this test needs the Trainer to set up the hooks itself"

    def unhook() -> None:
        assert is_hooked("openai"), "the Trainer took its OpenAI hook out while a timed-out agent still runs"
        agl.uninstrument()

    row = run_one(_calls_after_dev, {"q": 1}, unhook)
    assert not is_hooked("openai")
    assert fake_openai.requests == []
    assert len(_SEEN) == 1 and isinstance(_SEEN[0], RolloutTimedOutError), _SEEN
    assert row.rollout_id in str(_SEEN[0])
