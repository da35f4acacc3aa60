"""agl's tracer: OpenTelemetry API spans of its own, fed to the store through a background batcher.

Why this shape:
- agl never touches the user's global TracerProvider, and has no provider of its own: the spans it starts
  are :class:`agl.otel_span.AglSpan` objects (OpenTelemetry API spans without the SDK's per-span
  machinery, see that module). OpenTelemetry's *context* is shared, so our spans still nest under (and
  above) the user's spans. Integrations get spans from ``get_tracer()``.
- The thread that makes an LLM call does no store I/O: ``on_end`` appends the finished span, as plain
  values, to a bounded deque and a daemon thread converts and writes batches. Payloads (messages, token
  ids, SDK objects) are attached with :meth:`Tracer.set_deferred`. Message lists and SDK objects become
  JSON text when the span ends (a few microseconds): queued containers would be promoted by the garbage
  collector and walked by every full collection on the agent's thread, which costs more. Token ids stay
  tuples, and callables (larger work, e.g. logprobs) run on the writer.
- A full queue drops the span and counts it (``stats().dropped``) with a warning: never silent.
- ``flush()`` at rollout end waits until every span finished so far is in the store.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import StatusCode
from pydantic_core import to_json

from agl import semconv
from agl.context import current_scope
from agl.otel_span import AglSpan, clean_attributes, new_id
from agl.types import Span, SpanEvent, SpanKind

logger = logging.getLogger("agl.tracer")


@dataclass
class TracerStats:
    """Counters a user can read at any time; the runner reports non-zero ``dropped`` per rollout."""

    enqueued: int = 0
    exported: int = 0
    dropped: int = 0  # queue full
    unscoped: int = 0  # finished outside any rollout: not stored
    export_errors: int = 0  # failed store writes (retried)
    rejected: int = 0  # spans the store refused (e.g. unknown rollout): dropped after logging


def encode_attribute(value: Any) -> Any:
    """How a deferred value is stored: callables are called first (work moved off the caller's thread);
    scalars and lists of numbers stay as they are; everything else becomes a JSON string."""
    if callable(value):
        value = value()
    if isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) and _is_number_list(value):
        return value if isinstance(value, list) else list(value)
    try:
        return to_json(value, exclude_none=True, fallback=str).decode()
    except Exception:  # noqa: BLE001 - e.g. SDK models whose pydantic serializer is not built yet
        return to_json(_dumped(value), fallback=str).decode()


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


class StoreSpanProcessor:
    """Queues finished spans of rollouts; a daemon thread writes them in batches.

    The rollout bookkeeping (rollout, attempt, sequence, deferred attributes) travels on the
    :class:`AglSpan` itself, set by :meth:`Tracer.start_span`.
    """

    def __init__(self, max_queue: int = 100_000, batch_size: int = 64, interval: float = 0.2):
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.interval = interval
        self.sink: Any = None  # anything with add_spans(list[Span])
        self.stats = TracerStats()
        self.generation = 0  # + 1 in each forked child: spans started before the fork are not the child's
        self._init_worker_state()
        os.register_at_fork(after_in_child=self._init_worker_state)

    def _init_worker_state(self) -> None:
        # Called again in a forked child: the parent's thread does not exist there, and the parent's
        # queued spans (and those it had open) belong to the parent.
        self.generation += 1
        self._queue: collections.deque[_Finished] = collections.deque()
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._processed = 0  # exported + rejected + dropped-by-worker, under _done
        self._worker: Optional[threading.Thread] = None
        self._stopped = False
        self._warned_drop = False
        self._warned_unscoped = False
        self.stats = TracerStats()

    # -- hot path: runs on the user's thread ----------------------------------------------------------------
    def set_deferred(self, span: Any, attributes: Mapping[str, Any]) -> None:
        if not isinstance(span, AglSpan) or span.rollout_id is None or span.end_time is not None:
            return  # not in a rollout, not ours, or already queued: it will not be stored (with these)
        if span.deferred is None:
            span.deferred = dict(attributes)
        else:
            span.deferred.update(attributes)

    def on_end(self, span: AglSpan) -> None:
        if span.rollout_id is None or span.generation != self.generation:
            self.stats.unscoped += 1
            if not self._warned_unscoped:
                self._warned_unscoped = True
                logger.debug("span %r ended outside any rollout; agl stores spans of rollouts only", span.name)
            return
        if len(self._queue) >= self.max_queue:
            self.stats.dropped += 1
            with self._done:
                self._processed += 1
            if not self._warned_drop:
                self._warned_drop = True
                logger.warning(
                    "agl span queue is full (%d spans): dropping spans. The store is slower than the agent; "
                    "see tracer stats().dropped, raise max_queue or use a faster store.",
                    self.max_queue,
                )
            return
        self._queue.append(_finished(span))
        self.stats.enqueued += 1
        if self._worker is None:
            self._start_worker()
        elif len(self._queue) >= self.batch_size and not self._wake.is_set():
            self._wake.set()  # Event.set takes a lock; once is enough until the writer wakes

    # -- background -----------------------------------------------------------------------------------------
    def _start_worker(self) -> None:
        with self._done:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="agl-span-writer", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        backoff = 0.05
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            while self._queue:
                if self.sink is None:
                    break  # keep spans until a store is attached
                n = min(len(self._queue), self.batch_size)
                spans = self._convert_batch([self._queue[i] for i in range(n)])
                try:
                    self._write(spans)
                except Exception as exc:  # noqa: BLE001 - the store's failure must not kill the writer
                    self.stats.export_errors += 1
                    logger.warning("agl could not write %d spans (will retry): %s", n, exc)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                backoff = 0.05
                for _ in range(n):
                    self._queue.popleft()
                with self._done:
                    self._processed += n
                    self._done.notify_all()
            if self._stopped and not self._queue:
                return

    def _write(self, spans: List[Span]) -> None:
        """Write a batch; if the store refuses it (a bad span, an unknown rollout), write the spans one by
        one so that only the refused ones are dropped (counted and logged). Other errors propagate."""
        try:
            self.sink.add_spans(spans)
            self.stats.exported += len(spans)
            return
        except Exception as exc:  # noqa: BLE001
            if not _is_permanent(exc):
                raise
            if len(spans) == 1:
                self.stats.rejected += 1
                log = logger.debug if self.stats.rejected > 1 else logger.error
                log("agl store refused span %r and it was dropped (stats().rejected counts them): %s", spans[0].name, exc)
                return
        for span in spans:
            self._write([span])

    def _convert_batch(self, batch: List["_Finished"]) -> List[Span]:
        """Convert spans; one that cannot be converted is dropped and counted, never kills the writer."""
        spans = []
        for finished in batch:
            try:
                spans.append(convert_span(finished))
            except Exception as exc:  # noqa: BLE001
                self.stats.rejected += 1
                logger.error("agl could not convert span %r and dropped it: %s", finished[0], exc, exc_info=True)
        return spans

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        with self._done:
            target = self.stats.enqueued + self.stats.dropped
        if self._worker is None:
            return not self._queue
        self._wake.set()
        with self._done:
            while self._processed < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(min(left, 0.05))
                self._wake.set()
        return True

    def shutdown(self) -> None:
        self.force_flush(5_000)
        self._stopped = True
        self._wake.set()


def _is_permanent(exc: Exception) -> bool:
    from agl.errors import AglError, StoreClosedError, StoreUnavailableError

    return isinstance(exc, AglError) and not isinstance(exc, (StoreClosedError, StoreUnavailableError))


# A finished span as queued for the writer: plain values only, so the span object is freed when the caller
# drops it instead of living in the queue. Few tracked objects per queued span keep the agent's thread from
# paying for collections it would not otherwise run: (name, trace id, span id, parent span id, start, end,
# status code, status description, attributes, events, rollout id, attempt id, sequence id, deferred
# attributes).
_Finished = Tuple[
    str, int, int, Optional[int], int, int, StatusCode, Optional[str], Mapping[str, Any], Tuple[Any, ...],
    str, str, int, Optional[Dict[str, Any]],
]


def _finished(span: AglSpan) -> _Finished:
    """What the writer needs of ``span`` (runs on the caller's thread: field reads only, no encoding).

    The attribute dict is handed over as it is: an ended span ignores every change.
    """
    events = span.events
    deferred = span.deferred
    return (
        span.name,
        span.trace_id,
        span.span_id,
        span.parent_id,
        span.start_time,
        span.end_time,
        span.status_code,
        span.status_description,
        span.attributes,
        tuple(events) if events else (),
        span.rollout_id,
        span.attempt_id,
        span.sequence_id,
        _settled(deferred) if deferred else None,
    )


def _settled(deferred: Dict[str, Any]) -> Dict[str, Any]:
    """Deferred payloads that the garbage collector need not walk while they wait for the writer.

    Containers (message lists, SDK objects) become their JSON text now, a few microseconds: a queued list of
    dicts survives collections and is promoted, and every full collection then walks it on the agent's
    thread, which costs more than encoding it. Token ids stay tuples (untracked once seen by the collector),
    callables stay for the writer (they exist to move larger work off this thread).
    """
    for key, value in deferred.items():
        kind = type(value)
        if kind in _PLAIN_TYPES or kind is tuple or callable(value):
            continue
        try:
            deferred[key] = encode_attribute(value)
        except Exception:  # noqa: BLE001 - the writer tries again and records the error on the span
            pass
    return deferred


_SPAN_FIELDS = frozenset(Span.model_fields)


def convert_span(finished: _Finished) -> Span:
    """A queued finished span as an agl Span, its deferred payloads encoded (runs on the writer thread)."""
    (name, trace_id, span_id, parent_id, start, end, status_code, description, attrs, events,
     rollout_id, attempt_id, sequence_id, deferred) = finished
    attributes: Dict[str, Any] = {k: _otel_value(v) for k, v in attrs.items()}
    if deferred:
        for key, value in deferred.items():
            if type(value) in _PLAIN_TYPES:
                attributes[key] = value
                continue
            try:
                attributes[key] = encode_attribute(value)
            except Exception as exc:  # noqa: BLE001 - keep the span, mark the one value that failed
                logger.warning("agl could not encode attribute %s of span %r: %s", key, name, exc)
                attributes[key] = f"agl-encode-error: {type(exc).__name__}: {exc}"
    status = "error" if status_code is StatusCode.ERROR else "ok" if status_code is StatusCode.OK else "unset"
    return _trusted_span(
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
    )


_PLAIN_TYPES = frozenset((str, int, float, bool))


def _trusted_span(**fields: Any) -> Span:
    """A Span from values the tracer built itself, without validation.

    ``Span.model_construct`` costs a few microseconds per span on the writer's critical path; this sets
    the same instance state directly. Every field must be given (checked by tests/test_tracer.py).
    """
    span = Span.__new__(Span)
    object.__setattr__(span, "__dict__", fields)
    object.__setattr__(span, "__pydantic_fields_set__", _SPAN_FIELDS)
    object.__setattr__(span, "__pydantic_extra__", None)
    object.__setattr__(span, "__pydantic_private__", None)
    return span


StartHook = Callable[[AglSpan], None]


class Tracer:
    """The process-wide agl tracer. Get it with :func:`get_tracer`.

    Every span it starts is recorded (no sampling): a training span must be stored even when it nests
    under a span the user's own tracing chose not to sample.
    """

    def __init__(self, max_queue: int = 100_000, batch_size: int = 64) -> None:
        self.processor = StoreSpanProcessor(max_queue=max_queue, batch_size=batch_size)
        self._start_hooks: Tuple[StartHook, ...] = ()  # replaced, never mutated: start_span reads it unlocked
        self._hooks_lock = threading.Lock()

    def set_store(self, store: Any) -> None:
        """Where finished spans go (anything with ``add_spans``). Spans wait in the queue until set."""
        self.processor.sink = store

    @property
    def store(self) -> Any:
        return self.processor.sink

    def stats(self) -> TracerStats:
        return self.processor.stats

    def add_start_hook(self, hook: StartHook) -> None:
        """Call ``hook(span)`` on every span this tracer starts, after its attributes are set (once per hook).

        For agl's own bookkeeping that depends on where a span starts (e.g. the operation it belongs to).
        A hook runs on the caller's thread: keep it to a few attribute reads and writes.
        """
        with self._hooks_lock:
            if hook not in self._start_hooks:
                self._start_hooks = (*self._start_hooks, hook)

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        kind: SpanKind,
        attributes: Optional[Mapping[str, Any]] = None,
        *,
        parent: Optional[otel_trace.Span] = None,
    ) -> Iterator[otel_trace.Span]:
        """Start a span of ``kind`` as the current span; an exception marks it as an error and propagates."""
        span = self.start_span(name, kind, attributes, parent=parent)
        token = otel_context.attach(otel_trace.set_span_in_context(span))
        try:
            yield span
        except GeneratorExit:  # a generator closed early: not a failure
            raise
        except BaseException as exc:
            record_exception(span, exc)
            raise
        finally:
            otel_context.detach(token)
            span.end()

    def start_span(
        self,
        name: str,
        kind: SpanKind,
        attributes: Optional[Mapping[str, Any]] = None,
        *,
        parent: Optional[otel_trace.Span] = None,
        start_time: Optional[int] = None,
    ) -> otel_trace.Span:
        """Start a span without making it current (for callback-style integrations that end it later).

        Its parent is ``parent``, else the current span (agl's or the user's own); without either it
        starts a new trace. Started inside a rollout, it is stored when it ends.
        """
        attrs: Dict[str, Any] = {semconv.SPAN_KIND: kind}
        if attributes:
            attrs.update(clean_attributes(attributes))
        if parent is None:
            parent = otel_trace.get_current_span()
        if type(parent) is AglSpan:
            trace_id, parent_id, trace_state = parent.trace_id, parent.span_id, parent.trace_state
        else:
            parent_context = parent.get_span_context()
            if parent_context.is_valid:
                trace_id, parent_id, trace_state = parent_context.trace_id, parent_context.span_id, parent_context.trace_state
            else:
                trace_id, parent_id, trace_state = new_id(128), None, None
        span = AglSpan(
            name, trace_id, new_id(64), parent_id, trace_state, attrs,
            start_time if start_time is not None else time.time_ns(), self.processor,
        )
        scope = current_scope()
        if scope is not None:
            span.rollout_id = scope.rollout_id
            span.attempt_id = scope.attempt_id
            span.sequence_id = scope.next_sequence_id()
            span.generation = self.processor.generation
        for hook in self._start_hooks:
            hook(span)
        return span

    def set_deferred(self, span: otel_trace.Span, attributes: Mapping[str, Any]) -> None:
        """Attach attributes encoded off the hot path (messages, token ids, raw objects): containers when the
        span ends, callables on the writer thread (see the module docstring).

        Values must not be mutated by the caller afterwards: pass snapshots (e.g. ``list(messages)``).
        """
        self.processor.set_deferred(span, attributes)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every span that has ended is in the store. False if ``timeout`` passed first."""
        return self.processor.force_flush(int(timeout * 1000))


_tracer: Optional[Tracer] = None
_tracer_lock = threading.Lock()


def get_tracer() -> Tracer:
    """The process-wide tracer (created on first use)."""
    global _tracer
    if _tracer is None:
        with _tracer_lock:
            if _tracer is None:
                _tracer = Tracer()
    return _tracer


def record_exception(span: otel_trace.Span, exc: BaseException) -> None:
    """Mark a span as failed with the exception's type and message (without ending it)."""
    span.record_exception(exc)
    span.set_attribute(semconv.ERROR_TYPE, type(exc).__name__)
    span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
