"""The event loop all async agents of a process share (agl.runtime.agent_loops): concurrent thread runners share
async clients, the loop outlives runner pools, a blocked loop is replaced, it is closed at exit, forked
children leave it alone. Real thread runners, the real ``openai`` client against the fake OpenAI server
(LangChain's ``ChatOpenAI``: tests/integrations/test_langchain.py)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import openai
import pytest

import agl
from agl import semconv
from agl.runtime import agent_loops
from agl.runtime import runner as runner_module
from agl.runtime.runner import Runner
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.testing import FakeOpenAIServer, FakeReply

_CLIENT: Dict[str, openai.AsyncOpenAI] = {}  # stands for `client = openai.AsyncOpenAI(...)` at module level
_LOOPS: List[asyncio.AbstractEventLoop] = []


async def _module_level_client(question: str) -> str:
    reply = await _CLIENT["client"].chat.completions.create(
        model="fake", messages=[{"role": "user", "content": question}]
    )
    return reply.choices[0].message.content or ""


_ASK: Dict[str, Callable[[str], Any]] = {}


@agl.rollout
async def _asks_the_model(task: dict) -> float:
    _LOOPS.append(asyncio.get_running_loop())
    return float(bool(await _ASK["ask"](task["question"])))


def test_concurrent_thread_runners_share_async_clients(
    tmp_path: Path, fake_openai: FakeOpenAIServer, instrumented: None
) -> None:
    """Every thread runner ran its async rollouts on an event loop of its own, so a client shared across
    rollouts (a module-level AsyncOpenAI, as docs/training.md advises; LangChain's process-wide httpx client:
    tests/integrations/test_langchain.py) had its connection pool's asyncio locks bound to one runner's loop:
    the other runners' rollouts failed at random with "... is bound to a different event loop", and their llm
    spans had no token ids."""
    _ASK["ask"] = _module_level_client
    _CLIENT["client"] = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x")
    _LOOPS.clear()
    fake_openai.script(*[FakeReply(delay=0.1 * (i % 4)) for i in range(16)])  # the rollouts overlap
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(store=store, n_runners=4, runner_mode="thread", progress=False)
    rows = trainer.dev(_asks_the_model, [{"question": f"What is {i} plus 2?"} for i in range(16)], print_table=False)
    assert [(r.status, r.error) for r in rows] == [("succeeded", None)] * 16
    assert len({rollout.attempt.runner_id for rollout in store.query_rollouts()}) > 1, "the runners took turns"
    for row in rows:
        spans = store.query_spans(row.rollout_id)
        (root,) = [s for s in spans if s.parent_id is None]
        (llm,) = [s for s in spans if s.kind == "llm"]
        assert llm.attributes[semconv.PROMPT_TOKEN_IDS] and llm.attributes[semconv.RESPONSE_TOKEN_IDS]
        assert llm.trace_id == root.trace_id
    assert all(loop is agent_loops.loop() for loop in _LOOPS), "every rollout ran on the process's agent loop"


def test_a_module_level_async_client_works_in_every_dev_run_of_a_process(
    tmp_path: Path, fake_openai: FakeOpenAIServer
) -> None:
    """A notebook's dev() then dev() (or fit()) with thread runners: each pool's runners made their own event
    loops and closed them on stop, so the client's pooled httpx connections belonged to a closed loop and the
    second run's first rollout failed with "RuntimeError: Event loop is closed"."""
    _LOOPS.clear()
    _ASK["ask"] = _module_level_client
    _CLIENT["client"] = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x")
    trainer = agl.Trainer(
        store=SqliteLightningStore(tmp_path / "s.db"), n_runners=2, runner_mode="thread", progress=False
    )
    tasks = [{"question": "What is 1 plus 2?"}, {"question": "What is 3 plus 4?"}]
    for run in ("first", "second"):
        rows = trainer.dev(_asks_the_model, tasks, print_table=False)
        assert [(r.status, r.error) for r in rows] == [("succeeded", None)] * 2, f"{run} dev() run"
    assert len(_LOOPS) == 4 and all(loop is _LOOPS[0] for loop in _LOOPS) and not _LOOPS[0].is_closed()


_LEFT_TASKS: List[asyncio.Task[Any]] = []


async def _left_by_a() -> None:
    await asyncio.sleep(30)


async def _left_by_b() -> None:
    await asyncio.sleep(30)


@agl.rollout
async def _leaves_a_task(task: dict) -> float:
    _LEFT_TASKS.append(asyncio.get_running_loop().create_task({"a": _left_by_a, "b": _left_by_b}[task["who"]]()))
    await asyncio.sleep(0.5)  # the other rollout runs, and leaves its task, meanwhile
    return 1.0


