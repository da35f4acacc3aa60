"""Emitters: what an agent reports besides its LLM and tool calls (rewards, messages, objects, errors).

Reward rule (docs/rewards.md), so that no reward is ever counted twice:
- The rollout's *episode* reward is the number ``rollout()`` returns; if it returns None, it is the last
  ``emit_reward`` made outside any ``agl.operation``, tool or LLM call. Returning 1.0 *and* emitting 1.0
  yields 1.0. If both exist and differ, the returned value wins and a warning says so.
- ``emit_reward`` inside an ``agl.operation(...)``, or while a tool or LLM span is current (e.g. inside an
  ``@agl.tool`` function), is a *step* reward: it belongs to the LLM call that caused it (LightningRL credit
  assignment), never to the episode.

Step-reward linkage: framework adapters may parent an LLM span to their own agent span rather than to the
current span (LangGraph nodes do), so an operation's LLM calls are not always its descendants. Every llm,
tool and reward span started inside an operation therefore carries the operation's span id
(``agl.operation.span_id``), set by a start hook the first operation adds to agl's tracer.
"""

from __future__ import annotations

import contextlib
import contextvars
import decimal
import functools
import inspect
import json
import logging
import math
import numbers
import os
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple, TypeVar, Union

from agl import semconv
from agl.tracing.context import _in_operation, current_scope, in_operation
from agl.tracing.encoding import recordable
from agl.tracing.spans import AglSpan
from agl.tracing.tool import async_generator_in_span, generator_in_span, receiver_count, span_current
from agl.tracing.tracer import STEP_SPAN_KINDS, Tracer, get_tracer, record_exception

logger = logging.getLogger("agl.tracing.emitters")
F = TypeVar("F", bound=Callable[..., Any])

_warned_outside = False

# The span id (hex, as stored) of the innermost agl.operation the current code runs in.
_current_operation: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("agl_operation", default=None)

# The agl.operation objects entered (and not yet exited) in the current context, innermost last, each with
# what its exit undoes: (operation, span context manager, span, in-operation token, operation token). Per
# entry and per context, so that one operation object can be entered again while it is open (recursion)
# and by concurrent asyncio tasks or threads, as any context manager can.
_Entry = Tuple["operation", Any, Any, contextvars.Token, contextvars.Token]
_entries: contextvars.ContextVar[Tuple[_Entry, ...]] = contextvars.ContextVar("agl_operation_entries", default=())


def _link_to_operation(span: AglSpan) -> None:
    """Marks llm and tool spans started inside an ``agl.operation`` with the operation's span id."""
    operation_id = _current_operation.get()
    if operation_id is not None and span.attributes.get(semconv.SPAN_KIND) in STEP_SPAN_KINDS:
        span.set_attribute(semconv.OPERATION_SPAN_ID, operation_id)


def _link_operations(tracer: Tracer) -> None:
    """Add the operation linker to ``tracer`` (on the first operation, so plain tracing pays nothing)."""
    tracer.add_start_hook(_link_to_operation)


def _warn_outside_rollout(what: str) -> None:
    global _warned_outside
    if _warned_outside:
        return
    scope = current_scope()
    if scope is None:
        _warned_outside = True
        logger.warning(
            "agl.%s was called outside a rollout: nothing is stored. Run the agent through "
            "Trainer.dev/fit or a Runner, or wrap the call in agl.rollout_scope(...).",
            what,
        )
    elif scope.pid != os.getpid():
        _warned_outside = True
        logger.warning(
            "agl.%s was called in a process forked from the rollout's (a ProcessPoolExecutor or "
            "multiprocessing worker): nothing it emits reaches the rollout. Return the value from the worker "
            "and emit it in the rollout's own process.",
            what,
        )


