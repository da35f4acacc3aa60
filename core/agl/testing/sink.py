"""ListSink: the smallest span store, for tests and debugging (``get_tracer().set_store(ListSink())``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, TypeVar

from agl.tracing.tracer import get_tracer
from agl.types import Span


class ListSink:
    """Keeps every span the tracer writes, in memory, with no rollout bookkeeping."""

    def __init__(self) -> None:
        self.spans: List[Span] = []

    def add_spans(self, spans: List[Span]) -> None:
        self.spans.extend(spans)

    def of(self, rollout_id: str, kind: Optional[str] = None) -> List[Span]:
        """The rollout's spans (of ``kind`` if given) in the order they were made; flushes the tracer first."""
        assert get_tracer().flush(10), "the tracer did not flush within 10 s"
        spans = [s for s in self.spans if s.rollout_id == rollout_id and (kind is None or s.kind == kind)]
        return sorted(spans, key=lambda s: s.sequence_id)


S = TypeVar("S")


@contextlib.contextmanager
def tracer_writes_to(sink: S) -> Iterator[S]:
    """The global tracer writes to ``sink`` inside the block, then flushes and goes back to its store."""
    tracer = get_tracer()
    previous = tracer.store
    tracer.set_store(sink)
    try:
        yield sink
    finally:
        tracer.flush(10)
        tracer.set_store(previous)
