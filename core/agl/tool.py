"""``@agl.tool``: tool spans for plain-Python agents (framework adapters make their own tool spans).

A tool span records the tool's name, arguments and result, or the exception it raised (error status);
the exception is re-raised unchanged. Automatic Intermediate Rewarding reads these spans.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional, TypeVar, Union, overload

from agl import semconv
from agl.tracer import get_tracer

F = TypeVar("F", bound=Callable[..., Any])


def receiver_count(fn: Callable[..., Any]) -> int:
    """1 if ``fn``'s first parameter is a method's ``self`` or ``cls`` (not worth recording), else 0."""
    try:
        first = next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):  # a callable without a signature
        return 0
    return 1 if first in ("self", "cls") else 0


def _arguments(fn: Callable[..., Any], skip: int, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The call's arguments by parameter name, without the first ``skip`` (a method's ``self``/``cls``)."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {"args": list(args[skip:]), **kwargs}
    return dict(list(bound.arguments.items())[skip:])


@overload
def tool(fn: F) -> F: ...
@overload
def tool(fn: None = None, *, name: Optional[str] = None) -> Callable[[F], F]: ...


def tool(fn: Optional[F] = None, *, name: Optional[str] = None) -> Union[F, Callable[[F], F]]:
    """Decorate a tool function (sync or async): each call becomes a span of kind ``tool``."""

    def decorate(func: F) -> F:
        tool_name = name or func.__name__
        span_name = f"execute_tool {tool_name}"
        skip = receiver_count(func)

        def start() -> tuple[Any, Any]:
            tracer = get_tracer()
            attrs = {semconv.TOOL_NAME: tool_name, semconv.OPERATION_NAME: "execute_tool"}
            return tracer, tracer.span(span_name, "tool", attrs)

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                tracer, cm = start()
                with cm as span:
                    tracer.set_deferred(span, {semconv.TOOL_CALL_ARGUMENTS: _arguments(func, skip, args, kwargs)})
                    result = await func(*args, **kwargs)
                    tracer.set_deferred(span, {semconv.TOOL_CALL_RESULT: result})
                    return result

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tracer, cm = start()
            with cm as span:
                tracer.set_deferred(span, {semconv.TOOL_CALL_ARGUMENTS: _arguments(func, skip, args, kwargs)})
                result = func(*args, **kwargs)
                tracer.set_deferred(span, {semconv.TOOL_CALL_RESULT: result})
                return result

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate
