"""The wait loop shared by the backends that wake waiters from outside the process (SQLite, PostgreSQL).

Each backend brings its own way of being woken (SQLite: a doorbell socket; PostgreSQL: LISTEN/NOTIFY);
what a waiter does with it (check, subscribe, check again, sleep until woken, the caller's deadline or
the next attempt expiry) is decided here once, and so is their ``wait_for_rollouts``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, TypeVar

from agl.errors import UnknownRolloutError
from agl.types import TERMINAL_ROLLOUT_STATUSES, Rollout

T = TypeVar("T")

_GIVE_UP: contextvars.ContextVar[Optional[threading.Event]] = contextvars.ContextVar("agl_give_up", default=None)


@contextlib.contextmanager
def give_up_when(event: threading.Event) -> Iterator[None]:
    """Within this block, :func:`wait_until` (so a SQLite or PostgreSQL ``dequeue_many``) makes no further
    ``attempt`` once ``event`` is set and returns None, claiming nothing.

    Why: the store server's long poll sets ``event`` when its client disconnects; work that arrives after that
    must stay queued for a live runner, not be claimed for one that has gone (its attempt would run until the
    heartbeat timeout). A context variable, not a parameter, so that no store method grows an argument.
    """
    token = _GIVE_UP.set(event)
    try:
        yield
    finally:
        _GIVE_UP.reset(token)


class Waiter(Protocol):
    def wait(self, timeout: Optional[float]) -> bool:
        """Block until woken or ``timeout`` seconds passed (None: until woken); True if woken."""


def wait_until(
    listen: Callable[[], ContextManager[Waiter]],
    timeout: Optional[float],
    attempt: Callable[[], Tuple[Optional[T], Optional[float]]],
) -> Optional[T]:
    """Call ``attempt`` until it returns a result or ``timeout`` passes, sleeping on ``listen()`` in between.

    ``attempt`` returns ``(result or None, next attempt expiry)``; a sleep also ends at that expiry so
    that the expired attempt gets reaped. The subscription is made only once a first try found nothing,
    and ``attempt`` runs once more before the first sleep: a commit it misses wakes a subscription that
    exists, so no wake-up is lost. Inside :func:`give_up_when`, it returns None without another attempt
    once the event is set (a sleep going on then still ends when woken or timed out).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    give_up = _GIVE_UP.get()
    with contextlib.ExitStack() as stack:
        waiter: Optional[Waiter] = None
        while True:
            if give_up is not None and give_up.is_set():
                return None  # checked right before each attempt: nothing is claimed once it is set
            result, next_expiry = attempt()
            if result is not None:
                return result
            waits = [] if deadline is None else [deadline - time.monotonic()]
            if waits and waits[0] <= 0:
                return None
            if waiter is None:
                waiter = stack.enter_context(listen())
                continue
            if next_expiry is not None:
                waits.append(max(0.0, next_expiry - time.time()))
            waiter.wait(min(waits) if waits else None)


def wait_for_rollouts(
    query_rollouts: Callable[..., List[Rollout]],
    rollout_ids: Sequence[str],
    timeout: Optional[float],
    statuses: Callable[[Sequence[str]], Dict[str, str]],
    reap: Callable[[], Tuple[Any, Optional[float]]],
    wait: Callable[[Optional[float], Callable[[], Tuple[Optional[bool], Optional[float]]]], object],
) -> List[Rollout]:
    """``wait_for_rollouts(rollout_ids, timeout)`` of a backend that keeps rollouts in a database, whose
    ``query_rollouts`` this is.

    ``statuses(ids)``: the stored status of each of ``ids`` that exists; ``reap()``: ends expired attempts,
    returning (anything, the next attempt expiry); ``wait(timeout, attempt)``: :func:`wait_until` on the
    backend's wake-up for rollouts that ended. An id of no rollout raises UnknownRolloutError.
    """
    ids = list(dict.fromkeys(rollout_ids))
    pending = _pending(ids, statuses, check_known=True)

    def attempt() -> Tuple[Optional[bool], Optional[float]]:
        nonlocal pending
        _, next_expiry = reap()
        pending = _pending(pending, statuses, check_known=False)
        return (None if pending else True), next_expiry

    if pending:
        wait(timeout, attempt)
    done = {r.rollout_id: r for r in query_rollouts(rollout_ids=ids) if r.is_terminal}
    return [done[i] for i in ids if i in done]


def _pending(
    ids: Sequence[str], statuses: Callable[[Sequence[str]], Dict[str, str]], *, check_known: bool
) -> List[str]:
    """Those of ``ids`` that are not terminal yet (raising for unknown ids when ``check_known``)."""
    if not ids:
        return []
    status = statuses(ids)
    if check_known and len(status) < len(ids):
        raise UnknownRolloutError(next(i for i in ids if i not in status))
    return [i for i in ids if status.get(i) not in TERMINAL_ROLLOUT_STATUSES]
