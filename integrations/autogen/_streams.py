"""Run an async generator inside a span without keeping that span attached across its ``yield``s.

AutoGen's agents and teams answer through async generators (``on_messages_stream``, ``run_stream``). The
usual ``with tracer.start_as_current_span(...)`` around ``async for ... yield`` attaches the span when the
generator starts and detaches it when the generator ends, and the end may run in another context: a
consumer that stops early leaves the generator to be closed by the event loop's finalizer task, where the
detach fails ("Failed to detach context") and the consumer's context kept our span as current meanwhile.

Here the span's context is attached only while the wrapped generator runs (one step, between two
``yield``s) and detached before the item is handed to the consumer, so every attach is undone in the same
context. Whatever the generator itself makes current during a step (AutoGen opens its own telemetry spans
this way) is carried into its next step. The span starts when the consumer starts iterating (a stream
never iterated leaves no span open) and ends when the generator finishes: with error status if it raised,
without if the consumer closed it early.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Callable, Optional, Tuple, TypeVar

from opentelemetry import context as otel_context
from opentelemetry.trace import Span

from agl._util.safety import guard
from agl.instrumentation.framework import finish_span

T = TypeVar("T")


SpanStart = Callable[[], Optional[Tuple[Span, otel_context.Context]]]


async def iterate_in_span(agen: AsyncGenerator[T, Any], start: SpanStart) -> AsyncGenerator[T, Any]:
    """Yield what ``agen`` yields (``asend``/``athrow``/``aclose`` pass through) inside the span ``start()``
    opens; the context it returns (holding the span, and whatever else the caller needs) is current while
    ``agen`` runs. ``start`` returning None (agl failed to open the span) leaves ``agen`` as it is."""
    opened = start()
    span, context = opened if opened is not None else (None, otel_context.get_current())
    error: Optional[BaseException] = None
    send: Any = None
    thrown: Optional[BaseException] = None
    try:
        while True:
            token = otel_context.attach(context)
            try:
                item = await (agen.athrow(thrown) if thrown is not None else agen.asend(send))
            except StopAsyncIteration:
                return
            finally:
                context = otel_context.get_current()
                otel_context.detach(token)
            send, thrown = None, None
            try:
                send = yield item
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the consumer: the wrapped generator decides
                thrown = exc
    except GeneratorExit:
        await _close(agen, context)
        raise
    except BaseException as exc:
        error = exc
        raise
    finally:
        if span is not None:
            with guard("autogen.span_end"):
                finish_span(span, error)


async def _close(agen: AsyncGenerator[Any, Any], context: otel_context.Context) -> None:
    """Close the wrapped generator with the span current: its cleanup may still make spans."""
    token = otel_context.attach(context)
    try:
        await agen.aclose()
    finally:
        otel_context.detach(token)
