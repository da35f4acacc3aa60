"""Which rollout and attempt the current code runs for, carried in contextvars.

contextvars follow ``asyncio`` tasks by themselves. Thread pools do not copy them: wrap the callable with
:func:`propagate` (or submit through :func:`submit`) so spans made in the worker land in the right rollout
and under the right parent span.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import os
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

from opentelemetry import context as otel_context
from opentelemetry.trace import StatusCode

from agl import semconv, types
from agl.errors import RolloutTimedOutError

T = TypeVar("T")


@dataclass
class RolloutScope:
    """The rollout/attempt a piece of code works for, plus the attempt's span sequence counter."""

    rollout_id: str
    attempt_id: str
    mode: str = "train"
    request_token_ids: bool = True
    episode_rewards: List[float] = field(default_factory=list)  # primary values of emit_reward at top level
    # the process the attempt runs in: a process forked from it (a ProcessPoolExecutor worker) inherits the
    # scope, but what it records never reaches the attempt (see agl.tracing.emitters)
    pid: int = field(default_factory=os.getpid, repr=False)
    _sequence: Iterator[int] = field(default_factory=itertools.count, repr=False)
    # what must end with the attempt (an LLM stream the agent stopped reading), by id: see end_open_work
    _open: Dict[int, Callable[[], None]] = field(default_factory=dict, repr=False)
    # set once the attempt's rollout has returned: work still going on in its context (an asyncio task it left
    # running) is no longer the attempt's, see current_scope
    ended: bool = field(default=False, repr=False)
    # the attempt's spans started and not yet ended, by span id (the tracer adds and removes them): see end
    open_spans: Dict[int, Any] = field(default_factory=dict, repr=False)
    # how the attempt ended, for the spans end() cuts: "ended", or "timed out" (set by the runner at its timeout)
    outcome: str = field(default="ended", repr=False)

    def next_sequence_id(self) -> int:
        # itertools.count.__next__ is atomic under the GIL: safe from several threads of one attempt.
        return next(self._sequence)

    def open_work(self, key: int, end: Callable[[], None]) -> None:
        """Register ``end`` to be called when the attempt ends, unless :meth:`work_done` says ``key`` ended."""
        self._open[key] = end

    def work_done(self, key: int) -> None:
        self._open.pop(key, None)

    def end_open_work(self) -> int:
        """End what is still open as the attempt ends (before its spans are flushed): an abandoned stream
        otherwise ended its span when the garbage collector found it, after the attempt was reported (a
        batch built at once missed it) or during a later one (the store refused it). Returns how many."""
        ends = list(self._open.values())
        self._open.clear()
        for end in ends:
            end()
        return len(ends)

    def end(self) -> int:
        """The attempt is over (its rollout returned, or ran past its timeout): nothing started from now on
        in its context is stored (:func:`current_scope`), and the spans still open are ended now, marked
        stopped (``agl.span.stopped``, status error "still open when the rollout <outcome>"), so that the stored
        tree is the one the attempt ended with. Otherwise work the runner could not stop (a framework's model
        call on a worker thread, a sync agent past its timeout) ended its spans seconds later, after the
        attempt was reported: stored in the finished attempt without their parents (the agent spans end
        later still), or lost when the store had closed. Their code's own later ``end()`` is ignored
        quietly. Returns how many were ended. Safe to call twice. The runner calls it; :func:`rollout_scope`
        does not, as code that uses it may hand work to threads that goes on after its ``with`` block."""
        self.ended = True
        spans = list(self.open_spans.values())
        for span in sorted(spans, key=lambda s: s.sequence_id, reverse=True):  # the innermost first
            if span.end_time is not None:
                continue
            span.set_attribute(semconv.SPAN_STOPPED, True)
            span.set_status(StatusCode.ERROR, f"still open when the rollout {self.outcome}")
            span.cut = True
            span.end()
        return len(spans)


_current_scope: contextvars.ContextVar[Optional[RolloutScope]] = contextvars.ContextVar("agl_rollout", default=None)


# True inside an ``agl.operation``: rewards emitted there are step rewards, not the episode's reward.
_in_operation: contextvars.ContextVar[bool] = contextvars.ContextVar("agl_in_operation", default=False)