def reward_number(value: Any, what: str, expected: str = "a number") -> float:
    """``value`` as a finite float, or an error that says what was wrong, where the reward was made.

    Rewards are often computed with NumPy or torch: their scalars (``np.float32``, ``np.int64``: registered
    as ``numbers.Real``) and one-element arrays or tensors (``.item()``) count as numbers, as do ``Fraction``
    and ``Decimal``. Strings do not
    (``"0.5"`` is more likely a bug than a reward). A NaN or infinite reward raises here rather than reach
    the store (SQLite would keep it as "no reward") or the advantages (it would spoil a whole task group).
    """
    number = value
    if not isinstance(number, (numbers.Real, decimal.Decimal)):
        item = getattr(value, "item", None)
        try:
            number = item() if callable(item) and not isinstance(value, (str, bytes)) else None
        except (ValueError, RuntimeError) as exc:  # NumPy / torch: more than one element
            raise TypeError(
                f"{what} must be one number, got {type(value).__name__} of shape {getattr(value, 'shape', '?')}: "
                "reduce it first (e.g. .mean())"
            ) from exc
        if not isinstance(number, numbers.Real):
            raise TypeError(f"{what} must be {expected}, got {type(value).__name__} {value!r:.60}")
    try:
        reward = float(number)
    except OverflowError as exc:  # an int or Fraction beyond a float's range (10**400)
        raise ValueError(
            f"{what} is out of range: {value!r:.60} does not fit in a float (at most ~1.8e308); "
            "check how the reward is computed"
        ) from exc
    if not math.isfinite(reward):
        raise ValueError(f"{what} must be a finite number, got {reward}: check how the reward is computed")
    return reward


def normalize_reward(
    value: Union[float, int, bool, Mapping[str, Any]], primary: Optional[str] = None
) -> tuple[float, str, Optional[Dict[str, float]]]:
    """(primary value, primary name, named dimensions or None) for a scalar or ``{name: value}`` reward."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("emit_reward got an empty dict: give at least one {name: value}")
        dims = {str(k): reward_number(v, f"reward {k!r}") for k, v in value.items()}
        if primary is None:
            if len(dims) > 1:
                raise ValueError(
                    f"emit_reward got several reward dimensions {sorted(dims)}: say which one is the primary "
                    "reward with primary='<name>'"
                )
            primary = next(iter(dims))
        if primary not in dims:
            raise ValueError(f"primary={primary!r} is not one of the reward dimensions {sorted(dims)}")
        return dims[primary], primary, dims
    return reward_number(value, "a reward", "a number or a dict of numbers"), primary or "primary", None


def emit_reward(
    value: Union[float, int, bool, Mapping[str, Any]],
    *,
    primary: Optional[str] = None,
    attributes: Optional[Mapping[str, Any]] = None,
    primary_key: Optional[str] = None,
) -> float:
    """Record a reward (a number: also a NumPy scalar or one-element array or tensor; or named dimensions with
    one ``primary``); returns the primary value as a float. ``primary_key`` is Agent Lightning's name for
    ``primary``, accepted with a DeprecationWarning.

    ``attributes`` are added to the reward span; the reward's own keys (``agl.reward.*``, the span kind and
    the operation link) are refused with a ValueError: they are what trainers read, so they must say what
    was emitted."""
    if attributes:
        reserved = sorted(str(k) for k in attributes if str(k).startswith("agl.reward.") or k in _REWARD_OWN_KEYS)
        if reserved:
            raise ValueError(
                f"emit_reward(attributes=...) may not set {', '.join(reserved)}: agl sets these from the reward "
                "itself (pass the value, primary= or named dimensions instead; use other keys for extra data)"
            )
    if primary_key is not None:
        if primary is not None and primary != primary_key:
            raise ValueError(f"emit_reward got primary={primary!r} and primary_key={primary_key!r}: pass primary= only")
        warnings.warn("emit_reward(primary_key=) is now primary=", DeprecationWarning, stacklevel=2)
        primary = primary_key
    reward, name, dims = normalize_reward(value, primary)
    _warn_outside_rollout("emit_reward")
    tracer = get_tracer()
    parent = tracer.default_parent()  # also a LangChain tool's span, which is never current
    step = in_operation() or tracer.open_step_kind(parent) is not None
    scope_kind = "step" if step else "episode"
    attrs: Dict[str, Any] = {
        semconv.REWARD_VALUE: reward,
        semconv.REWARD_PRIMARY: name,
        semconv.REWARD_SOURCE: "emitted",
        semconv.REWARD_SCOPE: scope_kind,
    }
    operation_id = _current_operation.get()
    if operation_id is not None:
        attrs[semconv.OPERATION_SPAN_ID] = operation_id
    if dims is not None:
        attrs[semconv.REWARD_DIMENSIONS] = json.dumps(dims)
    if attributes:
        attrs.update(attributes)
    with tracer.span(semconv.SPAN_REWARD, "reward", attrs, parent=parent):
        pass
    scope = current_scope()
    if scope is not None and scope_kind == "episode":
        scope.episode_rewards.append(reward)
    return reward


_REWARD_OWN_KEYS = frozenset((semconv.SPAN_KIND, semconv.OPERATION_SPAN_ID))


def emit_message(message: str, *, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Record a free-text note (shown by ``agl inspect``)."""
    _warn_outside_rollout("emit_message")
    attrs: Dict[str, Any] = {semconv.MESSAGE_BODY: str(message)}
    if attributes:
        attrs.update(attributes)
    with get_tracer().span(semconv.SPAN_MESSAGE, "annotation", attrs):
        pass


