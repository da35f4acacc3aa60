"""The one event loop that every async agent of this process runs on, in a thread of its own.

Agents share async objects across rollouts: a module-level ``openai.AsyncOpenAI`` client (httpx pools its
connections behind asyncio locks), LangChain's ``ChatOpenAI`` (langchain-openai caches one
``httpx.AsyncClient`` per process), a LangGraph ``AsyncSqliteSaver``, an MCP session or an AutoGen runtime
kept as tasks. Such objects belong to the loop that first used them. When each thread runner ran its rollouts
on a loop of its own, two runners touching one of them failed at random with "RuntimeError: <asyncio.locks.Event
...> is bound to a different event loop"; and a loop closed with its pool broke the next pool's first rollout
with "Event loop is closed". So all async rollouts of a process run as tasks on one loop that runs for the
process's life (:func:`loop`), as the rollouts of a single ``asyncio.run`` program would, whatever runner pool
(a notebook's ``dev()`` then ``fit()``) runs them. A runner's agent thread hands its rollout over
(:func:`start`) and waits for it.

The trade-off: a rollout that blocks the loop (a sync call inside ``async def``: ``time.sleep``, a sync HTTP
client, heavy CPU work) stalls every runner's async rollouts in the process while it blocks. A runner that
cannot cancel its timed-out rollout because of that abandons the loop (:meth:`AgentRun.give_up`): it stays
with its thread, and later rollouts run on a fresh one.

Each task is recorded with the rollout that created it (the agl rollout scope current then), so that a runner
can tell which tasks *its* rollout left running while other rollouts run on the same loop.

At interpreter exit the loop is closed as ``asyncio.run`` closes its own (:func:`close`): left to the garbage
collector, what agents left on it (an async generator abandoned mid-stream, a kept runtime's task) was destroyed
with asyncio's "Task was destroyed but it is pending!" and its ``finally`` never ran. A runner process calls
:func:`close` before it leaves with ``os._exit`` (which skips atexit). A forked child leaves its parent's loop
alone (it has no thread there, and holds the parent's connections and tasks) and starts its own when needed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import inspect
import logging
import os
import threading
import weakref
from typing import Any, List, Optional

from agl._util.fork_safety import keep_unused
from agl.tracing.context import RolloutScope, current_scope

logger = logging.getLogger("agl.runtime.agent_loops")

CLOSE_TIMEOUT_S = 10.0  # how long closing the loop waits for the tasks left on it to unwind


class _AgentLoop:
    """An event loop running forever in a daemon thread, recording which rollout created each of its tasks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(self._new_task)
        self.scopes: weakref.WeakKeyDictionary[asyncio.Task[Any], RolloutScope] = weakref.WeakKeyDictionary()
        self._closing = False
        self.thread = threading.Thread(target=self._serve, name="agl-agent-loop", daemon=True)
        self.thread.start()

    def _new_task(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        """The loop's task factory: an ordinary task, recorded with the rollout it was created for (the scope
        of the context it will run in). An async generator's ``aclose`` that the loop schedules when the
        garbage collector finds one is asyncio's cleanup, not work of the rollout: not recorded."""
        task = asyncio.Task(coro, loop=loop, **kwargs)
        context: Optional[contextvars.Context] = kwargs.get("context")
        scope = context.run(current_scope) if context is not None else current_scope()
        if scope is not None and inspect.iscoroutine(coro):
            self.scopes[task] = scope
        return task

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        while not self._closing:
            try:
                self.loop.run_forever()
            except BaseException as exc:  # noqa: BLE001 - asyncio re-raises a task's SystemExit/KeyboardInterrupt
                logger.error("an agent task raised %r out of the agent event loop; the loop goes on", exc)
        self.loop.close()

    def left_running(self, task: asyncio.Task[Any]) -> List[asyncio.Task[Any]]:
        """On the loop's thread: the tasks that ``task``'s rollout created and that still run, but ``task``."""
        scope = self.scopes.get(task)
        return [
            t for t in asyncio.all_tasks(self.loop) if t is not task and not t.done() and self.scopes.get(t) is scope
        ]

    def blocking_rollout(self) -> str:
        """Who runs on the loop now (read from another thread while it is blocked), for a warning."""
        task = asyncio.current_task(self.loop)
        if task is None:
            return "a callback (no task)"
        scope = self.scopes.get(task)
        owner = f"rollout {scope.rollout_id}" if scope is not None else "no rollout"
        return f"task {task_name(task)} of {owner}"

    def close(self, timeout: float) -> None:
        """From another thread: cancel the tasks left and let them unwind, close the async generators still
        open and the default executor, then stop and close the loop; wait up to ``timeout`` for all that."""
        try:
            asyncio.run_coroutine_threadsafe(self._shut_down(), self.loop).result(timeout)
        except concurrent.futures.TimeoutError:
            logger.warning(
                "the agent event loop did not finish its tasks within %s s at close; left to its thread", timeout
            )
            return
        self._closing = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)

    async def _shut_down(self) -> None:
        this = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not this]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()


