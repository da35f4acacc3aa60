"""What the SDK hands back for ``with_raw_response`` and ``with_streaming_response`` calls, proxied so that the
call's span gets its answer whenever the user reads it (:mod:`agl.instrumentation.openai_client`)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import wrapt

from agl import semconv
from agl._util.safety import report_internal_error

if TYPE_CHECKING:
    from agl.instrumentation.openai_client import LlmCall


class RawStreamResponse(wrapt.ObjectProxy):
    """A raw response to a streamed request (``with_raw_response`` / ``with_streaming_response``, as the
    Agents SDK streams the Responses API): ``parse()`` returns the stream, which is proxied like a plain
    streamed call so the span gets the reassembled output and token ids. If the body is never parsed, the
    span ends when the response is closed, with what the request said."""

    def __init__(self, wrapped: Any, call: LlmCall, is_async: bool) -> None:
        super().__init__(wrapped)
        self._self_call = call
        self._self_is_async = is_async
        self._self_stream: Any = None  # the proxied stream parse() handed out

    def _self_proxied(self, stream: Any) -> Any:
        try:
            proxy = self._self_call._proxy_stream(stream, self._self_is_async)
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("openai.raw_stream", exc)
            proxy = None
        if proxy is None:
            self._self_call.end_stream(None, None)
            return stream
        self._self_stream = proxy
        return proxy

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        parsed = self.__wrapped__.parse(*args, **kwargs)
        if self._self_is_async and inspect.isawaitable(parsed):
            return self._self_parse_async(parsed)
        return self._self_proxied(parsed)

    async def _self_parse_async(self, parsed: Any) -> Any:
        return self._self_proxied(await parsed)

    def close(self) -> Any:
        result = self.__wrapped__.close()
        if self._self_is_async and inspect.isawaitable(result):
            return self._self_close_async(result)
        self._self_closed()
        return result

    async def _self_close_async(self, result: Any) -> Any:
        try:
            return await result
        finally:
            self._self_closed()

    def _self_closed(self) -> None:
        """The response is closed (its ``with`` block left): a stream read partly ends with what arrived, one
        never parsed with nothing (both marked abandoned); a no-op if the stream already ended the span."""
        if self._self_stream is not None:
            self._self_stream._self_close()
        else:
            self._self_call.end_stream(None, None, semconv.STREAM_ABANDONED)


class UnreadResponse(wrapt.ObjectProxy):
    """A non-streamed response through ``with_streaming_response``: the body is the user's to read, when they
    choose, so the call is recorded when they read it (``read``, ``text``, ``json``, ``parse``) or the
    response is closed (the ``with`` block left), and its span ends then."""

    def __init__(self, wrapped: Any, call: LlmCall, is_async: bool) -> None:
        super().__init__(wrapped)
        self._self_call = call
        self._self_is_async = is_async

    def read(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_then(self.__wrapped__.read, args, kwargs, self._self_call.end_read)

    def text(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_then(self.__wrapped__.text, args, kwargs, self._self_call.end_read)

    def json(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_then(self.__wrapped__.json, args, kwargs, self._self_call.end_read)

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_then(self.__wrapped__.parse, args, kwargs, self._self_call.end_read)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_then(self.__wrapped__.close, args, kwargs, self._self_call.end_unread)

    def _self_then(self, method: Callable[..., Any], args: Any, kwargs: Any, record: Callable[[Any], None]) -> Any:
        """Call the SDK's ``method``, then ``record`` the response, also when it raised (a parse error comes
        after the body was read). Async responses: the same, once the coroutine is awaited."""
        if self._self_is_async:
            return self._self_then_async(method(*args, **kwargs), record)
        try:
            return method(*args, **kwargs)
        finally:
            self._self_record(record)

    async def _self_then_async(self, coroutine: Any, record: Callable[[Any], None]) -> Any:
        try:
            return await coroutine
        finally:
            self._self_record(record)

    def _self_record(self, record: Callable[[Any], None]) -> None:
        try:
            record(self.__wrapped__)
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("openai.response", exc)


def body_read(response: Any) -> bool:
    """Whether the body of an SDK ``APIResponse`` has been read whole (httpx keeps it then)."""
    try:
        _ = response.http_response.content  # raises until the body was read
    except Exception:  # noqa: BLE001 - httpx.ResponseNotRead, or the body was streamed away
        return False
    return True


def body_untouched(response: Any) -> bool:
    """Whether nothing of the body has been read (its stream was never consumed)."""
    return not getattr(response.http_response, "is_stream_consumed", True)
