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
- ``flush()`` at rollout end waits until every span finished so far is in the store.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import StatusCode

from agl import semconv
from agl.tracing.callback_handlers import callback_handlers
from agl.tracing.context import current_scope, ended_scope, rollouts_running
from agl.tracing.context_keys import resolve_parent
from agl.tracing.encoding import Finished, encode_attribute, finished, without_callables
from agl.tracing.export import SpanExporter, TracerStats
from agl.tracing.spans import AglSpan, clean_attributes, new_id
from agl.tracing.writer_process import WriterProcess
from agl.types import SpanKind

__all__ = ["Tracer", "TracerStats", "encode_attribute", "get_tracer", "record_exception"]

logger = logging.getLogger("agl.tracing.tracer")


WRITER_MODES = ("thread", "process")
WRITER_ENV = "AGL_SPAN_WRITER"
_SHIP_HERE = 4  # batches queued before the agent's own thread ships one to the writer process
STEP_SPAN_KINDS = ("llm", "tool")  # a reward emitted inside one of these is a step reward (agl.tracing.emitters)


_OLD_STORE_GRACE_S = 2.0  # how long set_sink lets a write to the store it replaces finish before abandoning it


class StoreSpanProcessor:
    """Queues finished spans of rollouts; a daemon thread (or a writer process) writes them in batches.

    The rollout bookkeeping (rollout, attempt, sequence, deferred attributes) travels on the
    :class:`AglSpan` itself, set by :meth:`Tracer.start_span`.
    """

    def __init__(self, max_queue: int = 100_000, batch_size: int = 64, interval: float = 0.2, writer: str = "thread"):
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.interval = interval
        self.writer = _checked_writer(writer)
        self.sink: Any = None  # anything with add_spans(list[Span])
        self.stats = TracerStats()
        self.generation = 0  # + 1 in each forked child: spans started before the fork are not the child's
        self._process: Optional[WriterProcess] = None
        self._init_worker_state()
        os.register_at_fork(after_in_child=self._init_worker_state)

    def _init_worker_state(self) -> None:
        # Called again in a forked child: the parent's thread and writer process do not belong to it, and
        # the parent's queued spans (and those it had open) belong to the parent.
        self.generation += 1
        if self._process is not None:
            self._process.abandon()
        self._process = None
        self._process_failed = False  # a writer process died: stay on the thread from then on
        self._queue: collections.deque[Finished] = collections.deque()
        self.open_steps: Dict[int, str] = {}  # span id -> kind, for llm and tool spans of rollouts not yet ended
        self._in_flight: collections.deque[List[Finished]] = collections.deque()  # shipped, not acknowledged
        self._ship_lock = threading.Lock()
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._processed = 0  # exported + rejected + dropped-by-worker, under _done
        self._worker: Optional[threading.Thread] = None
        self._worker_epoch = 0  # + 1 when a new writer thread takes over from one stuck on a replaced store
        self._pop_lock = threading.Lock()  # the epoch check and the queue's pops of a written batch, together
        self._writing_to: Any = None  # the store the writer thread is in a call to, if any
        self._stopped = False
        self._warned_drop = False
        self._warned_unscoped = False
        self._warned_stray_call = False
        self.stats = TracerStats()

    # -- configuration --------------------------------------------------------------------------------------
    def set_sink(self, sink: Any) -> None:
        """Attach the store. A writer process serves one store: a different store gets a new process once the
        old one has written what it was sent; ``None`` pauses writing (spans wait) and keeps the process. A
        writer thread still inside a call to the store being replaced after 2 s (a store server's client riding
        out an outage) is abandoned for a new one, so the new store's spans do not wait behind it."""
        if self._process is not None and sink is not None and sink is not self._process.sink:
            self._stop_process()
        self.sink = sink
        writing_to = self._writing_to
        if sink is not None and writing_to is not None and writing_to is not sink:
            deadline = time.monotonic() + _OLD_STORE_GRACE_S
            while self._writing_to is writing_to and time.monotonic() < deadline:
                time.sleep(0.01)  # a write in progress normally ends in milliseconds
            if self._writing_to is writing_to:
                self._replace_stuck_worker(writing_to)
        self._ensure_process()
        self._wake.set()

    def _replace_stuck_worker(self, old_sink: Any) -> None:
        """A new writer thread for the new store, when the current one is inside a call to the store being
        replaced: that call may be riding out an outage (a store server's client keeps trying for its outage
        timeout, 10 minutes under a Trainer), and every span queued behind its batch, the new store's too,
        would wait for it. The old thread is left to finish its call and then ends without touching the queue;
        its batch stays queued and goes to the new store like every other queued span."""
        with self._pop_lock:
            self._worker_epoch += 1
            self._worker = None
            self._writing_to = None
        logger.warning(
            "agl's span writer was still trying to write %d spans to the store it had before (%r); the new store "
            "gets them and every span after them now, and the call to the old one is abandoned",
            min(len(self._queue), self.batch_size),
            old_sink,
        )
        if self._queue:
            self._start_worker()

    def set_writer(self, writer: str) -> None:
        self.writer = _checked_writer(writer)
        if self.writer == "thread" and self._process is not None:
            self._stop_process()
        self._process_failed = False
        self._ensure_process()
        self._wake.set()

    @property
    def writer_pid(self) -> Optional[int]:
        """The writer process's pid while one writes this process's spans, else None (a thread writes)."""
        process = self._process
        return process.pid if process is not None else None

    def _ensure_process(self) -> None:
        if self.writer != "process" or self._process is not None or self._process_failed or self.sink is None:
            return
        if not getattr(self.sink, "multiprocess_safe", False):
            logger.warning(
                "agl's span writer process needs a store several processes can share (SQLite, PostgreSQL, the "
                "HTTP client); %s is not, so spans are written by a thread",
                type(self.sink).__name__,
            )
            self._process_failed = True
            return
        try:
            self._process = WriterProcess(self.sink, self._on_ack, self._on_process_exit)
        except Exception as exc:  # noqa: BLE001 - e.g. a store that does not pickle: the thread still works
            logger.warning("agl could not start its span writer process (spans are written by a thread): %s", exc)
            self._process_failed = True

    def _stop_process(self) -> None:
        process = self._process
        if process is not None:
            with self._ship_lock:
                self._process = None
            process.close()

    # -- hot path: runs on the user's thread ----------------------------------------------------------------
    def set_deferred(self, span: Any, attributes: Mapping[str, Any]) -> None:
        if not isinstance(span, AglSpan) or span.rollout_id is None or span.end_time is not None:
            return  # not in a rollout, not ours, or already queued: it will not be stored (with these)
        if span.deferred is None:
            span.deferred = dict(attributes)
        else:
            span.deferred.update(attributes)

    def on_end(self, span: AglSpan) -> None:
        self.open_steps.pop(span.span_id, None)
        if span.scope is not None:
            span.scope.open_spans.pop(span.span_id, None)
        if span.rollout_id is None or span.generation != self.generation:
            self.stats.unscoped += 1
            if not self._warned_unscoped:
                self._warned_unscoped = True
                logger.debug("span %r ended outside any rollout; agl stores spans of rollouts only", span.name)
            if (
                not self._warned_stray_call
                and rollouts_running()
                and span.attributes.get(semconv.SPAN_KIND) == "llm"
                and ended_scope() is None  # (a call of a rollout that has returned is warned of at its start)
            ):
                self._warned_stray_call = True
                logger.warning(
                    "an LLM call (span %r) ended outside every rollout while rollouts run in this process, so it is "
                    "not stored or trained on. If the agent made it in a thread of its own (a threading.Thread, "
                    "or a thread pool without agl.instrument()), that thread did not inherit the rollout's context: "
                    "wrap the function with agl.propagate(fn), or submit with agl.submit(executor, fn, ...). Said "
                    "once; tracer stats().unscoped counts such spans.",
                    span.name,
                )
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
        self._queue.append(finished(span))
        self.stats.enqueued += 1
        if self._worker is None:
            self._start_worker()
        elif len(self._queue) >= self.batch_size:
            if not self._wake.is_set():
                self._wake.set()  # Event.set takes a lock; once is enough until the writer wakes
            elif self._process is not None and len(self._queue) >= _SHIP_HERE * self.batch_size:
                # The writer thread did not get to run: a CPU-bound agent starves it (see the module
                # docstring of agl.tracing.writer_process). Ship a batch from here, so the writer process keeps up.
                self._ship(block=False)

    # -- writer process -------------------------------------------------------------------------------------
    def _ship(self, block: bool) -> None:
        """Pickle queued spans down the writer process's pipe. ``block=False`` (the agent's thread): one batch,
        only if nobody else is shipping and the pipe is free. ``block=True``: everything queued."""
        if not self._ship_lock.acquire(blocking=block):
            return
        try:
            while self._queue and self.sink is not None:
                process = self._process
                if process is None or (not block and process.busy):
                    return
                n = min(len(self._queue), self.batch_size)
                batch = [without_callables(self._queue.popleft()) for _ in range(n)]
                self._in_flight.append(batch)
                try:
                    payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:  # noqa: BLE001 - an attribute value that does not pickle
                    self._in_flight.pop()
                    logger.warning(
                        "agl could not pickle %d spans for its writer process; writing them here: %s", n, exc
                    )
                    self._export_here(batch)
                    continue
                try:
                    process.send(payload, block)
                except OSError:
                    return  # the child is gone; its exit handler puts the in-flight batches back
                if not block:
                    return
        finally:
            self._ship_lock.release()

    def _export_here(self, batch: List[Finished]) -> None:
        exporter = SpanExporter(self.sink, self.stats)
        exporter.write_until_done(exporter.convert(batch), give_up=lambda: False)
        self._count_processed(len(batch))

    def _on_ack(self, ack: Tuple[int, int, int, int]) -> None:
        n, exported, rejected, errors = ack
        self._in_flight.popleft()
        self.stats.exported += exported
        self.stats.rejected += rejected
        self.stats.export_errors += errors
        self._count_processed(n)

    def _on_process_exit(self, deliberate: bool) -> None:
        with self._ship_lock:
            if not deliberate:
                self._process = None
                self._process_failed = True
            while self._in_flight:  # unacknowledged batches go back to the head of the queue, in order
                self._queue.extendleft(reversed(self._in_flight.pop()))
        if self._queue:
            if self._worker is None:
                self._start_worker()
            self._wake.set()

    def _count_processed(self, n: int) -> None:
        with self._done:
            self._processed += n
            self._done.notify_all()

    # -- background -----------------------------------------------------------------------------------------
    def _start_worker(self) -> None:
        with self._done:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, args=(self._worker_epoch,), name="agl-span-writer", daemon=True
                )
                self._worker.start()

    def _run(self, epoch: int) -> None:
        while epoch == self._worker_epoch:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._process is not None:
                self._ship(block=True)
            else:
                self._export_queue(epoch)
            if self._stopped and not self._queue:
                return

    def _export_queue(self, epoch: int) -> None:
        while self._queue and self._process is None and epoch == self._worker_epoch:
            sink = self.sink
            if sink is None:
                return  # keep spans until a store is attached
            exporter = SpanExporter(sink, self.stats)
            n = min(len(self._queue), self.batch_size)
            spans = exporter.convert([self._queue[i] for i in range(n)])
            self._writing_to = sink
            try:
                written = exporter.write_until_done(spans, give_up=lambda: self.sink is not sink or self._stopped)  # noqa: B023 - used in this pass only
            finally:
                with self._pop_lock:
                    if epoch == self._worker_epoch:
                        self._writing_to = None
            if not written:
                return
            with self._pop_lock:
                if epoch != self._worker_epoch:
                    return  # replaced while writing: the new thread owns the queue (and writes these again)
                for _ in range(n):
                    self._queue.popleft()
            self._count_processed(n)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        with self._done:
            target = self.stats.enqueued + self.stats.dropped
        if self._worker is None:
            return not self._queue
        if self._process is not None:
            self._ship(block=True)  # here, not on the writer thread, which a busy agent may have starved
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
        self._stop_process()
        self._wake.set()


def _checked_writer(writer: str) -> str:
    if writer not in WRITER_MODES:
        raise ValueError(f"agl span writer must be one of {', '.join(WRITER_MODES)}, not {writer!r}")
    return writer


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
