"""Keeping agl's contextvars (rollout scope, current span) across the threads CrewAI hands work to.

CrewAI moves work to other threads in a few places: the ``max_execution_time`` path of
``Agent.execute_task`` (a ``ThreadPoolExecutor``), parallel native tool calls (a pool), tasks with
``async_execution=True`` (a ``threading.Thread``), streamed crews (a thread per stream) and
``Flow.kickoff`` called inside a running event loop (``asyncio.run`` in a pool). Threads start with an
empty context, so without help the spans made there would belong to no rollout and hang under no parent.
Newer CrewAI releases copy the context themselves; the helpers here make the older ones (down to agl's
floor) behave the same, and are harmless on top of CrewAI's own copying.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import importlib
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from agl.instrumentation.framework import PatchSet
from agl.tracing.context import carry_scope


class ContextCopyingMethod:
    """A method descriptor that binds the caller's context at attribute access.

    ``pool.submit(self.method, ...)`` looks the method up in the submitting thread and calls it in a
    worker: the bound method this returns runs there in a copy of the submitter's context. Called in the
    thread that looked it up, it runs directly, so CrewAI's own contextvar bookkeeping (event scopes) is
    untouched. This is OpenInference's fix for CrewAI's pools, which a wrapt wrapper cannot do: wrapt binds
    lazily and only sees the worker's (empty) context.
    """

    def __init__(self, function: Any) -> None:
        self.function = function
        functools.update_wrapper(self, function)  # type: ignore[arg-type]  # an object that stands for the function

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        bound = self.function.__get__(instance, owner)
        if instance is None:
            return bound
        return _ContextBoundCall(bound, contextvars.copy_context(), threading.get_ident())


class _ContextBoundCall:
    """What :class:`ContextCopyingMethod` hands out: the bound method plus the context it was looked up in."""

    __slots__ = ("bound", "context", "thread_id", "__wrapped__")

    def __init__(self, bound: Callable[..., Any], context: contextvars.Context, thread_id: int) -> None:
        self.bound = bound
        self.context = context
        self.thread_id = thread_id
        self.__wrapped__ = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == self.thread_id:
            return self.bound(*args, **kwargs)
        # A Context can be entered by one thread at a time and the same bound method may be submitted to
        # several workers: each call gets its own copy.
        return self.context.copy().run(self.bound, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bound, name)


def _passthrough(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return wrapped(*args, **kwargs)


def copy_context_on_access(
    patches: PatchSet, module: str, name: str, wrapper: Callable[..., Any] = _passthrough
) -> bool:
    """Wrap ``module.name`` (``Class.method``) with ``wrapper`` and make it a :class:`ContextCopyingMethod`.

    The PatchSet records the exact original, so ``patches.restore()`` also removes the descriptor.
    False if the method does not exist in this CrewAI version.
    """
    if not patches.wrap(module, name, wrapper):
        return False
    class_path, _, attr = name.rpartition(".")
    owner: Any = importlib.import_module(module)
    for part in class_path.split("."):
        owner = getattr(owner, part)
    setattr(owner, attr, ContextCopyingMethod(owner.__dict__[attr]))
    return True


def bind_run_func_to_caller(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """``create_chunk_generator(state, run_func, ...)`` wrapper (``Crew(stream=True)``, streamed flows).

    ``run_func`` (the real kickoff) runs in a thread that starts when the stream is first read; older
    CrewAI gives it an empty context. Binding it here, inside the ``kickoff`` that made the stream, keeps
    the rollout and nests the crew's work under that kickoff's span.
    """
    if "run_func" in kwargs:
        kwargs = {**kwargs, "run_func": carry_scope(kwargs["run_func"])}
    elif len(args) > 1:
        args = (args[0], carry_scope(args[1]), *args[2:])
    return wrapped(*args, **kwargs)


def in_running_loop() -> bool:
    """Whether this thread runs an asyncio event loop (CrewAI then switches to its async paths)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def kickoff_outside_loop(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """``Flow.kickoff`` wrapper: inside a running loop, run it in a worker thread with the caller's context.

    Older CrewAI then calls ``asyncio.run`` in a pool thread of its own, which drops the context; a thread
    without a running loop makes CrewAI call ``asyncio.run`` right there, in the context we copied.
    """
    if not in_running_loop():
        return wrapped(*args, **kwargs)
    context = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-crewai-flow") as pool:
        return pool.submit(context.run, wrapped, *args, **kwargs).result()


__all__ = [
    "ContextCopyingMethod",
    "bind_run_func_to_caller",
    "copy_context_on_access",
    "in_running_loop",
    "kickoff_outside_loop",
]
