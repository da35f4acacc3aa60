"""The event loops that async agents run on in this process, kept for the process's life.

A runner runs an async agent on one event loop per agent thread, kept across rollouts, because agents keep
async objects that belong to the loop they were first used on: a module-level ``openai.AsyncOpenAI`` client
pools its httpx connections there, an MCP session or an AutoGen runtime runs there as tasks. One process may
run several runner pools in turn (a notebook's ``Trainer.dev()`` then ``fit()``, or ``dev()`` twice). When
each pool's runners made loops of their own and closed them on stop, the next pool's first rollout met
connections of a closed loop: "RuntimeError: Event loop is closed".

So the loops live here, one per runner *slot* (a runner's index in its pool): a runner takes its slot's
loop (:func:`take`) and hands it back when it closes (:func:`give_back`), and the next pool's runner in that
slot runs on it (a loop that is not running may run on any thread). The tasks agents keep on it resume then.
A loop is lent to one runner at a time: a pool that runs while another does (a ``dev()`` inside another, two
trainers in threads) gets fresh loops for the slots taken. A runner gives nothing back while its agent thread
still runs (stuck, or left behind by its pool): the loop may be running there.

At interpreter exit every loop that is not running is closed as ``asyncio.run`` closes its own
(:func:`close_all`); left to the garbage collector, what agents left on it (an async generator abandoned
mid-stream, a kept runtime's task) was destroyed with asyncio's "Task was destroyed but it is pending!" and
its ``finally`` never ran. A forked child leaves its parent's loops alone: they hold the parent's
connections and tasks.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from typing import Dict, List

from agl.fork_safety import keep_unused

logger = logging.getLogger("agl.agent_loops")

_lock = threading.Lock()
_free: Dict[int, List[asyncio.AbstractEventLoop]] = {}  # per slot: loops no runner holds now
_loops: List[asyncio.AbstractEventLoop] = []  # every loop made here, lent or free: closed at exit
_closing_at_exit = False  # whether close_all is registered with atexit


def take(slot: int) -> asyncio.AbstractEventLoop:
    """The loop of runner slot ``slot`` for the caller alone until it hands it back: the one the previous
    runner in that slot used, or a new one if that is lent out (or none was made yet)."""
    global _closing_at_exit
    with _lock:
        free = _free.get(slot, [])
        while free:
            loop = free.pop()
            if not loop.is_closed():  # an agent may close its loop itself
                return loop
        loop = asyncio.new_event_loop()
        _loops.append(loop)
        if not _closing_at_exit:  # on first use: atexit runs this before what was registered earlier
            atexit.register(close_all)
            _closing_at_exit = True
        return loop


def give_back(slot: int, loop: asyncio.AbstractEventLoop) -> None:
    """Hand back a loop :func:`take` lent, for the next runner in ``slot``. Runs what is ready on it first
    (the ``aclose`` of async generators collected in the last rollout), so that their ``finally`` (a model
    stream's span ending) runs while its runner's pool is still there; the tasks agents keep are left alone.
    If that raises, the loop stays out of reach (closed at exit), as one that may be running elsewhere."""
    loop.run_until_complete(asyncio.sleep(0))
    with _lock:
        _free.setdefault(slot, []).append(loop)


def close_all() -> None:
    """Close every loop that is not running (one still running belongs to an agent thread left behind).
    Called at interpreter exit, and by a runner process before it leaves with ``os._exit`` (which skips
    atexit)."""
    with _lock:
        loops = [loop for loop in _loops if not loop.is_closed() and not loop.is_running()]
        _loops[:] = [loop for loop in _loops if loop not in loops and not loop.is_closed()]
        for free in _free.values():
            free[:] = [loop for loop in free if loop not in loops]
    for loop in loops:
        try:
            _close(loop)
        except Exception as exc:  # noqa: BLE001 - an agent's cleanup must not stop the other loops' closing
            logger.warning("closing an agent event loop: %s", exc)


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """End ``loop`` as ``asyncio.run`` ends its own: run what is ready (``aclose`` of collected generators),
    cancel the tasks left and let them unwind, close the async generators still open, close the loop."""
    try:
        loop.run_until_complete(asyncio.sleep(0))
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


def _forget_in_child() -> None:
    """In a forked child: drop the parent's loops unused. Closing or running them would cancel or go on with
    the parent's tasks, on copies of its connections; the lock may have been held by a parent's thread."""
    global _lock
    keep_unused(list(_loops))
    _loops.clear()
    _free.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