_lock = threading.Lock()
_current: Optional[_AgentLoop] = None
_closing_at_exit = False  # whether close is registered with atexit
_warned_blocked = False


def _agent_loop() -> _AgentLoop:
    global _current, _closing_at_exit
    with _lock:
        if _current is None:
            _current = _AgentLoop()
            if not _closing_at_exit:  # on first use: atexit runs this before what was registered earlier
                atexit.register(close)
                _closing_at_exit = True
        return _current


def loop() -> asyncio.AbstractEventLoop:
    """The event loop async agents of this process run on, started on first use."""
    return _agent_loop().loop


def start(awaitable: Any, context: contextvars.Context) -> AgentRun:
    """Run ``awaitable`` as a task on the agent loop, in (a copy of) ``context``: the caller's rollout scope
    and parent span go with it."""
    return AgentRun(_agent_loop(), awaitable, context)


class AgentRun:
    """An awaitable run as a task on the agent loop, for another thread that waits for its outcome."""

    def __init__(self, agent_loop: _AgentLoop, awaitable: Any, context: contextvars.Context) -> None:
        self._agent_loop = agent_loop
        self._task: Optional[asyncio.Task[Any]] = None
        self._outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._went_on_after_cancel = threading.Event()
        self.left_running: List[asyncio.Task[Any]] = []  # set as it ends: see _AgentLoop.left_running
        # (asyncio's create_task(context=...) is 3.11+: the callback runs in the context, the task copies it)
        agent_loop.loop.call_soon_threadsafe(self._start, awaitable, context=context)

    def _start(self, awaitable: Any) -> None:
        try:
            coro = awaitable if inspect.iscoroutine(awaitable) else _await(awaitable)  # (named after the agent)
            self._task = self._agent_loop.loop.create_task(coro)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._outcome.set_exception(exc)
            return
        self._task.add_done_callback(self._finish)

    def _finish(self, task: asyncio.Task[Any]) -> None:
        self.left_running = self._agent_loop.left_running(task)
        try:
            self._outcome.set_result(task.result())
        except BaseException as exc:  # noqa: BLE001 - CancelledError and the agent's errors go to the waiter
            self._outcome.set_exception(exc)

    def result(self) -> Any:
        """Wait for the task and return its result, or raise what it raised (CancelledError if cancelled)."""
        return self._outcome.result()

    def cancel(self) -> None:
        """Cancel the task, from any thread."""
        self._agent_loop.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if self._task is not None:  # (_start ran before: callbacks run in the order they were scheduled)
            self._task.cancel()
        self._agent_loop.loop.call_soon(self._went_on_after_cancel.set)  # the loop got past the cancelled step

    def give_up(self, rollout_id: str) -> None:
        """After a :meth:`cancel` that did not end the task in time: if the loop never got past it, something
        blocks the loop (no task can go on), so abandon it to its thread and let later rollouts run on a fresh
        one. A task that goes on ignoring its cancellation leaves the loop running: it is kept."""
        if not self._went_on_after_cancel.is_set():
            _abandon(self._agent_loop, rollout_id)


def _abandon(agent_loop: _AgentLoop, rollout_id: str) -> None:
    """Stop lending a blocked loop (once, whichever of its waiting runners finds it first); warn once."""
    global _current, _warned_blocked
    with _lock:
        if _current is not agent_loop:
            return
        _current = None
        warn, _warned_blocked = not _warned_blocked, True
    (logger.warning if warn else logger.info)(
        "the event loop of this process's async agents is blocked (rollout %s could not be cancelled past its "
        "timeout; running now: %s): every runner's async rollouts in this process wait while it blocks. A sync "
        "call inside an async agent blocks the loop they all share (time.sleep, a sync HTTP or SDK client, heavy "
        "CPU work): make the call async, run it with `await asyncio.to_thread(...)`, or use runner_mode='process'. "
        "The blocked loop is left to its thread; later rollouts run on a fresh one%s",
        rollout_id,
        agent_loop.blocking_rollout(),
        ". Said once per process" if warn else "",
    )


def close(timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Close the agent loop (a later :func:`loop` starts a fresh one). Called at interpreter exit, and by a
    runner process before it leaves with ``os._exit``."""
    global _current
    with _lock:
        agent_loop, _current = _current, None
    if agent_loop is not None:
        agent_loop.close(timeout)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def task_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or task.get_name()


def _forget_in_child() -> None:
    """In a forked child: drop the parent's loop unused (its thread is not in the child; its tasks and
    connections are the parent's); the lock may have been held by a parent's thread."""
    global _lock, _current
    if _current is not None:
        keep_unused([_current])
    _current = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
