"""The SDK's streams, proxied: every item goes to the user unchanged and into the call's accumulator.

A streamed call returns before the model has answered, so its span ends when the stream does: exhausted,
closed (``close()``, ``with`` exit, garbage collection) or failed (error status). The proxies are
``wrapt.ObjectProxy`` objects, so ``isinstance(s, openai.Stream)``, ``s.response`` and the SDK's own stream
helpers (``chat.completions.stream()`` iterates the stream ``create`` returned) keep working. The
accumulators, which reassemble the answer, are wire-format code: :mod:`agl.openai_wire.streams`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol

import wrapt

from agl import semconv
from agl._util.safety import report_internal_error
from agl.openai_wire.streams import Accumulator
from agl.tracing.context import current_scope


class StreamOwner(Protocol):
    """The instrumented call a stream belongs to (``LlmCall``); ending it twice does nothing."""

    def end_stream(
        self, accumulator: Optional[Accumulator], error: Optional[BaseException], unfinished: Optional[str] = None
    ) -> None:
        """``unfinished``: the flag attribute saying why the answer is incomplete (``agl.llm.stream_abandoned``
        or ``agl.llm.stream_truncated``), None for a stream that ended with the whole answer or an error."""
        ...


class _StreamProxyBase(wrapt.ObjectProxy):
    """Shared state: the owning call, the accumulator (None once it failed) and the end-once logic."""

    def __init__(self, stream: Any, owner: StreamOwner, accumulator: Accumulator) -> None:
        super().__init__(stream)
        self._self_owner: Optional[StreamOwner] = owner
        self._self_accumulator: Optional[Accumulator] = accumulator
        self._self_scope = current_scope()
        if self._self_scope is not None:  # a stream the agent stops reading ends with its attempt
            self._self_scope.open_work(id(self), _abandon_later(weakref.ref(self)))

    def _self_add(self, item: Any) -> None:
        accumulator = self._self_accumulator
        if accumulator is None:
            return
        try:
            accumulator.add(item)
        except Exception as exc:  # noqa: BLE001 - a stream we cannot read is still the user's stream
            report_internal_error("openai.stream_item", exc)
            self._self_accumulator = None

    def _self_end(self, error: Optional[BaseException], unfinished: Optional[str] = None) -> None:
        owner = self._self_owner
        if owner is not None:
            self._self_owner = None
            if self._self_scope is not None:
                self._self_scope.work_done(id(self))
            owner.end_stream(self._self_accumulator, error, unfinished)

    def _self_unless_finished(self, flag: str) -> Optional[str]:
        """``flag`` if the server had not yet said the response was complete when the stream ended."""
        accumulator = self._self_accumulator
        return flag if accumulator is not None and not accumulator.finished() else None

    def _self_run_out(self) -> None:
        """The stream ran out. Without the answer's end (a finish reason, the Responses API's final event)
        the server or something on the way (a proxy, a load balancer's timeout) closed it mid-answer, which
        the SDK does not report: the span is marked ``agl.llm.stream_truncated``, not stored as complete."""
        self._self_end(None, self._self_unless_finished(semconv.STREAM_TRUNCATED))

    def _self_close(self) -> None:
        """The stream is closed, or dropped, before it ran out: its span ends with what had arrived, marked
        ``agl.llm.stream_abandoned`` unless the server had already said the response was complete (the
        agent broke out of its loop, left its ``with`` block, or stopped reading mid-answer)."""
        self._self_end(None, self._self_unless_finished(semconv.STREAM_ABANDONED))

    def _self_abandon(self) -> None:
        """The stream's attempt ended while the stream was still open: the agent stopped reading it."""
        try:
            self._self_close()
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("openai.stream_abandoned", exc)

    def __del__(self) -> None:
        # Collected before its attempt ended (or outside any attempt): it still ends its span with what it saw.
        try:
            if self._self_owner is not None:
                self._self_close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _abandon_later(proxy: weakref.ReferenceType[_StreamProxyBase]) -> Callable[[], None]:
    """What the attempt's end calls; a weak reference, so a stream the agent drops is still collected (and
    ended) at once, not kept until the attempt ends."""

    def abandon() -> None:
        stream = proxy()
        if stream is not None:
            stream._self_abandon()

    return abandon


class StreamProxy(_StreamProxyBase):
    """Wraps ``openai.Stream``."""

    def __iter__(self) -> StreamProxy:
        return self

    def __next__(self) -> Any:
        try:
            item = self.__wrapped__.__next__()
        except StopIteration:
            self._self_run_out()
            raise
        except BaseException as exc:
            self._self_end(exc)
            raise
        self._self_add(item)
        return item

    def __enter__(self) -> StreamProxy:
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return self.__wrapped__.__exit__(*exc_info)
        finally:
            self._self_close()

    def close(self) -> Any:
        try:
            return self.__wrapped__.close()
        finally:
            self._self_close()


class AsyncStreamProxy(_StreamProxyBase):
    """Wraps ``openai.AsyncStream``."""

    def __aiter__(self) -> AsyncStreamProxy:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self.__wrapped__.__anext__()
        except StopAsyncIteration:
            self._self_run_out()
            raise
        except BaseException as exc:
            self._self_end(exc)
            raise
        self._self_add(item)
        return item

    async def __aenter__(self) -> AsyncStreamProxy:
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        try:
            return await self.__wrapped__.__aexit__(*exc_info)
        finally:
            self._self_close()

    async def close(self) -> Any:
        try:
            return await self.__wrapped__.close()
        finally:
            self._self_close()

    async def aclose(self) -> Any:
        try:
            return await self.__wrapped__.aclose()
        finally:
            self._self_close()
