"""``@agl.tool``: tool spans for plain-Python agents (framework adapters make their own tool spans).

A tool span records the tool's name, arguments and result, or the exception it raised (error status);
the exception is re-raised unchanged. Automatic Intermediate Rewarding reads these spans.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple, TypeVar, Union, overload

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from agl import semconv
from agl.tracing.encoding import recordable, tool_value
from agl.tracing.tracer import get_tracer, record_exception

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
    """Decorate a tool function (sync or async, also a generator): each call becomes a span of kind ``tool``.

    A generator tool yields to its caller exactly as it would undecorated; its span covers the iteration
    (from the first ``next`` until it is exhausted, closed or raises) and is current only while the tool's
    own code runs, so a reward emitted there is a step reward. Its result is what it returns (``return x``
    in a generator), if anything: the yielded items are the caller's and are not recorded. Iterators and
    open files among the arguments or returned are recorded as their repr, never iterated."""

    def decorate(func: F) -> F:
        tool_name = name or func.__name__
        span_name = f"execute_tool {tool_name}"
        skip = receiver_count(func)

        attrs = {semconv.TOOL_NAME: tool_name, semconv.OPERATION_NAME: "execute_tool"}

        def start(args: tuple, kwargs: Dict[str, Any]) -> tuple[Any, Any]:
            tracer = get_tracer()
            span = tracer.start_span(span_name, "tool", attrs)
            tracer.set_deferred(span, {semconv.TOOL_CALL_ARGUMENTS: recordable(_arguments(func, skip, args, kwargs))})
            return tracer, span

        def result_of(tracer: Any, span: Any, result: Any) -> None:
            tracer.set_deferred(span, {semconv.TOOL_CALL_RESULT: tool_value(result)})

        if inspect.isasyncgenfunction(func):
            return async_generator_in_span(func, start, span_current, result_of)
        if inspect.isgeneratorfunction(func):
            return generator_in_span(func, start, span_current, result_of)

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                tracer = get_tracer()
                with tracer.span(span_name, "tool", attrs) as span:
                    tracer.set_deferred(
                        span, {semconv.TOOL_CALL_ARGUMENTS: recordable(_arguments(func, skip, args, kwargs))}
                    )
                    result = await func(*args, **kwargs)
                    tracer.set_deferred(span, {semconv.TOOL_CALL_RESULT: tool_value(result)})
                    return result

            return async_wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tracer = get_tracer()
            with tracer.span(span_name, "tool", attrs) as span:
                tracer.set_deferred(
                    span, {semconv.TOOL_CALL_ARGUMENTS: recordable(_arguments(func, skip, args, kwargs))}
                )
                result = func(*args, **kwargs)
                tracer.set_deferred(span, {semconv.TOOL_CALL_RESULT: tool_value(result)})
                return result

        return wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps

    return decorate(fn) if fn is not None else decorate


@contextlib.contextmanager
def span_current(span: Any) -> Iterator[None]:
    """``span`` is the current span while the block runs (one step of a generator in a span)."""
    token = otel_context.attach(otel_trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


# (args, kwargs) -> (tracer, span started and not current, its input recorded)
Start = Callable[[tuple, Dict[str, Any]], Tuple[Any, Any]]
# span -> a context manager inside which the span is current (with whatever else its kind sets)
Resume = Callable[[Any], ContextManager[Any]]
# (tracer, span, return value) -> records the result
Finish = Callable[[Any, Any, Any], None]


def generator_in_span(func: F, start: Start, resume: Resume, finish: Finish) -> F:
    """A generator function that yields what ``func`` yields (``send`` and ``throw`` pass through) inside a
    span: started at the first ``next``, current only while ``func``'s code runs (the caller's code between
    items is not in it), ended when ``func`` returns, raises (an error span) or is closed. Its return value
    is recorded with ``finish`` unless it is None."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracer, span = start(args, kwargs)
        try:
            with resume(span):
                gen = func(*args, **kwargs)
            sent: Any = None
            thrown: Optional[BaseException] = None
            while True:
                with resume(span):
                    try:
                        item = gen.send(sent) if thrown is None else gen.throw(thrown)
                    except StopIteration as stop:
                        if stop.value is not None:
                            finish(tracer, span, stop.value)
                        return stop.value
                thrown = None
                try:
                    sent = yield item
                except GeneratorExit:
                    with resume(span):
                        gen.close()
                    raise
                except BaseException as exc:  # noqa: BLE001 - thrown in by the caller: func gets it where it yielded
                    thrown, sent = exc, None
        except GeneratorExit:  # closed early (or collected): not a failure
            raise
        except BaseException as exc:
            record_exception(span, exc)
            raise
        finally:
            span.end()

    return wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps


def async_generator_in_span(func: F, start: Start, resume: Resume, finish: Finish) -> F:
    """:func:`generator_in_span` for an async generator function (``asend``, ``athrow``, ``aclose``)."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracer, span = start(args, kwargs)
        try:
            with resume(span):
                agen = func(*args, **kwargs)
            sent: Any = None
            thrown: Optional[BaseException] = None
            while True:
                with resume(span):
                    try:
                        item = await (agen.asend(sent) if thrown is None else agen.athrow(thrown))
                    except StopAsyncIteration:
                        return
                thrown = None
                try:
                    sent = yield item
                except GeneratorExit:
                    with resume(span):
                        await agen.aclose()
                    raise
                except BaseException as exc:  # noqa: BLE001 - thrown into the wrapped generator, as its caller threw it
                    thrown, sent = exc, None
        except GeneratorExit:
            raise
        except BaseException as exc:
            record_exception(span, exc)
            raise
        finally:
            span.end()

    return wrapper  # type: ignore[return-value]  # the wrapper has the signature of the function it wraps
