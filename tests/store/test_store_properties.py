"""Random sequences of store operations, run on every backend, checking invariants after each step.

The same sequence runs on each backend and must produce the same observable history (which calls
raised, and the status of every rollout and attempt), so the backends cannot drift apart.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl.errors import AglError
from agl.store import EnqueueRequest, LightningStore
from agl.types import Attempt, RolloutConfig, Span

FAILURES: Set[Optional[str]] = {"failed", "timeout", "unresponsive"}
# what the latest attempt of a rollout in each status may be (None: no attempt yet)
LAST_ATTEMPT_STATUSES: Dict[str, Set[Optional[str]]] = {
    "queued": FAILURES | {None},
    "running": {"running"},
    "succeeded": {"succeeded"},
    "failed": FAILURES,
    "cancelled": FAILURES | {None, "cancelled"},
}

operations = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(1, 3), st.integers(1, 3)),  # how many, max_attempts
        st.tuples(st.just("dequeue"), st.integers(1, 3)),  # limit
        st.tuples(st.just("complete"), st.integers(0, 50), st.sampled_from(["succeeded", "failed", "timeout"])),
        st.tuples(st.just("heartbeat"), st.integers(0, 50)),
        st.tuples(st.just("spans"), st.integers(0, 50), st.integers(1, 3), st.booleans()),  # attempt, n, re-add
        st.tuples(st.just("bad_spans"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
    ),
    max_size=30,
)


class Run:
    """One backend's run of a sequence, with what the test expects to be stored."""

    def __init__(self, store: LightningStore) -> None:
        self.store = store
        self.rollout_ids: List[str] = []
        self.attempts: List[Attempt] = []  # every attempt handed out, stale ones included
        self.spans: Dict[Tuple[str, str, str], Dict[str, Any]] = {}  # stored key -> first attributes
        self.n_spans = 0
        self.history: List[Any] = []

    def apply(self, op: Tuple[Any, ...]) -> None:
        try:
            self.history.append((op[0], self._apply(op)))
        except AglError as exc:
            self.history.append((op[0], type(exc).__name__))

    def _apply(self, op: Tuple[Any, ...]) -> Any:
        kind, store = op[0], self.store
        if kind == "enqueue":
            requests = [
                EnqueueRequest(input=len(self.rollout_ids) + i, config=RolloutConfig(max_attempts=op[2]))
                for i in range(op[1])
            ]
            self.rollout_ids += [r.rollout_id for r in store.enqueue_many(requests)]
            return op[1]
        if kind == "dequeue":
            claimed = store.dequeue_many("runner", op[1])
            self.attempts += [r.attempt for r in claimed if r.attempt is not None]
            return [self.rollout_ids.index(r.rollout_id) for r in claimed]
        if kind == "cancel":
            if not self.rollout_ids:
                return None
            return store.cancel_rollout(self.rollout_ids[op[1] % len(self.rollout_ids)]).status
        if not self.attempts:
            return None
        attempt = self.attempts[op[1] % len(self.attempts)]
        if kind == "complete":
            return store.complete_attempt(attempt.rollout_id, attempt.attempt_id, op[2], reward=1.0, error="e").status
        if kind == "heartbeat":
            return store.heartbeat(attempt.rollout_id, attempt.attempt_id).status
        if kind == "bad_spans":
            good = self._span(attempt, 0, "bad")
            ghost = good.model_copy(update={"rollout_id": "ro-ghost"})
            return store.add_spans([good, ghost])
        spans = [self._span(attempt, i, f"{self.n_spans + i}") for i in range(op[2])]
        self.n_spans += op[2]
        batch = spans + (spans[:1] if op[3] else [])
        if op[3]:  # a retry of an already stored span with other content must be ignored
            batch.append(spans[0].model_copy(update={"attributes": {"other": True}}))
        stored = store.add_spans(batch)
        for span in batch:
            self.spans.setdefault((span.rollout_id, span.attempt_id, span.span_id), span.attributes)
        return stored

    @staticmethod
    def _span(attempt: Attempt, sequence_id: int, span_id: str) -> Span:
        now = time.time_ns()
        return Span(
            rollout_id=attempt.rollout_id,
            attempt_id=attempt.attempt_id,
            sequence_id=sequence_id,
            trace_id="t" * 32,
            span_id=span_id,
            name="step",
            start_time=now,
            end_time=now,
            attributes={"span": span_id},
        )

    def check(self) -> List[Any]:
        """Assert every invariant; return a backend-independent snapshot of the state."""
        store = self.store
        rollouts = store.query_rollouts()
        assert [r.rollout_id for r in rollouts] == self.rollout_ids
        stats = store.stats()
        assert sum(stats.rollouts.values()) == len(rollouts)
        assert stats.rollouts == {s: sum(r.status == s for r in rollouts) for s in stats.rollouts}
        snapshot = []
        n_attempts = 0
        for rollout in rollouts:
            attempts = store.query_attempts(rollout.rollout_id)
            n_attempts += len(attempts)
            statuses = [a.status for a in attempts]
            assert [a.sequence for a in attempts] == list(range(1, len(attempts) + 1))
            assert rollout.n_attempts == len(attempts) <= rollout.config.max_attempts
            assert rollout.attempt == (attempts[-1] if attempts else None)
            assert all(s in FAILURES for s in statuses[:-1]), "only the last attempt may be anything but a failure"
            last = statuses[-1] if statuses else None
            expected_last = LAST_ATTEMPT_STATUSES[rollout.status]
            assert last in expected_last, (rollout.status, statuses)
            if rollout.status == "queued":
                assert rollout.n_attempts < rollout.config.max_attempts
            if rollout.status == "failed":
                assert rollout.n_attempts == rollout.config.max_attempts
            assert (rollout.end_time is not None) == rollout.is_terminal
            stored = {
                (s.rollout_id, s.attempt_id, s.span_id): s.attributes
                for s in store.query_spans(rollout.rollout_id, None)
            }
            assert stored == {k: v for k, v in self.spans.items() if k[0] == rollout.rollout_id}, (
                "a span was lost or overwritten"
            )
            snapshot.append((rollout.status, statuses, len(stored)))
        assert stats.attempts == n_attempts and stats.spans == len(self.spans)
        return snapshot


# stores_of_every_backend is a stateless factory, so sharing it between examples is fine
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=operations)
def test_random_operations_keep_invariants_on_every_backend(
    stores_of_every_backend: Callable[[Path], List[LightningStore]], ops: List[Tuple[Any, ...]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Run(store) for store in stores_of_every_backend(Path(tmp))]
        for op in ops:
            snapshots = []
            for run in runs:
                run.apply(op)
                snapshots.append(run.check())
            assert all(s == snapshots[0] for s in snapshots), f"backends disagree after {op}"
        assert all(run.history == runs[0].history for run in runs)
        for run in runs:
            run.store.close()
