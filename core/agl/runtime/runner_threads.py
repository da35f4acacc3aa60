"""The threads a runner keeps per rollout: the daemon thread a sync agent runs on, and the heartbeat of its
attempt (both outlive nothing: the process exits past an agent left behind)."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable, Optional

from agl.errors import StaleAttemptError
from agl.store.base import LightningStore

logger = logging.getLogger("agl.runtime.runner")


def how_it_ended(store: LightningStore, rollout_id: str, attempt_id: str) -> str:
    """Why the store ended a running attempt, for the runner's log: a user cancelling the rollout is not the
    store timing it out, and the two call for different looks (at the trainer, or at the runner's health)."""
    try:
        status = next((a.status for a in store.query_attempts(rollout_id) if a.attempt_id == attempt_id), None)
    except Exception:  # noqa: BLE001 - only for a log line
        status = None
    if status == "cancelled":
        return "was cancelled (cancel_rollout); its result will not be recorded"
    return "was ended by the store (timed out?)"


class AgentThread:
    """The runner's agent thread: a one-thread executor (``submit`` returns a Future) whose thread is a daemon.

    A ThreadPoolExecutor's threads are joined when the interpreter exits, so an agent the runner had left
    behind (stuck past its timeout, or busy past its pool's stop timeout) kept the whole process alive until
    it returned: ``agl runner --runner-mode thread`` outlived its ``--stop-timeout``."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (future, fn, args), or None: leave
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._shut_down = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._tasks.put((future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="agl-agent", daemon=True)
                self._thread.start()
        return future

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, fn, args = task
            del task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            while cancel_futures:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
            self._tasks.put(None)  # the thread leaves once its current task returns
            thread = self._thread
        if wait and thread is not None:
            thread.join()


class Heartbeat:
    """Heartbeats one attempt every ``interval`` seconds until stopped."""

    def __init__(self, store: LightningStore, rollout_id: str, attempt_id: str, interval: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(store, rollout_id, attempt_id, interval), name="agl-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, store: LightningStore, rollout_id: str, attempt_id: str, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                store.heartbeat(rollout_id, attempt_id)
            except StaleAttemptError:  # the store ended the attempt; the result will be refused too (said then)
                if self._stop.is_set():  # a beat in flight as the runner completed the attempt itself: no news
                    return
                logger.warning(
                    "attempt %s of %s %s", attempt_id, rollout_id, how_it_ended(store, rollout_id, attempt_id)
                )
                return
            except Exception as exc:  # noqa: BLE001 - a flaky store must not kill the rollout
                if self._stop.is_set():  # stopped meanwhile (its runner abandoned, the store closed after): moot
                    return
                logger.warning("heartbeat for %s failed: %s", rollout_id, exc)

    def stop(self) -> None:
        self._stop.set()
