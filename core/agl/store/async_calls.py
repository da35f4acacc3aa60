"""One store API for two kinds of callers: Agent Lightning's code awaits every store call
(``await store.query_spans(rid)``), agl's calls them as plain functions.

Why: agl's stores are synchronous and thread-safe, and Agent Lightning's are async; code written for either should
run unchanged. A store method called directly from a coroutine (an ``async def``, or an async generator) of code
outside the ``agl`` package returns an awaitable that runs the call on a worker thread (``asyncio.to_thread``), so
the event loop never blocks on the database or the network. From ordinary functions, and from agl's own modules
(the store server's endpoints, the runner), it returns the value as before. A comprehension counts as the function
it is written in (Python 3.12 runs it in that function's frame; 3.10 and 3.11 in a frame of its own).

The check reads the caller's code object: about half a microsecond per call from ordinary code (one more Python call
level and a frame read), against tens of microseconds for a SQLite call. An awaited call adds a thread hop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from types import FrameType, FunctionType
from typing import Any, Callable, FrozenSet, Iterable, TypeVar

_ASYNC_CODE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>"})
_MARK = "__agl_awaitable_from_async__"

F = TypeVar("F", bound=Callable[..., Any])


def awaited_by(frame: FrameType) -> bool:
    """Whether the code running in ``frame`` is a coroutine (or async generator) of a module outside agl."""
    code = frame.f_code
    if code.co_name in _COMPREHENSIONS and frame.f_back is not None:  # Python < 3.12: the comprehension's own frame
        frame = frame.f_back
        code = frame.f_code
    if not code.co_flags & _ASYNC_CODE:
        return False
    module = frame.f_globals.get("__name__", "")
    return not (module == "agl" or module.startswith("agl."))


def awaitable_from_async(method: F) -> F:
    """``method``, returning an awaitable (the call on a worker thread) when called from user code's coroutines."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        code = frame.f_code
        # the usual caller (ordinary code) is told apart by its code alone; awaited_by looks further
        if (code.co_flags & _ASYNC_CODE or code.co_name in _COMPREHENSIONS) and awaited_by(frame):
            return asyncio.to_thread(method, self, *args, **kwargs)
        return method(self, *args, **kwargs)

    setattr(call, _MARK, True)
    return call  # type: ignore[return-value]  # same signature; the awaitable is for callers mypy does not check


def public_methods(cls: type) -> FrozenSet[str]:
    """The names of the plain public methods ``cls`` defines itself (its API, for :func:`install`)."""
    return frozenset(n for n, v in vars(cls).items() if not n.startswith("_") and isinstance(v, FunctionType))


def install(cls: type, names: Iterable[str]) -> None:
    """Make each method ``names`` lists awaitable from user coroutines on ``cls``, wherever in its bases (mixins
    included) the method that ``cls`` uses is defined. Methods already wrapped, coroutine functions (a subclass
    written the Agent Lightning way) and non-functions are left as they are."""
    for name in names:
        method = next((vars(base)[name] for base in cls.__mro__ if name in vars(base)), None)
        if not isinstance(method, FunctionType) or getattr(method, _MARK, False):
            continue
        if inspect.iscoroutinefunction(method):
            continue
        setattr(cls, name, awaitable_from_async(method))