def test_each_rollout_is_told_only_of_the_tasks_it_left_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rollouts of all runners share the loop: a runner that counted every task its rollout found new on
    the loop would blame it for what a concurrent rollout started."""
    _LEFT_TASKS.clear()
    store = SqliteLightningStore(tmp_path / "s.db")
    trainer = agl.Trainer(store=store, n_runners=2, runner_mode="thread", progress=False)
    try:
        with caplog.at_level(logging.WARNING, "agl.runtime.runner"):
            rows = trainer.dev(_leaves_a_task, [{"who": "a"}, {"who": "b"}], print_table=False)
    finally:
        for task in _LEFT_TASKS:
            agent_loops.loop().call_soon_threadsafe(task.cancel)
    assert [r.status for r in rows] == ["succeeded", "succeeded"]
    said = {
        r.getMessage().split()[1]: r.getMessage() for r in caplog.records if "asyncio task(s) running" in r.getMessage()
    }
    for row, own, other in ((rows[0], "_left_by_a", "_left_by_b"), (rows[1], "_left_by_b", "_left_by_a")):
        assert "left 1 asyncio task(s) running" in said[row.rollout_id] and own in said[row.rollout_id]
        assert other not in said[row.rollout_id]


@agl.rollout
async def _blocks_or_not(task: dict) -> float:
    _LOOPS.append(asyncio.get_running_loop())
    if task["block"]:
        time.sleep(1.0)  # a sync call inside async def: the shared loop can run nothing else meanwhile
    await asyncio.sleep(0.01)
    return 1.0


def test_a_rollout_that_blocks_the_loop_gets_it_replaced_for_later_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runner_module, "CANCEL_GRACE_S", 0.2)
    monkeypatch.setattr(agent_loops, "_warned_blocked", False)
    _LOOPS.clear()
    store = SqliteLightningStore(tmp_path / "s.db")
    store.enqueue_many([EnqueueRequest(input={"block": True}), EnqueueRequest(input={"block": False})])
    runner = Runner(_blocks_or_not, store, rollout_timeout=0.3)
    try:
        with caplog.at_level(logging.WARNING, "agl.runtime.agent_loops"):
            blocked = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
        assert blocked.status == "failed" and "timeout" in blocked.error and runner.stuck, "it cannot be cancelled"
        fine = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
        assert fine.status == "succeeded"
        blocked_loop, fresh_loop = _LOOPS
        assert fresh_loop is not blocked_loop and fresh_loop is agent_loops.loop()
        (warning,) = [r.getMessage() for r in caplog.records if "is blocked" in r.getMessage()]
        assert blocked.rollout_id in warning and "_blocks_or_not" in warning
        assert "asyncio.to_thread" in warning and "runner_mode='process'" in warning
    finally:
        runner.close()
        store.close()


_EXIT_SCRIPT = """
import asyncio, os, sys, tempfile
import agl
from agl.store import SqliteLightningStore

KEPT = {}

async def runtime(queue):
    try:
        while True:
            reply, value = await queue.get()
            reply.set_result(value)
    finally:
        print("runtime ended", flush=True)

async def stream():
    try:
        yield 1
        yield 2
    finally:
        print("stream closed", flush=True)

@agl.rollout
async def agent(task):
    if "queue" not in KEPT:  # a runtime the agent starts once and keeps (AutoGen's, an MCP session)
        KEPT["queue"] = asyncio.Queue()
        KEPT["task"] = asyncio.get_running_loop().create_task(runtime(KEPT["queue"]))
    numbers = stream()
    await numbers.__anext__()  # abandoned mid-stream
    reply = asyncio.get_running_loop().create_future()
    await KEPT["queue"].put((reply, 1.0))
    return await asyncio.wait_for(reply, 10)  # the runtime serves still

trainer = agl.Trainer(store=SqliteLightningStore(os.path.join(tempfile.mkdtemp(), "s.db")), n_runners=2,
                      runner_mode="thread", progress=False)
for run in range(2):
    rows = trainer.dev(agent, [{"n": 1}], print_table=False)
    print("dev", [r.status for r in rows], rows[0].error, flush=True)
print("devs done", flush=True)
"""


def test_the_loop_is_closed_at_interpreter_exit(tmp_path: Path) -> None:
    """The runtime an agent keeps goes on in the next pool; at exit it is cancelled (its ``finally`` runs) and
    the loop closed: left to the garbage collector, asyncio said "Task was destroyed but it is pending!"."""
    script = tmp_path / "two_devs.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "default::ResourceWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "stream closed",
        "dev ['succeeded'] None",
        "stream closed",
        "dev ['succeeded'] None",
        "devs done",
        "runtime ended",
    ], done.stderr
    for trouble in (
        "destroyed but it is pending",
        "unclosed event loop",
        "Event loop is closed",
        "Traceback",
        "did not finish",
    ):
        assert trouble not in done.stderr, done.stderr


def _uses_its_own_loop(parents: int) -> None:
    """In a forked child: exit 0 if its agent loop is a new one that runs, not the parent's copy (whose
    thread is not in the child)."""
    loop = agent_loops.loop()
    ran = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "ran"), loop).result(10)
    sys.exit(0 if id(loop) != parents and ran == "ran" else 3)


def test_a_forked_child_leaves_its_parents_loop_alone() -> None:
    """A child inherits a copy of its parent's loop, with the parent's tasks and connections on it and no
    thread to run it: it must start its own (and not close the parent's at its exit)."""
    loop = agent_loops.loop()
    child = multiprocessing.get_context("fork").Process(target=_uses_its_own_loop, args=(id(loop),))
    child.start()
    child.join(30)
    assert child.exitcode == 0, "the forked child used its parent's loop"
    assert agent_loops.loop() is loop and asyncio.run_coroutine_threadsafe(asyncio.sleep(0, 1), loop).result(10) == 1
