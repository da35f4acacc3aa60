"""Keeping a rollout's context where AG2 moves work, and entering agl spans without risking the user's call.

These helpers know nothing about AG2; other adapters face the same three problems:

- :func:`enter_guarded`: a span is entered around the user's call, but if agl's own code fails to make it,
  the call must go on without the span instead of failing.
- :func:`in_context`: a coroutine handed to an event loop that another thread creates starts from that
  thread's empty context, so its spans would land in no rollout; it must first take the caller's values.
- :class:`ContextHandoff`: a framework that submits a call to a thread pool with no way to wrap the
  submitted callable; the caller leaves its context under a key the worker can find (e.g. the agent).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Awaitable, Callable, ContextManager, Dict, Iterator, Optional, Tuple, TypeVar

from agl._util.safety import report_internal_error

T = TypeVar("T")


def enter_guarded(stack: contextlib.ExitStack, make: Callable[[], ContextManager[T]], site: str) -> Optional[T]:
    """Enter ``make()`` on ``stack``; if agl fails to, report it and return None (the call runs untraced)."""
    try:
        return stack.enter_context(make())
    except Exception as exc:  # noqa: BLE001 - agl's failure must not become the user's
        report_internal_error(site, exc)
        return None


async def in_context(ctx: contextvars.Context, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` with ``ctx``'s context variables set in the running task first.

    The task driving this coroutine owns a copy of its thread's context, so the values set here stay in
    that task (they cannot leak into the other thread's later work).
    """
    for var, value in ctx.items():
        var.set(value)
    return await awaitable


class ContextHandoff:
    """Hands the context of a call to the worker thread that a framework runs part of it in.

    ``offer(key)`` is entered on the caller's thread around the call; on the worker, ``context_for(key)``
    returns a copy of the offered context to run in, or None when there is no offer or the worker is the
    offering thread itself (the context is already there). Offers for one key nest: the innermost wins.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: Dict[int, Tuple[int, contextvars.Context]] = {}

    @contextlib.contextmanager
    def offer(self, key: object) -> Iterator[None]:
        entry = (threading.get_ident(), contextvars.copy_context())
        with self._lock:
            previous = self._offers.get(id(key))
            self._offers[id(key)] = entry
        try:
            yield
        finally:
            with self._lock:
                if previous is None:
                    self._offers.pop(id(key), None)
                else:
                    self._offers[id(key)] = previous

    def context_for(self, key: object) -> Optional[contextvars.Context]:
        with self._lock:
            entry = self._offers.get(id(key))
        if entry is None or entry[0] == threading.get_ident():
            return None
        # Several workers may take the same offer at once: each runs in its own copy.
        return entry[1].copy()
