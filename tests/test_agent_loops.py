"""The agent event loops of a process (agl.agent_loops): kept across runner pools, lent to one runner at a
time, closed at exit, left alone by forked children. Real thread runners, the real ``openai`` client against
the fake OpenAI server."""

from __future__ import annotations

import asyncio
import multiprocessing
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import agl
import openai
import pytest
from agl import agent_loops, runner as runner_module
from agl.runner import Runner
from agl.runner_pool import RunnerPool
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.testing import FakeOpenAIServer

_CLIENT: Dict[str, openai.AsyncOpenAI] = {}  # stands for `client = openai.AsyncOpenAI(...)` at module level
_LOOPS: List[asyncio.AbstractEventLoop] = []


@agl.rollout
async def _asks_the_module_level_client(task: dict) -> float:
    _LOOPS.append(asyncio.get_running_loop())
    reply = await _CLIENT["client"].chat.completions.create(
        model="fake", messages=[{"role": "user", "content": task["question"]}]
    )
    return float(bool(reply.choices[0].message.content))


def test_a_module_level_async_client_works_in_every_dev_run_of_a_process(
    tmp_path: Path, fake_openai: FakeOpenAIServer
) -> None:
    """A notebook's dev() then dev() (or fit()) with thread runners: each pool's runners made their own event
    loops and closed them on stop, so the client's pooled httpx connections belonged to a closed loop and the
    second run's first rollout failed with "RuntimeError: Event loop is closed"."""
    _LOOPS.clear()
    _CLIENT["client"] = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x")
    trainer = agl.Trainer(store=SqliteLightningStore(tmp_path / "s.db"), n_runners=1, runner_mode="thread", progress=False)
    tasks = [{"question": "What is 1 plus 2?"}, {"question": "What is 3 plus 4?"}]
    for run in ("first", "second"):
        rows = trainer.dev(_asks_the_module_level_client, tasks, print_table=False)
        assert [(r.status, r.error) for r in rows] == [("succeeded", None)] * 2, f"{run} dev() run"
    assert len(_LOOPS) == 4 and all(loop is _LOOPS[0] for loop in _LOOPS), "one loop for the runner slot, kept"
    assert not _LOOPS[0].is_closed()


_TOGETHER: Dict[str, threading.Barrier] = {}


@agl.rollout
async def _records_its_loop(task: dict) -> float:
    _LOOPS.append(asyncio.get_running_loop())
    _TOGETHER["barrier"].wait(timeout=20)  # every runner of both pools holds its loop at once
    return 1.0


def _run_pools(tmp_path: Path, names: List[str], n_runners: int) -> None:
    """Run one thread pool of ``n_runners`` per name at the same time, each on its own store, until every
    runner ran one rollout (all of them at once: see _records_its_loop)."""
    _TOGETHER["barrier"] = threading.Barrier(len(names) * n_runners)
    stores = [SqliteLightningStore(tmp_path / f"{name}.db") for name in names]
    pools = [RunnerPool(_records_its_loop, store, n_runners, mode="thread") for store in stores]
    try:
        for store, pool in zip(stores, pools):
            store.enqueue_many([EnqueueRequest(input={}) for _ in range(n_runners)])
            pool.start()
        deadline = time.monotonic() + 30
        while any(store.stats().rollouts.get("succeeded", 0) < n_runners for store in stores):
            assert time.monotonic() < deadline, "the rollouts never all succeeded"
            time.sleep(0.05)
    finally:
        for pool, store in zip(pools, stores):
            pool.stop()
            store.close()