def emit_object(obj: Any, *, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Record any JSON-serialisable object (pydantic models and dataclasses are converted). An iterator, a
    generator or an open file is recorded as its repr (marked ``agl-iterator-not-recorded: ``), never
    iterated: the agent's code may still read it."""
    _warn_outside_rollout("emit_object")
    tracer = get_tracer()
    attrs: Dict[str, Any] = {semconv.OBJECT_TYPE: type(obj).__name__}
    if attributes:
        attrs.update(attributes)
    with tracer.span(semconv.SPAN_OBJECT, "annotation", attrs) as span:
        tracer.set_deferred(span, {semconv.OBJECT_JSON: recordable(obj)})


def emit_exception(exc: BaseException, *, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Record an exception the agent handled itself (it is not re-raised): pass the exception object."""
    if not isinstance(exc, BaseException):
        raise TypeError(
            f"emit_exception takes the exception object (except ValueError as exc: agl.emit_exception(exc)), "
            f"got {type(exc).__name__} {exc!r:.60}; to record a text, use agl.emit_message"
        )
    _warn_outside_rollout("emit_exception")
    attrs: Dict[str, Any] = {semconv.ERROR_TYPE: type(exc).__name__}
    if attributes:
        attrs.update(attributes)
    span = get_tracer().start_span(semconv.SPAN_EXCEPTION, "annotation", attrs)
    record_exception(span, exc)
    span.set_attribute("exception.stacktrace", "".join(traceback.format_exception(exc)))
    span.end()


class operation:
    """A named step of the agent, as a context manager or a decorator (sync and async functions, also
    generators).

    Rewards emitted inside are step rewards for the LLM calls made inside. As a decorator (``@agl.operation``,
    ``@agl.operation()`` or ``@agl.operation("name")``; without a name, the function's name), the function's
    arguments (without ``self``/``cls``) and return value are recorded as the operation's input and output;
    the decorated function stays a plain function, so it still binds as a method and an ``async def`` still
    reads as a coroutine function to the frameworks that ask. A decorated generator yields to its caller as
    it would undecorated, its span covering the iteration (see :func:`agl.tracing.tool.generator_in_span`).

    One object may be entered several times at once (nested, recursion, concurrent asyncio tasks or
    threads): each ``with`` opens its own span.
    """

    def __new__(cls, name: Union[str, Callable[..., Any], None] = None, **attributes: Any) -> Any:
        if callable(name):  # used bare: @agl.operation
            return _operation_wrapper(name, getattr(name, "__name__", "operation"), attributes)
        return super().__new__(cls)

    def __init__(self, name: Optional[str] = None, **attributes: Any) -> None:
        self._given_name = name
        self.name = name or "operation"
        self.attributes = attributes
        self._span: Any = None  # the span of the latest entry (for set_input/set_output outside its context)

    # -- context manager -----------------------------------------------------------------------------------
    def __enter__(self) -> operation:
        attrs = {semconv.OPERATION: self.name, **self.attributes}
        tracer = get_tracer()
        _link_operations(tracer)
        cm = tracer.span(semconv.SPAN_OPERATION, "chain", attrs)
        span = cm.__enter__()
        span_id = format(span.get_span_context().span_id, "016x")
        entry = (self, cm, span, _in_operation.set(True), _current_operation.set(span_id))
        _entries.set(_entries.get() + (entry,))
        self._span = span
        return self

    def __exit__(self, *exc: Any) -> Optional[bool]:
        entries = _entries.get()
        for index in range(len(entries) - 1, -1, -1):
            if entries[index][0] is self:
                break
        else:
            raise RuntimeError(
                f"agl.operation({self.name!r}) exited where it was not entered: enter and exit it in the same "
                "thread or asyncio task (with agl.operation(...): ... does)"
            )
        _, cm, _span, in_operation_token, operation_token = entries[index]
        _entries.set(entries[:index] + entries[index + 1 :])
        _current_operation.reset(operation_token)
        _in_operation.reset(in_operation_token)
        return cm.__exit__(*exc)

    def _current_span(self) -> Any:
        """The span of this operation's innermost entry in the current context (else its latest)."""
        for entry in reversed(_entries.get()):
            if entry[0] is self:
                return entry[2]
        return self._span

    def set_input(self, *args: Any, **kwargs: Any) -> None:
        get_tracer().set_deferred(
            self._current_span(), {semconv.OPERATION_INPUT: recordable(_operation_input(args, kwargs))}
        )

    def set_output(self, value: Any) -> None:
        get_tracer().set_deferred(self._current_span(), {semconv.OPERATION_OUTPUT: recordable(value)})

    # -- decorator -----------------------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        """``@agl.operation("name")`` or ``@agl.operation()``: decorate ``fn``."""
        return _operation_wrapper(fn, self._given_name or str(getattr(fn, "__name__", "operation")), self.attributes)


@contextlib.contextmanager
def _in_operation_span(span: Any) -> Iterator[None]:
    """Inside operation ``span`` (current span, step rewards, llm linkage): one step of a decorated generator."""
    in_operation_token = _in_operation.set(True)
    operation_token = _current_operation.set(format(span.get_span_context().span_id, "016x"))
    try:
        with span_current(span):
            yield
    finally:
        _current_operation.reset(operation_token)
        _in_operation.reset(in_operation_token)


def _operation_input(args: tuple, kwargs: Dict[str, Any]) -> Any:
    return kwargs if not args else (args[0] if len(args) == 1 and not kwargs else {"args": args, **kwargs})


def _operation_wrapper(fn: F, name: str, attributes: Dict[str, Any]) -> F:
    """``fn`` run inside ``operation(name)``, its arguments and result recorded; sync or async like ``fn``."""
    skip = receiver_count(fn)

    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):

        def start(args: tuple, kwargs: Dict[str, Any]) -> Tuple[Any, Any]:
            tracer = get_tracer()
            _link_operations(tracer)
            span = tracer.start_span(semconv.SPAN_OPERATION, "chain", {semconv.OPERATION: name, **attributes})
            tracer.set_deferred(span, {semconv.OPERATION_INPUT: recordable(_operation_input(args[skip:], kwargs))})
            return tracer, span

        def finish(tracer: Any, span: Any, result: Any) -> None:
            tracer.set_deferred(span, {semconv.OPERATION_OUTPUT: recordable(result)})

        in_span = async_generator_in_span if inspect.isasyncgenfunction(fn) else generator_in_span
        return in_span(fn, start, _in_operation_span, finish)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with operation(name, **attributes) as op:
                op.set_input(*args[skip:], **kwargs)
                result = await fn(*args, **kwargs)
                op.set_output(result)
                return result

        return async_wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with operation(name, **attributes) as op:
            op.set_input(*args[skip:], **kwargs)
            result = fn(*args, **kwargs)
            op.set_output(result)
            return result

    return wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps
