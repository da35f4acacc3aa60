"""Stop sequences: a request's ``stop`` (read as the recording keeps it, or checked as the policy server takes
it), where a stop string cuts generated text, and how much of a stream's text could still become one."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from agl.openai_wire.apis import require

MAX_STOPS = 4  # OpenAI's limit, and agl's policy server's


def stop_sequences(stop: Any) -> List[str]:
    """The request's ``stop`` strings (chat and Completions: a string or a list of them). A call that ends on one
    reports finish reason ``stop`` as if the model had sampled its end token, so re-tokenization needs them."""
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (list, tuple)):
        return [s for s in stop if isinstance(s, str) and s]
    return []


def checked_stops(stop: Any) -> Tuple[str, ...]:
    """The ``stop`` strings of a request the policy server serves; raises BadRequest for any but a non-empty
    string or a list of at most :data:`MAX_STOPS` of them."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    ok = isinstance(stops, list) and len(stops) <= MAX_STOPS and all(isinstance(s, str) and s for s in stops)
    require(ok, "stop", f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    return tuple(stops)


def stop_position(text: str, stops: Sequence[str], free: Optional[Tuple[str, str]] = None) -> Optional[int]:
    """Where the first stop string starts, ignoring matches that overlap a ``free`` block: the ``(open, close)``
    tags of blocks stop strings do not apply inside (tool calls, whose markup a stop such as ``"\\n"`` or
    ``"}"`` would cut; OpenAI's stop does not cut function arguments either).

    A match overlapping a tail that may still become an opening tag waits: the text is searched again
    after every token, so it is cut there once the tail turns out to be no tag.
    """
    blocks = _blocks(text, free) if free else []
    first: Optional[int] = None
    for stop in filter(None, stops):
        at = text.find(stop)
        while at >= 0 and (first is None or at < first):
            if not any(start < at + len(stop) and at < end for start, end in blocks):
                first = at
                break
            at = text.find(stop, at + 1)
    return first


def _blocks(text: str, tags: Tuple[str, str]) -> List[Tuple[int, int]]:
    """The ``[start, end)`` spans of the blocks ``tags`` open and close; an unclosed one or a trailing
    partial opening tag runs to the end of the text."""
    opening, closing = tags
    spans: List[Tuple[int, int]] = []
    at = text.find(opening)
    while at >= 0:
        close = text.find(closing, at + len(opening))
        end = len(text) if close < 0 else close + len(closing)
        spans.append((at, end))
        at = text.find(opening, end)
    tail = partial_suffix_start(text, (opening,))
    if tail < len(text) and not (spans and spans[-1][1] == len(text)):
        spans.append((tail, len(text)))
    return spans


def streamable_text(text: str, stops: Sequence[str]) -> str:
    """How much of the text generated so far a stream may send without taking anything back: all of it but
    a trailing partial character and a tail that could still grow into a stop string.

    Unlike the chat path's ``streamable_prefix`` (:mod:`agl.openai_wire.chat_format`), whitespace is sent as
    written: the text is not stripped.
    """
    text = text.rstrip("\ufffd")
    return text[: partial_suffix_start(text, stops)]


def partial_suffix_start(text: str, markers: Sequence[str]) -> int:
    """Where the longest tail of ``text`` that is a proper prefix of one of ``markers`` starts."""
    start = len(text)
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                start = min(start, len(text) - size)
                break
    return start
