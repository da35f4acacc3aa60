"""How a finished span travels from the agent's thread to the store: a tuple of plain values, then a Span.

The tracer queues :data:`Finished` tuples on the caller's thread (field reads, no encoding); the writer (a
thread, or the writer process of :mod:`agl.tracing.writer_process`) turns them into :class:`agl.types.Span` with
:func:`convert_span`. Both ends live here so that the tuple's layout is defined once.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from opentelemetry.trace import StatusCode
from pydantic_core import to_json

from agl import semconv
from agl.tracing.spans import AglSpan
from agl.types import Span, SpanEvent, array_as_json, trusted

logger = logging.getLogger("agl.tracing.tracer")


class Computed:
    """A deferred attribute that agl computes on the writer (larger work moved off the caller's thread, e.g.
    a response's logprobs). Only these are called: a value of the user's that happens to be callable (a tool
    returning a function or a callable object) is stored as a value, never called by agl."""

    __slots__ = ("compute",)

    def __init__(self, compute: Callable[[], Any]) -> None:
        self.compute = compute


def encode_attribute(value: Any) -> Any:
    """How a deferred value is stored: :class:`Computed` ones are computed first; scalars and lists of
    numbers stay as they are; an iterator is stored as its marked repr (:func:`unconsumed`), never
    iterated; everything else becomes a JSON string."""
    if type(value) is Computed:
        value = value.compute()
    if isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) and _is_number_list(value):
        return value if isinstance(value, list) else list(value)
    kind = type(value)
    if kind not in _CONTAINER_TYPES and _is_iterator(kind):  # to_json would drain it
        return unconsumed(value)
    try:
        return to_json(value, exclude_none=True, fallback=_json_or_str).decode()
    except Exception:  # noqa: BLE001 - e.g. SDK models whose pydantic serializer is not built yet
        return to_json(_dumped(value), fallback=_json_or_str).decode()


def tool_value(value: Any) -> Any:
    """A tool's arguments or result as the semantic conventions store them: strings, numbers and bools as they
    are, anything else JSON text. Lists of numbers too: :func:`encode_attribute` keeps those as lists, which is
    for token ids and logprobs, not for what a tool returned. One-shot iterables are marked, not iterated
    (:func:`recordable`); other containers are encoded when the span ends, as every deferred value is."""
    value = recordable(value)
    if isinstance(value, (list, tuple)) and _is_number_list(value):
        try:
            return to_json(value, fallback=_json_or_str).decode()
        except Exception:  # noqa: BLE001 - left to the writer, which records what went wrong on the span
            return value
    return value


ITERATOR_MARK = "agl-iterator-not-recorded: "


def unconsumed(value: Any) -> str:
    """What is stored for a one-shot iterable (a generator, an iterator, an open file): its repr, marked.

    Serialising it would iterate it (``pydantic_core.to_json`` turns anything with ``__next__`` into a list)
    and leave the agent's own code nothing to read."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not fail the agent
        text = f"<{type(value).__name__}>"
    return ITERATOR_MARK + text


_RECORDABLE_BUDGET = 1_000
_CONTAINERS = (dict, list, tuple, set, frozenset)
_CONTAINER_TYPES = frozenset(_CONTAINERS)


def _is_iterator(kind: type) -> bool:
    """Whether ``to_json`` iterates values of type ``kind``: it turns anything with ``__next__`` into a list
    (after the containers it knows, which the callers check first: a missed ``getattr`` costs ~0.3 us)."""
    return getattr(kind, "__next__", None) is not None


def recordable(value: Any) -> Any:
    """``value`` safe to hand to the writer: one-shot iterables in it (a generator, a ``map``, an open file, at
    the top or inside dicts, lists, tuples and sets) replaced by :func:`unconsumed` markers, so that recording
    never iterates what the agent's code will read. The containers holding one are copied (the agent's own
    are left as they are); a value without any is returned as it is.

    For what the user hands to agl (operation and tool arguments and results, ``emit_object``), on the
    caller's thread: scalars cost one type check, containers a walk of at most ``_RECORDABLE_BUDGET`` items
    (larger ones, e.g. long lists of numbers, are checked that far; objects such as dataclasses and models
    are not looked into)."""
    kind = type(value)
    if kind in _PLAIN_TYPES or value is None:
        return value
    if kind not in _CONTAINER_TYPES:
        if _is_iterator(kind):
            return unconsumed(value)
        if not isinstance(value, _CONTAINERS):
            return value
    return _replaced(value, [_RECORDABLE_BUDGET])


def _replaced(value: Any, budget: List[int]) -> Any:
    """``value`` with its one-shot iterables marked (a copy of each container that holds one)."""
    is_dict = isinstance(value, dict)
    changed: Any = None  # the copy (a dict, or a list for the other containers), made at the first change
    for key, item in value.items() if is_dict else enumerate(value):
        budget[0] -= 1
        if budget[0] < 0:
            break
        new = _replaced_item(item, budget)
        if new is not item:
            if changed is None:
                changed = dict(value) if is_dict else list(value)
            changed[key] = new
    if changed is None:
        return value
    return tuple(changed) if isinstance(value, tuple) else changed


def _replaced_item(item: Any, budget: List[int]) -> Any:
    kind = type(item)
    if kind in _PLAIN_TYPES or item is None:
        return item
    if kind in _CONTAINER_TYPES:
        return _replaced(item, budget)
    if _is_iterator(kind):
        return unconsumed(item)
    return _replaced(item, budget) if isinstance(item, _CONTAINERS) else item


def _json_or_str(value: Any) -> Any:
    """NumPy / torch values as their numbers and lists; any other unknown object as its ``str``."""
    try:
        return array_as_json(value)
    except Exception:  # noqa: BLE001 - a failing tolist() too: a span attribute is never refused
        return str(value)


def _dumped(value: Any) -> Any:
    """Plain data from pydantic models through their own ``model_dump`` (the slow, always-working way)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, (list, tuple)):
        return [_dumped(v) for v in value]
    if isinstance(value, dict):
        return {k: _dumped(v) for k, v in value.items()}
    return value


def _is_number_list(values: Any) -> bool:
    # Token ids and logprobs come from JSON decoded by the SDK, so the ends stand for the whole list; a
    # mixed list that slips through is caught by the store, which refuses just that span (see _write).
    return not values or (type(values[0]) in _NUMBER_TYPES and type(values[-1]) in _NUMBER_TYPES)


_NUMBER_TYPES = (int, float)


def _otel_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# A finished span as queued for the writer: plain values only, so the span object is freed when the caller
# drops it instead of living in the queue. Few tracked objects per queued span keep the agent's thread from
# paying for collections it would not otherwise run: (name, trace id, span id, parent span id, start, end,
# status, status description, attributes, events, rollout id, attempt id, sequence id, deferred
# attributes). The status is the Span's own text ("ok", "error", "unset"), not OpenTelemetry's enum: enum
# members pickle by reference lookup, ~6 us a span on the way to a writer process.
Finished = Tuple[
    str,
    int,
    int,
    Optional[int],
    int,
    int,
    str,
    Optional[str],
    Mapping[str, Any],
    Tuple[Any, ...],
    str,
    str,
    int,
    Optional[Dict[str, Any]],
]

_STATUS_TEXT = {StatusCode.OK: "ok", StatusCode.ERROR: "error", StatusCode.UNSET: "unset"}


def finished(span: AglSpan) -> Finished:
    """What the writer needs of ``span`` (runs on the caller's thread: field reads only, no encoding).

    The attribute dict is handed over as it is: an ended span ignores every change.
    """
    events = span.events
    deferred = span.deferred
    return (  # type: ignore[return-value]  # ids are None outside a rollout; the writer drops those
        span.name,
        span.trace_id,
        span.span_id,
        span.parent_id,
        span.start_time,
        span.end_time,
        _STATUS_TEXT[span.status_code],
        span.status_description,
        span.attributes,
        tuple(events) if events else (),
        span.rollout_id,
        span.attempt_id,
        span.sequence_id,
        settled(deferred) if deferred else None,
    )


def settled(deferred: Dict[str, Any]) -> Dict[str, Any]:
    """Deferred payloads that the garbage collector need not walk while they wait for the writer.

    Containers (message lists, SDK objects) become their JSON text now, a few microseconds: a queued list of
    dicts survives collections and is promoted, and every full collection then walks it on the agent's
    thread, which costs more than encoding it. Token ids stay tuples (untracked once seen by the collector),
    :class:`Computed` values stay for the writer (they exist to move larger work off this thread).
    """
    for key, value in deferred.items():
        kind = type(value)
        if kind in _PLAIN_TYPES or kind is tuple or kind is Computed:
            continue
        try:
            deferred[key] = encode_attribute(value)
        except Exception:  # noqa: BLE001 - the writer tries again and records the error on the span
            pass
    return deferred


def convert_span(item: Finished) -> Span:
    """A queued finished span as an agl Span, its deferred payloads encoded (runs on the writer thread)."""
    (
        name,
        trace_id,
        span_id,
        parent_id,
        start,
        end,
        status,
        description,
        attrs,
        events,
        rollout_id,
        attempt_id,
        sequence_id,
        deferred,
    ) = item
    attributes: Dict[str, Any] = {k: _otel_value(v) for k, v in attrs.items()}
    if deferred:
        for key, value in deferred.items():
            if type(value) in _PLAIN_TYPES:
                attributes[key] = value
                continue
            attributes[key] = _encoded_or_error(key, value, name)
    return trusted(
        Span,
        dict(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            trace_id=format(trace_id, "032x"),
            span_id=format(span_id, "016x"),
            parent_id=format(parent_id, "016x") if parent_id is not None else None,
            name=name,
            kind=attrs.get(semconv.SPAN_KIND, "chain"),
            start_time=start,
            end_time=end,
            status=status,
            error=description if status == "error" else None,
            attributes=attributes,
            events=[
                SpanEvent.model_construct(
                    name=e_name, timestamp=e_time, attributes={k: _otel_value(v) for k, v in (e_attrs or {}).items()}
                )
                for e_name, e_time, e_attrs in events
            ],
        ),
    )


_PLAIN_TYPES = frozenset((str, int, float, bool))


def _encoded_or_error(key: str, value: Any, span_name: str) -> Any:
    """``encode_attribute(value)``; a value that fails is kept as an error text, so the span is still stored."""
    try:
        return encode_attribute(value)
    except Exception as exc:  # noqa: BLE001 - keep the span, mark the one value that failed
        logger.warning("agl could not encode attribute %s of span %r: %s", key, span_name, exc)
        return f"agl-encode-error: {type(exc).__name__}: {exc}"


def without_callables(item: Finished) -> Finished:
    """``item`` with its deferred :class:`Computed` values computed and encoded, so that it can be pickled to
    another process; a user's callable value (a lambda pickles badly) is encoded as a value, not called."""
    deferred = item[13]
    if deferred and any(callable(v) or type(v) is Computed for v in deferred.values()):
        for key, value in deferred.items():
            if callable(value) or type(value) is Computed:
                deferred[key] = _encoded_or_error(key, value, item[0])
    return item
