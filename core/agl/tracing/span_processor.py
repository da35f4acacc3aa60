"""The tracer's span processor: ended spans queue here and reach the store in batches, from a background thread
or a writer process (``AGL_SPAN_WRITER``), so the thread that made an LLM call does no I/O."""

from __future__ import annotations

import collections
import logging
import os
import pickle
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from agl import semconv
from agl.tracing.context import ended_scope, rollouts_running
from agl.tracing.encoding import Finished, finished, without_callables
from agl.tracing.export import SpanExporter, TracerStats
from agl.tracing.spans import AglSpan
from agl.tracing.writer_process import WriterProcess

if TYPE_CHECKING:
    from agl.tracing.otlp import OtlpExporter

logger = logging.getLogger("agl.tracing.tracer")

WRITER_MODES = ("thread", "process")


WRITER_ENV = "AGL_SPAN_WRITER"


_SHIP_HERE = 4  # batches queued before the agent's own thread ships one to the writer process


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
        self.writer = checked_writer(writer)
        self.sink: Any = None  # anything with add_spans(list[Span])
        self.otlp: Optional[OtlpExporter] = None  # also sends each queued span to an OTLP endpoint (its own thread)
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
        self.writer = checked_writer(writer)
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

    def unscoped(self, name: str, is_llm: bool) -> None:
        """Count a span (or an LLM call recorded without one) outside every rollout; warn once of an LLM call
        made so while rollouts run, as an agent's own thread that did not inherit the rollout makes them."""
        self.stats.unscoped += 1
        if not self._warned_unscoped:
            self._warned_unscoped = True
            logger.debug("span %r ended outside any rollout; agl stores spans of rollouts only", name)
        if (
            not self._warned_stray_call
            and is_llm
            and rollouts_running()
            and ended_scope() is None  # (a call of a rollout that has returned is warned of at its start)
        ):
            self._warned_stray_call = True
            logger.warning(
                "an LLM call (span %r) ended outside every rollout while rollouts run in this process, so it is "
                "not stored or trained on. If the agent made it in a thread of its own (a threading.Thread, "
                "or a thread pool without agl.instrument()), that thread did not inherit the rollout's context: "
                "wrap the function with agl.propagate(fn), or submit with agl.submit(executor, fn, ...). Said "
                "once; tracer stats().unscoped counts such spans.",
                name,
            )

    def on_end(self, span: AglSpan) -> None:
        self.open_steps.pop(span.span_id, None)
        if span.scope is not None:
            span.scope.open_spans.pop(span.span_id, None)
        if span.rollout_id is None or span.generation != self.generation:
            self.unscoped(span.name, span.attributes.get(semconv.SPAN_KIND) == "llm")
            return
        item = finished(span)
        if self.otlp is not None:
            self.otlp.offer(item)
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
        self._queue.append(item)
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


def checked_writer(writer: str) -> str:
    if writer not in WRITER_MODES:
        raise ValueError(f"agl span writer must be one of {', '.join(WRITER_MODES)}, not {writer!r}")
    return writer