def test_a_loop_is_lent_to_one_runner_at_a_time(tmp_path: Path) -> None:
    """Two pools running at once in one process (a dev() inside another, two trainers in threads) have
    runners in the same slots: each runner gets a loop of its own. Once they stopped, a later pool's runners
    run on loops they handed back."""
    _LOOPS.clear()
    _run_pools(tmp_path, ["a", "b"], n_runners=2)
    together = list(_LOOPS)
    assert len({id(loop) for loop in together}) == 4, "two runners alive at once ran on the same event loop"
    _LOOPS.clear()
    _run_pools(tmp_path, ["c"], n_runners=2)
    assert len({id(loop) for loop in _LOOPS}) == 2 and all(any(loop is old for old in together) for loop in _LOOPS)


def test_a_stuck_runner_does_not_hand_back_the_loop_its_agent_still_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = 9_101  # a slot no other test uses: its loops are this test's alone
    monkeypatch.setattr(runner_module, "CANCEL_GRACE_S", 0.1)
    done = threading.Event()

    @agl.rollout
    async def blocks_its_loop(task: dict) -> float:
        _LOOPS.append(asyncio.get_running_loop())
        done.wait(10)  # blocks the loop: the cancellation cannot stop it, so the runner is stuck
        return 1.0

    _LOOPS.clear()
    store = SqliteLightningStore(tmp_path / "s.db")
    store.enqueue_many([EnqueueRequest(input={})])
    runner = Runner(blocks_its_loop, store, rollout_timeout=0.3, slot=slot)
    try:
        ended = runner.run_rollout(store.dequeue_rollout(runner.runner_id))
        assert ended.status == "failed" and runner.stuck
        runner.close()
        (stuck_loop,) = _LOOPS
        assert stuck_loop.is_running(), "the stuck agent runs on its loop still"
        taken = agent_loops.take(slot)
        assert taken is not stuck_loop, "the loop of a stuck agent was lent to another runner while it ran"
        agent_loops.give_back(slot, taken)
    finally:
        done.set()
        deadline = time.monotonic() + 10
        while _LOOPS and _LOOPS[0].is_running() and time.monotonic() < deadline:  # the agent returns, its span ends
            time.sleep(0.05)
        runner.tracer.flush(5.0)
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

trainer = agl.Trainer(store=SqliteLightningStore(os.path.join(tempfile.mkdtemp(), "s.db")), n_runners=1,
                      runner_mode="thread", progress=False)
for run in range(2):
    rows = trainer.dev(agent, [{"n": 1}], print_table=False)
    print("dev", [r.status for r in rows], rows[0].error, flush=True)
print("devs done", flush=True)
"""


def test_the_loops_are_closed_at_interpreter_exit(tmp_path: Path) -> None:
    """The runtime an agent keeps goes on in the next pool; at exit it is cancelled (its ``finally`` runs) and
    the loop closed: left to the garbage collector, asyncio said "Task was destroyed but it is pending!"."""
    script = tmp_path / "two_devs.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "default::ResourceWarning", str(script)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "stream closed", "dev ['succeeded'] None", "stream closed", "dev ['succeeded'] None", "devs done", "runtime ended",
    ], done.stderr
    for trouble in ("destroyed but it is pending", "unclosed event loop", "Event loop is closed", "Traceback"):
        assert trouble not in done.stderr, done.stderr


def _takes_in_child(slot: int, parents: int) -> None:
    """In a forked child: exit 0 if the slot's loop is a new one, not the parent's copy (id: same address)."""
    sys.exit(0 if id(agent_loops.take(slot)) != parents else 3)


def test_a_forked_child_leaves_its_parents_loops_alone() -> None:
    """A child inherits copies of its parent's loops, with the parent's tasks and connections on them: it
    must run none of them (nor close them at its exit)."""
    slot = 9_102
    loop = agent_loops.take(slot)
    agent_loops.give_back(slot, loop)
    child = multiprocessing.get_context("fork").Process(target=_takes_in_child, args=(slot, id(loop)))
    child.start()
    child.join(30)
    assert child.exitcode == 0, "the forked child was lent its parent's loop"
    assert agent_loops.take(slot) is loop and not loop.is_closed()
    agent_loops.give_back(slot, loop)
