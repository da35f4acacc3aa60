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

import contextvars
import decimal
import functools
import inspect
import json
import logging
import math
import numbers
import traceback
from typing import Any, Callable, Dict, Mapping, Optional, TypeVar, Union

from agl import semconv
from agl.context import _in_operation, current_scope, in_operation
from agl.otel_span import AglSpan
from agl.tool import receiver_count
from agl.tracer import STEP_SPAN_KINDS, Tracer, get_tracer, record_exception

logger = logging.getLogger("agl.emitters")
F = TypeVar("F", bound=Callable[..., Any])

_warned_outside = False

# The span id (hex, as stored) of the innermost agl.operation the current code runs in.
_current_operation: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("agl_operation", default=None)


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
    if current_scope() is None and not _warned_outside:
        _warned_outside = True
        logger.warning(
            "agl.%s was called outside a rollout: nothing is stored. Run the agent through "
            "Trainer.dev/fit or a Runner, or wrap the call in agl.rollout_scope(...).",
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
    reward = float(number)
    if not math.isfinite(reward):
        raise ValueError(f"{what} must be a finite number, got {reward}: check how the reward is computed")
    return reward


def normalize_reward(value: Union[float, int, bool, Mapping[str, Any]], primary: Optional[str] = None) -> tuple[float, str, Optional[Dict[str, float]]]:
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
) -> float:
    """Record a reward (a number: also a NumPy scalar or one-element array or tensor; or named dimensions with
    one ``primary``); returns the primary value as a float."""
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


def emit_message(message: str, *, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Record a free-text note (shown by ``agl inspect``)."""
    _warn_outside_rollout("emit_message")
    attrs: Dict[str, Any] = {semconv.MESSAGE_BODY: str(message)}
    if attributes:
        attrs.update(attributes)
    with get_tracer().span(semconv.SPAN_MESSAGE, "annotation", attrs):
        pass


def emit_object(obj: Any, *, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Record any JSON-serialisable object (pydantic models and dataclasses are converted)."""
    _warn_outside_rollout("emit_object")
    tracer = get_tracer()
    attrs: Dict[str, Any] = {semconv.OBJECT_TYPE: type(obj).__name__}
    if attributes:
        attrs.update(attributes)
    with tracer.span(semconv.SPAN_OBJECT, "annotation", attrs) as span:
        tracer.set_deferred(span, {semconv.OBJECT_JSON: obj})


def emit_exception(exc: BaseException, *, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Record an exception the agent handled itself (it is not re-raised)."""
    _warn_outside_rollout("emit_exception")
    attrs: Dict[str, Any] = {semconv.ERROR_TYPE: type(exc).__name__}
    if attributes:
        attrs.update(attributes)
    span = get_tracer().start_span(semconv.SPAN_EXCEPTION, "annotation", attrs)
    record_exception(span, exc)
    span.set_attribute("exception.stacktrace", "".join(traceback.format_exception(exc)))
    span.end()


class operation:
    """A named step of the agent, as a context manager or a decorator (sync and async functions).

    Rewards emitted inside are step rewards for the LLM calls made inside. As a decorator (``@agl.operation``
    or ``@agl.operation("name")``), the function's arguments (without ``self``/``cls``) and return value are
    recorded as the operation's input and output; the decorated function stays a plain function, so it still
    binds as a method and an ``async def`` still reads as a coroutine function to the frameworks that ask.
    """

    def __new__(cls, name: Union[str, Callable[..., Any], None] = None, **attributes: Any) -> Any:
        if callable(name):  # used bare: @agl.operation
            return _operation_wrapper(name, getattr(name, "__name__", "operation"), attributes)
        return super().__new__(cls)

    def __init__(self, name: Optional[str] = None, **attributes: Any) -> None:
        self.name = name or "operation"
        self.attributes = attributes
        self._cm: Any = None
        self._span: Any = None
        self._token: Any = None

    # -- context manager -----------------------------------------------------------------------------------
    def __enter__(self) -> "operation":
        attrs = {semconv.OPERATION: self.name, **self.attributes}
        tracer = get_tracer()
        _link_operations(tracer)
        self._cm = tracer.span(semconv.SPAN_OPERATION, "chain", attrs)
        self._span = self._cm.__enter__()
        span_id = format(self._span.get_span_context().span_id, "016x")
        self._token = (_in_operation.set(True), _current_operation.set(span_id))
        return self

    def __exit__(self, *exc: Any) -> Optional[bool]:
        in_operation_token, operation_token = self._token
        _current_operation.reset(operation_token)
        _in_operation.reset(in_operation_token)
        return self._cm.__exit__(*exc)

    def set_input(self, *args: Any, **kwargs: Any) -> None:
        value = kwargs if not args else (args[0] if len(args) == 1 and not kwargs else {"args": args, **kwargs})
        get_tracer().set_deferred(self._span, {semconv.OPERATION_INPUT: value})

    def set_output(self, value: Any) -> None:
        get_tracer().set_deferred(self._span, {semconv.OPERATION_OUTPUT: value})

    # -- decorator -----------------------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        """``@agl.operation("name")``: decorate ``fn``."""
        return _operation_wrapper(fn, self.name, self.attributes)


def _operation_wrapper(fn: F, name: str, attributes: Dict[str, Any]) -> F:
    """``fn`` run inside ``operation(name)``, its arguments and result recorded; sync or async like ``fn``."""
    skip = receiver_count(fn)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with operation(name, **attributes) as op:
                op.set_input(*args[skip:], **kwargs)
                result = await fn(*args, **kwargs)
                op.set_output(result)
                return result

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with operation(name, **attributes) as op:
            op.set_input(*args[skip:], **kwargs)
            result = fn(*args, **kwargs)
            op.set_output(result)
            return result

    return wrapper  # type: ignore[return-value]
