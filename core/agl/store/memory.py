"""The in-memory store: one process, one lock, a Condition to wake waiters. For tests and notebooks.

It behaves exactly like the persistent backends (it passes the same contract suite): inputs, metadata
and spans go through the same encoding on the way in (spans kept as SQLite's compact rows), so what is not
JSON-serialisable fails here too, and nothing a caller gets back aliases the store's own state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pydantic_core import from_json

from agl.errors import (
    DuplicateResourcesError,
    StoreClosedError,
    UnknownAttemptError,
    UnknownResourcesError,
    UnknownRolloutError,
)
from agl.store import _rules
from agl.store.base import Completion, EnqueueRequest, LightningStore, RolloutQuery, StoreStats
from agl.store.prefixes import SharedPrefixes, spans_with_prefixes
from agl.types import (
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    Resource,
    ResourcesUpdate,
    Rollout,
    Span,
    new_id,
    parse_resources,
)


@dataclass
class _Record:
    """A rollout and everything hanging off it. ``rollout.attempt`` stays None; views fill it in."""

    rollout: Rollout
    attempts: List[Attempt] = field(default_factory=list)
    # attempt_id -> span_id -> the span's row as SQLite stores it (compact attributes: a span takes a third of the
    # memory its objects would, and nothing returned aliases what is kept); insertion order breaks ties
    spans: Dict[str, Dict[str, Tuple[Any, ...]]] = field(default_factory=dict)
    deadline: Optional[float] = None  # of the live attempt


def _sequence_id(row: Tuple[Any, ...]) -> int:
    return row[3]


def _json_copy(value: Any, what: str) -> Any:
    return from_json(_rules.encode_json(value, what))


class InMemoryLightningStore(SharedPrefixes, LightningStore):
    """A LightningStore kept in this process's memory (lost when it exits; not shareable with children)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._records: Dict[str, _Record] = {}  # in enqueue order
        self._queue: Dict[str, None] = {}  # queued rollout ids in FIFO order (an ordered set)
        self._live: Dict[str, _Record] = {}  # rollouts with a running attempt
        self._resources: Dict[str, ResourcesUpdate] = {}  # in version order
        self._n_attempts = 0
        self._n_spans = 0
        self._closed = False

    def __repr__(self) -> str:
        return "InMemoryLightningStore()"

    # -- helpers (call with the lock held) -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this InMemoryLightningStore was closed (its data is gone); create a new one")

    def _record(self, rollout_id: str) -> _Record:
        self._check_open()
        record = self._records.get(rollout_id)
        if record is None:
            raise UnknownRolloutError(rollout_id)
        return record

    def _attempt(self, record: _Record, attempt_id: str) -> Attempt:
        for attempt in reversed(record.attempts):
            if attempt.attempt_id == attempt_id:
                return attempt
        raise UnknownAttemptError(record.rollout.rollout_id, attempt_id)

    @staticmethod
    def _view(record: _Record) -> Rollout:
        latest = record.attempts[-1].model_copy() if record.attempts else None
        return record.rollout.model_copy(deep=True, update={"attempt": latest})

    def _end_live_attempt(self, record: _Record, status: str, error: Optional[str], reward: Optional[float]) -> None:
        """End the live attempt and move the rollout on per the shared retry rule."""
        attempt, rollout = record.attempts[-1], record.rollout
        end = _rules.end_attempt(status, error, reward, rollout.n_attempts, rollout.config.max_attempts, time.time())
        attempt.status, attempt.end_time, attempt.error = end.status, end.end_time, end.error  # type: ignore[assignment]  # a status the shared rules chose
        self._live.pop(rollout.rollout_id, None)
        record.deadline = None
        for name, value in end.rollout.items():
            setattr(rollout, name, value)
        if end.requeued:
            self._queue[rollout.rollout_id] = None  # to the back of the queue
        self._cond.notify_all()

    def _reap(self) -> Tuple[List[Rollout], Optional[float]]:
        """End expired attempts; return the changed rollouts and the next pending deadline."""
        now = time.time()
        changed: List[Rollout] = []
        for record in [r for r in self._live.values() if r.deadline is not None and r.deadline <= now]:
            cfg = record.rollout.config
            status, error = _rules.expiry(
                record.attempts[-1].start_time, now, cfg.timeout_seconds, cfg.heartbeat_timeout_seconds
            )
            self._end_live_attempt(record, status, error, None)
            changed.append(self._view(record))
        deadlines = [r.deadline for r in self._live.values() if r.deadline is not None]
        return changed, min(deadlines) if deadlines else None

    def _wait(self, deadline: Optional[float], next_expiry: Optional[float]) -> bool:
        """Sleep on the condition until notified, the caller's deadline or the next expiry; False if timed out."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        waits = [] if deadline is None else [deadline - now]
        if next_expiry is not None:
            waits.append(max(0.0, next_expiry - time.time()))
        self._cond.wait(min(waits) if waits else None)
        return True

    # -- rollouts ------------------------------------------------------------------------------------------
    def enqueue_many(self, requests: Sequence[EnqueueRequest]) -> List[Rollout]:
        _rules.check_request_ids(requests)
        now = time.time()
        with self._cond:
            self._check_open()
            for request in requests:
                if request.resources_id is not None and request.resources_id not in self._resources:
                    raise UnknownResourcesError(request.resources_id)
            _rules.check_new_rollout_ids(requests, self._records.__contains__)
            records = [
                _Record(
                    Rollout(
                        rollout_id=request.rollout_id or new_id("ro"),
                        task_id=request.task_id or new_id("task"),
                        input=_json_copy(request.input, "rollout input"),
                        mode=request.mode,
                        resources_id=request.resources_id,
                        config=request.config.model_copy(),
                        metadata=_json_copy(request.metadata, "rollout metadata"),
                        create_time=now,
                    )
                )
                for request in requests
            ]
            for record in records:
                self._records[record.rollout.rollout_id] = record
                self._queue[record.rollout.rollout_id] = None
            for record, request in zip(records, requests):
                if request.runner_id is not None:  # started at once: it never waits in the queue
                    del self._queue[record.rollout.rollout_id]
                    self._start(record, request.runner_id, now)
            self._cond.notify_all()
            return [self._view(record) for record in records]

    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)
        deadline = None if timeout is None else time.monotonic() + timeout  # None: wait as long as it takes
        with self._cond:
            while True:
                self._check_open()
                _, next_expiry = self._reap()
                if self._queue:
                    return self._claim(runner_id, limit)
                if not self._wait(deadline, next_expiry):
                    return []

    def _claim(self, runner_id: str, limit: int) -> List[Rollout]:
        now = time.time()
        claimed: List[Rollout] = []
        while self._queue and len(claimed) < limit:
            rollout_id = next(iter(self._queue))
            del self._queue[rollout_id]
            record = self._records[rollout_id]
            self._start(record, runner_id, now)
            claimed.append(self._view(record))
        if any(self._records[r.rollout_id].deadline is not None for r in claimed):
            self._cond.notify_all()  # waiters recompute when to reap next
        return claimed

    def _start(self, record: _Record, runner_id: str, now: float) -> None:
        """Start a new attempt of a rollout taken off the queue (or never put on it: ``start_rollout``)."""
        rollout = record.rollout
        rollout.status, rollout.n_attempts = "running", rollout.n_attempts + 1
        rollout.start_time = rollout.start_time or now
        attempt = Attempt(
            rollout_id=rollout.rollout_id,
            attempt_id=new_id("at"),
            sequence=rollout.n_attempts,
            runner_id=runner_id,
            start_time=now,
            last_heartbeat=now,
        )
        record.attempts.append(attempt)
        record.deadline = _rules.attempt_deadline(
            now, now, rollout.config.timeout_seconds, rollout.config.heartbeat_timeout_seconds
        )
        self._live[rollout.rollout_id] = record
        self._n_attempts += 1

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        with self._cond:
            record = self._record(rollout_id)
            attempt = self._attempt(record, attempt_id)
            if attempt.status != "running":
                raise _rules.stale_error(rollout_id, attempt_id, attempt.status, record.rollout.status)
            self._beat(record, attempt, time.time())
            return attempt.model_copy()

    @staticmethod
    def _beat(record: _Record, attempt: Attempt, now: float) -> None:
        attempt.last_heartbeat = now
        cfg = record.rollout.config
        record.deadline = _rules.attempt_deadline(
            attempt.start_time, now, cfg.timeout_seconds, cfg.heartbeat_timeout_seconds
        )

    def _complete_attempt(self, done: Completion) -> Rollout:
        with self._cond:
            record = self._record(done.rollout_id)
            attempt = self._attempt(record, done.attempt_id)
            if attempt.status != "running":
                raise _rules.stale_error(done.rollout_id, done.attempt_id, attempt.status, record.rollout.status)
            self._end_live_attempt(record, done.status, done.error, done.reward)
            return self._view(record)

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        with self._cond:
            record = self._record(rollout_id)
            rollout = record.rollout
            if rollout.status == "cancelled":
                return self._view(record)
            if rollout.status not in ("queued", "running"):
                raise _rules.cancel_error(rollout_id, rollout.status)
            now = time.time()
            if rollout.status == "running":
                attempt = record.attempts[-1]
                attempt.status, attempt.end_time = "cancelled", now
                self._live.pop(rollout_id, None)
                record.deadline = None
            self._queue.pop(rollout_id, None)
            rollout.status, rollout.end_time = "cancelled", now
            self._cond.notify_all()
            return self._view(record)

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._cond:
            return self._view(self._record(rollout_id))

    def _query_rollouts(self, query: RolloutQuery) -> List[Rollout]:
        statuses = None if query.status is None else set(query.status)
        ids = None if query.rollout_ids is None else set(query.rollout_ids)
        with self._cond:
            self._check_open()
            matches = [
                record
                for record in self._records.values()
                if (statuses is None or record.rollout.status in statuses)
                and (ids is None or record.rollout.rollout_id in ids)
                and (query.task_id is None or record.rollout.task_id == query.task_id)
                and (query.mode is None or record.rollout.mode == query.mode)
            ]
            end = None if query.limit is None else query.offset + query.limit
            return [self._view(record) for record in matches[query.offset : end]]

    def query_attempts(self, rollout_id: str) -> List[Attempt]:
        with self._cond:
            return [attempt.model_copy() for attempt in self._record(rollout_id).attempts]

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> List[Rollout]:
        deadline = None if timeout is None else time.monotonic() + timeout
        ids = list(dict.fromkeys(rollout_ids))
        with self._cond:
            records = [self._record(rollout_id) for rollout_id in ids]
            while True:
                _, next_expiry = self._reap()
                if all(r.rollout.status in TERMINAL_ROLLOUT_STATUSES for r in records):
                    break
                if not self._wait(deadline, next_expiry):
                    break
                self._check_open()
            return [self._view(r) for r in records if r.rollout.status in TERMINAL_ROLLOUT_STATUSES]

    def reap_expired(self) -> List[Rollout]:
        with self._cond:
            self._check_open()
            return self._reap()[0]

    def renew_heartbeats(self) -> int:
        with self._cond:
            self._check_open()
            now = time.time()
            live = [r for r in self._live.values() if r.rollout.config.heartbeat_timeout_seconds is not None]
            for record in live:
                self._beat(record, record.attempts[-1], now)
            return len(live)

    # -- spans ---------------------------------------------------------------------------------------------
    def add_spans(self, spans: Sequence[Span]) -> int:
        rows, learnt = self._prefixes.rows(spans)
        encoded = list(zip(spans, rows))
        with self._cond:
            attempts: Dict[Tuple[str, str], Tuple[_Record, Attempt]] = {}
            for span, _ in encoded:
                key = (span.rollout_id, span.attempt_id)
                if key not in attempts:
                    record = self._record(span.rollout_id)
                    attempts[key] = (record, self._attempt(record, span.attempt_id))
            stored = 0
            for span, data in encoded:
                by_id = attempts[(span.rollout_id, span.attempt_id)][0].spans.setdefault(span.attempt_id, {})
                if span.span_id not in by_id:
                    by_id[span.span_id] = data
                    stored += 1
            now = time.time()
            for record, attempt in attempts.values():
                if attempt.status == "running":
                    self._beat(record, attempt, now)
            self._n_spans += stored
            self._prefixes.learn(learnt)
            return stored

    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = "latest") -> List[Span]:
        with self._cond:
            record = self._record(rollout_id)
            if attempt_id == "latest":
                chosen = record.attempts[-1:]
            elif attempt_id is None:
                chosen = record.attempts
            else:
                chosen = [self._attempt(record, attempt_id)]
            rows = [sorted(record.spans.get(a.attempt_id, {}).values(), key=_sequence_id) for a in chosen]
        return spans_with_prefixes([row for per_attempt in rows for row in per_attempt])

    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        with self._cond:
            records = [self._record(rollout_id) for rollout_id in dict.fromkeys(rollout_ids)]
            for record in records:
                _rules.check_spans_deletable(record.rollout.rollout_id, record.rollout.status)
            deleted = 0
            for record in records:
                deleted += sum(len(by_id) for by_id in record.spans.values())
                record.spans = {}
            self._n_spans -= deleted
            self._prefixes.forget([record.rollout.rollout_id for record in records])
            return deleted

    # -- resources -----------------------------------------------------------------------------------------
    def add_resources(self, resources: Dict[str, Resource], resources_id: Optional[str] = None) -> ResourcesUpdate:
        parsed = from_json(_rules.encode_resources(resources, resources_id))
        with self._cond:
            self._check_open()
            if resources_id is not None and resources_id in self._resources:
                raise DuplicateResourcesError(resources_id)
            update = ResourcesUpdate(
                resources_id=resources_id or new_id("res"),
                version=len(self._resources) + 1,
                resources=parse_resources(parsed),
            )
            self._resources[update.resources_id] = update
            return update.model_copy(deep=True)

    def get_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        with self._cond:
            self._check_open()
            if resources_id is None:
                if not self._resources:
                    return None
                update = next(reversed(self._resources.values()))
            elif resources_id in self._resources:
                update = self._resources[resources_id]
            else:
                raise UnknownResourcesError(resources_id)
            return update.model_copy(deep=True)

    # -- misc ----------------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._cond:
            self._check_open()
            counts = {status: 0 for status in _rules.ROLLOUT_STATUSES}
            for record in self._records.values():
                counts[record.rollout.status] += 1
            return StoreStats(
                rollouts=counts,
                attempts=self._n_attempts,
                spans=self._n_spans,
                resources_versions=len(self._resources),
            )

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # waiters see the store closed instead of sleeping on
