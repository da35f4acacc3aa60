"""Writing converted spans to the store, the same way on the tracer's writer thread and in the writer process.

A store can refuse a batch because of one bad span (an unknown rollout, say): the batch is then written
span by span so that only the refused ones are dropped, counted and logged. Errors that may pass (a closed
or unreachable store) propagate, and the caller retries the batch with back-off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, List

from agl.tracing.encoding import Finished, convert_span
from agl.types import Span

logger = logging.getLogger("agl.tracing.tracer")


@dataclass
class TracerStats:
    """Counters a user can read at any time; the runner reports non-zero ``dropped`` per rollout."""

    enqueued: int = 0
    exported: int = 0
    dropped: int = 0  # queue full
    unscoped: int = 0  # finished outside any rollout: not stored
    export_errors: int = 0  # failed store writes (retried)
    rejected: int = 0  # spans the store refused (e.g. unknown rollout): dropped after logging


class SpanExporter:
    """Converts queued spans and writes them to ``sink`` (anything with ``add_spans``), counting in ``stats``."""

    def __init__(self, sink: Any, stats: TracerStats) -> None:
        self.sink = sink
        self.stats = stats

    def convert(self, batch: List[Finished]) -> List[Span]:
        """Convert spans; one that cannot be converted is dropped and counted, never kills the writer."""
        spans = []
        for item in batch:
            try:
                spans.append(convert_span(item))
            except Exception as exc:
                self.stats.rejected += 1
                logger.error("agl could not convert span %r and dropped it: %s", item[0], exc, exc_info=True)
        return spans

    def write(self, spans: List[Span]) -> None:
        """Write a batch; spans the store refuses for good are dropped one by one; other errors propagate."""
        try:
            self.sink.add_spans(spans)
            self.stats.exported += len(spans)
            return
        except Exception as exc:
            if not _is_permanent(exc):
                raise
            if len(spans) == 1:
                self.stats.rejected += 1
                log = logger.debug if self.stats.rejected > 1 else logger.error
                log(
                    "agl store refused span %r and it was dropped (stats().rejected counts them): %s",
                    spans[0].name,
                    exc,
                )
                return
        for span in spans:
            self.write([span])

    def write_until_done(self, spans: List[Span], give_up: Callable[[], bool]) -> bool:
        """Write, retrying passing errors with back-off until written or ``give_up()``; True if written."""
        backoff = 0.05
        while True:
            try:
                self.write(spans)
                return True
            except Exception as exc:  # noqa: BLE001 - the store's failure must not kill the writer
                self.stats.export_errors += 1
                logger.warning("agl could not write %d spans (will retry): %s", len(spans), exc)
                if give_up():
                    return False
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)


def _is_permanent(exc: Exception) -> bool:
    from agl.errors import AglError, StoreClosedError, StoreUnavailableError

    return isinstance(exc, AglError) and not isinstance(exc, (StoreClosedError, StoreUnavailableError))