def current_scope() -> Optional[RolloutScope]:
    """The attempt the calling code works for; None outside every rollout, and after the rollout whose context
    this is has returned. Then the code runs in a task the rollout left running (a model stream it stopped
    reading, an SDK run or runtime it keeps): what it records would land in a finished attempt, and a batch
    read later would hold calls its reward never saw. See :func:`ended_scope`."""
    scope = _current_scope.get()
    return None if scope is None or scope.ended else scope


def _current_ids() -> Optional[Tuple[str, str]]:
    scope = current_scope()
    return None if scope is None else (scope.rollout_id, scope.attempt_id)


types.current_rollout_ids = _current_ids  # what ProxyLLM.get_base_url() reads (agl.types sits below this)


def ended_scope() -> Optional[RolloutScope]:
    """The attempt whose rollout has returned, when the calling code still runs in its context (else None)."""
    scope = _current_scope.get()
    return scope if scope is not None and scope.ended else None


def refuse_calls_after_timeout() -> None:
    """Raise :class:`agl.errors.RolloutTimedOutError` in code that still runs for a rollout that ran past its
    timeout. The LLM client hooks call it before each request: a sync agent cannot be stopped, so past its
    timeout its thread went on calling the model beside the rollouts that replaced it, taking the server's
    batch slots from them (under load, the next wave then timed out too). Its next model call now fails,
    which ends most agents; work of a rollout that returned in time (a task it keeps) is not affected."""
    scope = _current_scope.get()
    if scope is not None and scope.ended and scope.outcome == "timed out":
        raise RolloutTimedOutError(scope.rollout_id)


def in_operation() -> bool:
    return _in_operation.get()


def enter_scope(scope: Optional[RolloutScope]) -> contextvars.Token:
    return _current_scope.set(scope)


def exit_scope(token: contextvars.Token) -> None:
    _current_scope.reset(token)


_running = 0  # rollouts this process runs now (Runner attempts and rollout_scope blocks)
_running_lock = threading.Lock()


@contextlib.contextmanager
def running() -> Iterator[None]:
    """Count a rollout as running in this process for as long as the block lasts."""
    global _running
    with _running_lock:
        _running += 1
    try:
        yield
    finally:
        with _running_lock:
            _running -= 1


def rollouts_running() -> int:
    """How many rollouts run in this process now: an LLM call made outside every rollout's context while
    some run is most likely an agent's own, made in a thread that did not inherit the context."""
    return _running


def propagate(fn: Callable[..., T]) -> Callable[..., T]:
    """Bind ``fn`` to a copy of the caller's context (rollout and parent span), for use in another thread."""
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run_in_context(*args: Any, **kwargs: Any) -> T:
        # A Context can be entered by one thread at a time: run each call in its own copy.
        return ctx.copy().run(fn, *args, **kwargs)

    return run_in_context


def carry_scope(fn: Callable[..., T]) -> Callable[..., T]:
    """Bind ``fn`` to the caller's rollout scope and OpenTelemetry context, and nothing else.

    Unlike :func:`propagate`, the worker's other contextvars stay as its starter set them (a framework that
    runs ``fn`` in a context of its own keeps it). Used for the agent's thread pools (``agl.instrument()``
    hooks ``ThreadPoolExecutor.submit``) and CrewAI's threads.
    """
    scope = current_scope()
    span_context = otel_context.get_current()

    @functools.wraps(fn)
    def run_with_scope(*args: Any, **kwargs: Any) -> T:
        scope_token = enter_scope(scope)
        otel_token = otel_context.attach(span_context)
        try:
            return fn(*args, **kwargs)
        finally:
            otel_context.detach(otel_token)
            exit_scope(scope_token)

    return run_with_scope


def submit(executor: Executor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """``executor.submit`` that keeps the caller's rollout and span context in the worker thread."""
    return executor.submit(propagate(fn), *args, **kwargs)


@contextlib.contextmanager
def rollout_scope(
    rollout_id: str, attempt_id: str, *, mode: str = "train", request_token_ids: bool = True
) -> Iterator[RolloutScope]:
    """Attribute the spans made inside to a rollout attempt (the Runner does this for you)."""
    scope = RolloutScope(rollout_id, attempt_id, mode, request_token_ids)
    token = enter_scope(scope)
    try:
        with running():
            yield scope
    finally:
        exit_scope(token)
        scope.end_open_work()
