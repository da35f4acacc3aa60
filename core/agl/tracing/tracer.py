"""agl's tracer: OpenTelemetry API spans of its own, fed to the store through a background batcher.

Why this shape:
- agl never touches the user's global TracerProvider, and has no provider of its own: the spans it starts
  are :class:`agl.tracing.spans.AglSpan` objects (OpenTelemetry API spans without the SDK's per-span
  machinery, see that module). OpenTelemetry's *context* is shared, so our spans still nest under (and
  above) the user's spans. Integrations get spans from ``get_tracer()``.
- The thread that makes an LLM call does no store I/O: ``on_end`` appends the finished span, as plain
  values, to a bounded deque and a daemon thread converts and writes batches. Payloads (messages, token
  ids, SDK objects) are attached with :meth:`Tracer.set_deferred`. Message lists and SDK objects become
  JSON text when the span ends (a few microseconds): queued containers would be promoted by the garbage
  collector and walked by every full collection on the agent's thread, which costs more. Token ids stay
  tuples, and ``Computed`` values (larger work, e.g. logprobs) are computed on the writer.
- The writer is a thread by default, or a child process (``set_writer("process")`` / ``AGL_SPAN_WRITER``):
  a CPU-bound agent shares its GIL with a writer thread and pays for every span's encoding and insert,
  while a process works on another core (:mod:`agl.tracing.writer_process`). Conversion lives in
  :mod:`agl.tracing.encoding`, the store write in :mod:`agl.tracing.export`, the same for both.
- A full queue drops the span and counts it (``stats().dropped``) with a warning: never silent.
- With an OTLP endpoint (``set_otlp``, ``agl.instrument(otlp_endpoint=...)``, ``AGL_OTLP_ENDPOINT``) each queued span
  is also handed to :mod:`agl.tracing.otlp`'s exporter: a bounded queue of its own and a thread that posts batches.
- ``flush()`` at rollout end waits until every span finished so far is in the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import StatusCode

from agl import semconv
from agl.tracing.callback_handlers import callback_handlers
from agl.tracing.context import current_scope, ended_scope
from agl.tracing.context_keys import resolve_parent
from agl.tracing.encoding import encode_attribute
from agl.tracing.export import TracerStats
from agl.tracing.otlp import OtlpExporter, traces_url
from agl.tracing.otlp import from_environment as otlp_from_environment
from agl.tracing.span_processor import WRITER_ENV, StoreSpanProcessor
from agl.tracing.spans import AglSpan, clean_attributes, new_id
from agl.types import SpanKind

__all__ = ["Tracer", "TracerStats", "encode_attribute", "get_tracer", "record_exception"]

logger = logging.getLogger("agl.tracing.tracer")


STEP_SPAN_KINDS = ("llm", "tool")  # a reward emitted inside one of these is a step reward (agl.tracing.emitters)


StartHook = Callable[[AglSpan], None]


class Tracer:
    """The process-wide agl tracer. Get it with :func:`get_tracer`.

    Every span it starts is recorded (no sampling): a training span must be stored even when it nests
    under a span the user's own tracing chose not to sample.
    """

    def __init__(self, max_queue: int = 100_000, batch_size: int = 64, writer: Optional[str] = None) -> None:
        """``writer``: ``"thread"`` (default) or ``"process"`` (see :mod:`agl.tracing.writer_process`); when not
        given, the ``AGL_SPAN_WRITER`` environment variable decides."""
        self.processor = StoreSpanProcessor(
            max_queue=max_queue, batch_size=batch_size, writer=writer or os.environ.get(WRITER_ENV) or "thread"
        )
        self.processor.otlp = otlp_from_environment()
        self._start_hooks: Tuple[StartHook, ...] = ()  # replaced, never mutated: start_span reads it unlocked
        self._warned_late = False  # a span in a task a rollout left running when it returned (said once)
        self._warned_late_timed_out = False  # a span of an agent that went on past its rollout's timeout (said once)
        self._hooks_lock = threading.Lock()

    def set_store(self, store: Any) -> None:
        """Where finished spans go (anything with ``add_spans``). Spans wait in the queue until set."""
        self.processor.set_sink(store)

    def set_writer(self, writer: str) -> None:
        """Who writes spans to the store: ``"thread"`` (a daemon thread, the default) or ``"process"``: a child
        process on another core, for CPU-bound agents whose GIL the writer thread would otherwise share.
        The process needs a store several processes can share; with any other, a thread writes (warned)."""
        self.processor.set_writer(writer)

    def set_otlp(self, endpoint: Optional[str], headers: Optional[Mapping[str, str]] = None) -> None:
        """Also send every span of a rollout to this OTLP/HTTP traces endpoint (None: stop), from a thread of
        its own (:mod:`agl.tracing.otlp`). ImportError naming ``agl[otlp]`` when opentelemetry-proto is missing,
        ValueError for an endpoint that is not an http(s) URL."""
        current = self.processor.otlp
        if current is not None and endpoint is not None and current.endpoint == traces_url(endpoint):
            if current.headers == dict(headers or {}):
                return
        exporter = OtlpExporter(endpoint, headers) if endpoint is not None else None
        self.processor.otlp = exporter
        if current is not None:
            threading.Thread(target=current.close, name="agl-otlp-close", daemon=True).start()

    @property
    def otlp(self) -> Optional[OtlpExporter]:
        """The live OTLP exporter (its ``endpoint``, ``stats``, ``flush()``), or None."""
        return self.processor.otlp

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

        Its parent is ``parent``, else the innermost of the current span (agl's or the user's own) and the
        span of the framework run executing now, as a callback-style adapter reports it (a LangGraph node
        never becomes current: see :mod:`agl.tracing.context_keys`); without either it starts a new
        trace. Started inside a rollout, it is stored when it ends.
        """
        attrs: Dict[str, Any] = {semconv.SPAN_KIND: kind}
        if attributes:
            attrs.update(clean_attributes(attributes))
        if parent is None:
            parent = self.default_parent()
        if type(parent) is AglSpan:
            trace_id, parent_id, trace_state = parent.trace_id, parent.span_id, parent.trace_state
        else:
            parent_context = parent.get_span_context()
            if parent_context.is_valid:
                trace_id, parent_id, trace_state = (
                    parent_context.trace_id,
                    parent_context.span_id,
                    parent_context.trace_state,
                )
            else:
                trace_id, parent_id, trace_state = new_id(128), None, None
        span = AglSpan(
            name,
            trace_id,
            new_id(64),
            parent_id,
            trace_state,
            attrs,
            start_time if start_time is not None else time.time_ns(),
            self.processor,
        )
        scope = current_scope()
        if scope is None and not (self._warned_late and self._warned_late_timed_out):
            self._warn_if_late(name)  # only reads a context variable: no cost on the rollout's own spans
        if scope is not None:
            span.rollout_id = scope.rollout_id
            span.attempt_id = scope.attempt_id
            span.sequence_id = scope.next_sequence_id()
            span.generation = self.processor.generation
            span.scope = scope
            scope.open_spans[span.span_id] = span
            if kind in STEP_SPAN_KINDS:
                self.processor.open_steps[span.span_id] = kind
        for hook in self._start_hooks:
            hook(span)
        return span

    def unrecorded(self, name: str, kind: SpanKind) -> None:
        """A call outside every rollout that an instrumentation did not record at all (nothing would store its
        span): counted, and warned of, as its span would have been when it started and ended."""
        if not (self._warned_late and self._warned_late_timed_out):
            self._warn_if_late(name)
        self.processor.unscoped(name, kind == "llm")

    def _warn_if_late(self, name: str) -> None:
        """Once for each way a rollout ends: a span started in the context of a rollout that has returned (see
        ``current_scope``), or that timed out. They call for different fixes, and the first must not use up
        the warning of the other: the agent of a timed-out rollout that returns on its abandoned thread is no
        task the rollout left running, and cancelling one before returning is no advice for it."""
        ended = ended_scope()
        if ended is None:
            return
        if ended.outcome == "timed out":
            self._warn_late_after_timeout(name, ended.rollout_id)
        else:
            self._warn_late_after_return(name, ended.rollout_id)

    def _warn_late_after_timeout(self, name: str, rollout_id: str) -> None:
        if self._warned_late_timed_out:
            return
        self._warned_late_timed_out = True
        logger.warning(
            "span %r started after its rollout %s timed out: its agent went on past the timeout (a sync agent "
            "cannot be interrupted; an async one caught CancelledError), and what it does now is not stored, as "
            "the attempt was reported as timed out. Make the agent finish within rollout_timeout, or raise "
            "rollout_timeout. Said once; tracer stats().unscoped counts such spans",
            name,
            rollout_id,
        )

    def _warn_late_after_return(self, name: str, rollout_id: str) -> None:
        if self._warned_late:
            return
        self._warned_late = True
        logger.warning(
            "span %r started after its rollout %s had returned, in a task the rollout left running (a model "
            "stream it stopped reading, an agent run or runtime it keeps going): it is not stored, as it is not "
            "part of what the rollout's reward judged. To stop such a run, cancel it before returning (OpenAI "
            "Agents SDK: result.cancel(); AutoGen: close the stream or stop the runtime). Said once; tracer "
            "stats().unscoped counts such spans",
            name,
            rollout_id,
        )

    @staticmethod
    def default_parent() -> otel_trace.Span:
        """The parent of a span started without one: the innermost of the current span and the framework run
        executing now (see :meth:`start_span`)."""
        return _innermost(otel_trace.get_current_span(), resolve_parent())

    def open_step_kind(self, span: otel_trace.Span) -> Optional[str]:
        """``"llm"`` or ``"tool"`` if ``span`` is, or directly stands inside, an llm or tool span of a rollout
        that has not ended, else None. Frameworks with OpenTelemetry tracing of their own (AutoGen) open
        their spans inside agl's: without an SDK those share agl's span context (a ``NonRecordingSpan``),
        with one they name it as their parent."""
        if type(span) is AglSpan:
            kind = span.attributes.get(semconv.SPAN_KIND)
            return kind if kind in STEP_SPAN_KINDS and span.end_time is None else None
        open_steps = self.processor.open_steps
        kind = open_steps.get(span.get_span_context().span_id)
        parent = getattr(span, "parent", None)  # an SDK span's parent SpanContext
        if kind is None and parent is not None:
            kind = open_steps.get(getattr(parent, "span_id", 0))
        return kind

    def set_deferred(self, span: otel_trace.Span, attributes: Mapping[str, Any]) -> None:
        """Attach attributes encoded off the hot path (messages, token ids, raw objects): containers when the
        span ends, ``Computed`` values on the writer thread (a callable value is a value: never called) (see the
        module docstring).

        Values must not be mutated by the caller afterwards: pass snapshots (e.g. ``list(messages)``).
        """
        self.processor.set_deferred(span, attributes)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every span that has ended is in the store. False if ``timeout`` passed first."""
        return self.processor.force_flush(int(timeout * 1000))

    def get_langchain_handler(self) -> Any:
        """Agent Lightning's ``self.tracer.get_langchain_handler()``, so agents that pass it in
        ``callbacks=[...]`` run unchanged: the handler the LangChain adapter already adds to every callback
        manager (no ``callbacks=`` is needed with agl; passing it records nothing twice). The adapter
        registers it (:mod:`agl.tracing.callback_handlers`): the tracer sits below the framework adapters."""
        handler = callback_handlers.get("langchain")
        if handler is None:
            raise RuntimeError(
                "agl is not recording LangChain in this process: call agl.instrument() with LangChain "
                "installed (pip install 'agl[langchain]'), after which no callbacks=[...] is needed at all"
            )
        return handler()


def _innermost(current: otel_trace.Span, running: Optional[otel_trace.Span]) -> otel_trace.Span:
    """The framework run's span, unless the current span started inside it (an operation opened in a node)."""
    if running is None:
        return current
    started, run_started = getattr(current, "start_time", None), getattr(running, "start_time", None)
    if current.get_span_context().is_valid and isinstance(started, int) and isinstance(run_started, int):
        return current if started >= run_started else running
    return running


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
