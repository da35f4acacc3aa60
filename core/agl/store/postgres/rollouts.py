"""The rollout cycle of the PostgreSQL store (:class:`PostgresRollouts`): enqueue, claim with
``FOR UPDATE SKIP LOCKED``, heartbeats, completion, cancel, reaping expired attempts, and waiting on
notifications for work or for rollouts to end."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, TypeVar

from psycopg import errors as pg_errors

from agl.errors import DuplicateRolloutError, UnknownAttemptError, UnknownResourcesError, UnknownRolloutError
from agl.store import _rules, _sql
from agl.store._waiting import wait_for_rollouts, wait_until
from agl.store.base import Completion, EnqueueRequest, LightningStore, RolloutQuery
from agl.store.postgres.database import PostgresDatabase
from agl.store.postgres.schema import (
    ATTEMPT_COLS,
    COMPLETE,
    DONE_CHANNEL,
    END_ATTEMPT,
    EXPIRED,
    HEARTBEAT,
    INSERT_ROLLOUT,
    LIVE_ATTEMPT,
    NEXT_DEADLINE,
    PG_SPAN_COLS,
    QUEUE_CHANNEL,
    RENEW_HEARTBEATS,
    SELECT_ROLLOUTS,
    SERVER_START,
    START,
    claim_statement,
)
from agl.store.sqlite.schema import attempt_from_row, rollout_from_row
from agl.types import Attempt, Rollout, new_id

T = TypeVar("T")

#: How the statements shared with the SQLite store (:mod:`agl.store._sql`) are spelled here.
DIALECT = _sql.Dialect(
    _sql.FORMAT,
    "agl_",
    SELECT_ROLLOUTS,
    arrival="s.sid",
    next_queue_pos="nextval('agl_queue_pos')",
    span_cols=PG_SPAN_COLS,
)

ROLLOUT_EXISTS = "SELECT 1 FROM agl_rollouts WHERE rollout_id = %s"

# One rollout enqueued and QUEUE_CHANNEL notified at commit, in one statement, unless it names a resources version
# that is not stored; returns how many were enqueued (1, or 0 for that). Its parameters: a _sql.new_rollout_rows
# row, named by _NEW_ROLLOUT.
_NEW_ROLLOUT = (
    "rollout_id",
    "task_id",
    "input",
    "mode",
    "resources_id",
    "max_attempts",
    "timeout_seconds",
    "heartbeat_timeout_seconds",
    "metadata",
    "create_time",
)
_ENQUEUE_ONE = (
    f"WITH i AS (INSERT INTO agl_rollouts ({', '.join(_NEW_ROLLOUT)}, status, queue_pos) "
    "SELECT %(rollout_id)s::text, %(task_id)s::text, %(input)s::text, %(mode)s::text, %(resources_id)s::text, "
    "%(max_attempts)s::integer, %(timeout_seconds)s::float8, %(heartbeat_timeout_seconds)s::float8, "
    "%(metadata)s::text, %(create_time)s::float8, 'queued', nextval('agl_queue_pos') "
    "WHERE %(resources_id)s::text IS NULL "
    "OR EXISTS (SELECT 1 FROM agl_resources WHERE resources_id = %(resources_id)s::text) RETURNING 1) "
    f"SELECT count(pg_notify('{QUEUE_CHANNEL}', '')) FROM i"
)


def _unknown(rollout_exists: bool, rollout_id: str, attempt_id: str) -> Exception:
    """For an attempt that was not found: UnknownRolloutError, or UnknownAttemptError if the rollout exists."""
    return UnknownAttemptError(rollout_id, attempt_id) if rollout_exists else UnknownRolloutError(rollout_id)


class PostgresRollouts(PostgresDatabase, LightningStore):
    """The rollout and attempt calls of the LightningStore contract on PostgreSQL, and the steps they share."""

    # -- shared steps (inside a transaction) ---------------------------------------------------------------
    @staticmethod
    def _select_one(c: Any, rollout_id: str) -> Rollout:
        return _sql.select_rollout(DIALECT, c, rollout_id)

    @staticmethod
    def _live_attempt(c: Any, rollout_id: str, attempt_id: str) -> Tuple[Any, ...]:
        """``LIVE_ATTEMPT``'s row (rollout and attempt locked); raises unless the attempt exists and is running."""
        row = c.execute(LIVE_ATTEMPT, (rollout_id, attempt_id)).fetchone()
        if row is None:
            PostgresRollouts._raise_unknown(c, rollout_id, attempt_id)
        if row[1] != "running":
            raise _rules.stale_error(rollout_id, attempt_id, row[1], row[2])
        return row

    @staticmethod
    def _raise_unknown(c: Any, rollout_id: str, attempt_id: str) -> NoReturn:
        """For an attempt that was not found: UnknownRolloutError, or UnknownAttemptError if the rollout exists."""
        raise _unknown(c.execute(ROLLOUT_EXISTS, (rollout_id,)).fetchone() is not None, rollout_id, attempt_id)

    @staticmethod
    def _end_attempt(c: Any, rollout_id: str, aid: int, end: _rules.AttemptEnd) -> Rollout:
        """End the live attempt ``aid``, move the rollout on as ``end`` says and notify who waits for that (at
        commit); return the rollout as it now is. One statement: one round trip."""
        channel = QUEUE_CHANNEL if end.requeued else DONE_CHANNEL
        sql = END_ATTEMPT.format(rollout_update=_sql.rollout_assignments(DIALECT, end))
        params = [end.status, end.end_time, end.error, aid, *end.rollout.values(), rollout_id, channel]
        return rollout_from_row(c.execute(sql, params).fetchone())

    def _local_time(self, server_time: Optional[float]) -> Optional[float]:
        """A server-clock time on this machine's clock (what the wait loop sleeps against)."""
        return None if server_time is None else server_time - self._clock_offset

    def _reap(self) -> Tuple[List[Rollout], Optional[float]]:
        """End expired attempts; return the changed rollouts and the next pending deadline (server clock)."""
        next_deadline = self._run(lambda c: c.execute(NEXT_DEADLINE).fetchone()[0], write=False)
        now = self._now()
        if next_deadline is None or next_deadline > now:
            return [], next_deadline  # the common case: one indexed read, no transaction

        def work(c: Any) -> Tuple[List[Rollout], Optional[float]]:
            # a restarted database: its runners could not beat while it was down (see renew_heartbeats)
            c.execute(RENEW_HEARTBEATS, {"t": c.execute(SERVER_START).fetchone()[0]})
            changed: List[Rollout] = []
            for aid, rollout_id, start, timeout, hb_timeout, n_attempts, max_attempts in c.execute(
                EXPIRED, (now,)
            ).fetchall():
                status, error = _rules.expiry(start, now, timeout, hb_timeout)
                end = _rules.end_attempt(status, error, None, n_attempts, max_attempts, now)
                changed.append(self._end_attempt(c, rollout_id, aid, end))
            return changed, c.execute(NEXT_DEADLINE).fetchone()[0]

        return self._run(work)

    def _wait(
        self, channel: str, timeout: Optional[float], attempt: Callable[[], Tuple[Optional[T], Optional[float]]]
    ) -> Optional[T]:
        """:func:`~agl.store._waiting.wait_until`, woken by ``channel``'s notifications."""

        def listen() -> Any:
            return self._state()[1].listen(channel)

        def local_attempt() -> Tuple[Optional[T], Optional[float]]:
            result, next_expiry = attempt()
            return result, self._local_time(next_expiry)

        return wait_until(listen, timeout, local_attempt)

    # -- rollouts ------------------------------------------------------------------------------------------
    def enqueue_many(self, requests: Sequence[EnqueueRequest]) -> List[Rollout]:
        if not requests:
            self._state()
            return []
        _rules.check_request_ids(requests)
        rows = _sql.new_rollout_rows(requests, self._now())
        if len(requests) == 1 and requests[0].runner_id is None:
            self._enqueue_one(rows[0], chosen=requests[0].rollout_id is not None)
            return [_sql.queued_rollout(rows[0])]
        resources_ids = list(dict.fromkeys(r.resources_id for r in requests if r.resources_id is not None))
        chosen = [r.rollout_id for r in requests if r.rollout_id is not None]
        started: Dict[str, Rollout] = {}  # start_rollout's, by id, as this transaction started them

        def work(c: Any) -> None:
            if resources_ids:
                sql = "SELECT resources_id FROM agl_resources WHERE resources_id = ANY(%s)"
                known = {row[0] for row in c.execute(sql, (resources_ids,))}
                for resources_id in resources_ids:
                    if resources_id not in known:
                        raise UnknownResourcesError(resources_id)
            if chosen:
                sql = "SELECT rollout_id FROM agl_rollouts WHERE rollout_id = ANY(%s)"
                stored = {row[0] for row in c.execute(sql, (chosen,))}
                _rules.check_new_rollout_ids(requests, stored.__contains__)
            with c.cursor() as cur:
                cur.executemany(INSERT_ROLLOUT, rows)
            started.clear()
            for row, request in zip(rows, requests):
                if request.runner_id is not None:
                    started[row[0]] = self._start_now(c, row[0], request.runner_id)
            c.execute(f"NOTIFY {QUEUE_CHANNEL}")

        try:
            self._run(work)
        except pg_errors.UniqueViolation:  # another machine stored a chosen id since our check: say which
            self._run(work)
        return [started.get(row[0]) or _sql.queued_rollout(row) for row in rows]

    def _enqueue_one(self, row: Tuple[Any, ...], *, chosen: bool) -> None:
        """Enqueue one rollout (a :func:`~agl.store._sql.new_rollout_rows` row) with one statement, committed on
        its own: a round trip, where a transaction takes four. Its resources version must be stored, and an id the
        caller chose (``chosen``) not yet."""
        try:
            params = dict(zip(_NEW_ROLLOUT, row))
            enqueued = self._run(lambda c: c.execute(_ENQUEUE_ONE, params).fetchone()[0], single=True)
        except pg_errors.UniqueViolation:
            if chosen:
                raise DuplicateRolloutError(row[0]) from None
            raise
        if not enqueued:
            raise UnknownResourcesError(row[4])

    def _start_now(self, c: Any, rollout_id: str, runner_id: str) -> Rollout:
        """Start the first attempt of a rollout just enqueued in the transaction of ``c`` (``start_rollout``):
        the claim statement, for that rollout only."""
        params = {**self._claim_params(runner_id, 1), "rollout_id": rollout_id}
        [rollout], _, _, _ = self._claimed(c.execute(START, params).fetchall(), params["now"])
        return rollout

    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)

        def attempt() -> Tuple[Optional[List[Rollout]], Optional[float]]:
            claimed, next_expiry = self._claim(runner_id, limit)
            return claimed or None, next_expiry

        return self._wait(QUEUE_CHANNEL, timeout, attempt) or []

    def _claim(self, runner_id: str, limit: int) -> Tuple[List[Rollout], Optional[float]]:
        """Claim up to ``limit`` queued rollouts (reaping first if an attempt expired); also returns the next
        expiry. One statement, which also tells whether an attempt has expired: only then is there more."""
        claimed, deadlines, next_before, now = self._claim_once(runner_id, limit)
        if next_before is not None and next_before <= now:
            reaped, next_before = self._reap()
            if reaped and len(claimed) < limit:  # the reap may have requeued some: claim them in this call
                more, more_deadlines, _, _ = self._claim_once(runner_id, limit - len(claimed))
                claimed += more
                deadlines += more_deadlines
        return claimed, min((d for d in deadlines + [next_before] if d is not None), default=None)

    def _claim_once(
        self, runner_id: str, limit: int
    ) -> Tuple[List[Rollout], List[Optional[float]], Optional[float], float]:
        """One claim statement: the claimed rollouts, their attempts' deadlines, the earliest deadline of the
        attempts that were running before, and the time of the claim."""
        params = self._claim_params(runner_id, limit)
        sql = claim_statement(limit)
        return self._claimed(self._run(lambda c: c.execute(sql, params).fetchall(), single=True), params["now"])

    def _claim_params(self, runner_id: str, limit: int) -> Dict[str, Any]:
        attempt_ids = [new_id("at") for _ in range(limit)]
        return {"now": self._now(), "runner_id": runner_id, "attempt_ids": attempt_ids}

    @staticmethod
    def _claimed(
        rows: List[Tuple[Any, ...]], now: float
    ) -> Tuple[List[Rollout], List[Optional[float]], Optional[float], float]:
        claimed = [row for row in rows if row[0] is not None]
        return [rollout_from_row(row[:25]) for row in claimed], [row[25] for row in claimed], rows[0][27], now

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        def work(c: Any) -> Attempt:
            now = self._now()
            aid, _, _, start, timeout, hb_timeout, _, _ = self._live_attempt(c, rollout_id, attempt_id)
            deadline = _rules.attempt_deadline(start, now, timeout, hb_timeout)
            return attempt_from_row(c.execute(HEARTBEAT, (now, deadline, aid)).fetchone())

        return self._run(work)

    def _complete_attempt(self, done: Completion) -> Rollout:
        params = self._complete_params(done)
        row = self._run(lambda c: c.execute(COMPLETE, params).fetchone(), single=True)
        if row is None:
            return self._run(lambda c: self._raise_unknown(c, done.rollout_id, done.attempt_id), write=False)
        return self._completed(row, done.rollout_id, done.attempt_id)

    def _complete_params(self, done: Completion) -> Dict[str, Any]:
        """COMPLETE's parameters for a checked completion (see :meth:`Completion.checked`)."""
        return {
            "rollout_id": done.rollout_id,
            "attempt_id": done.attempt_id,
            "status": done.status,
            "reward": done.reward,
            "error": done.error,
            "now": self._now(),
            "on_retry": _rules.next_rollout_status(done.status, n_attempts=1, max_attempts=2),
            "on_last": _rules.next_rollout_status(done.status, n_attempts=2, max_attempts=2),
        }

    @staticmethod
    def _completed(row: Tuple[Any, ...], rollout_id: str, attempt_id: str) -> Rollout:
        """The rollout COMPLETE returned, or the error for an attempt that was no longer running."""
        attempt_status, rollout_status = row[:2]
        if attempt_status != "running":
            raise _rules.stale_error(rollout_id, attempt_id, attempt_status, rollout_status)
        return rollout_from_row(row[2:27])

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        def work(c: Any) -> Rollout:
            now = self._now()
            status, aid = _sql.cancellable(DIALECT, c, rollout_id, lock=" FOR UPDATE")
            if status == "running":
                c.execute(
                    "UPDATE agl_attempts SET status = 'cancelled', end_time = %s, deadline = NULL WHERE aid = %s",
                    (now, aid),
                )
            if status != "cancelled":
                c.execute(
                    "UPDATE agl_rollouts SET status = 'cancelled', end_time = %s, queue_pos = NULL "
                    "WHERE rollout_id = %s",
                    (now, rollout_id),
                )
                c.execute(f"NOTIFY {DONE_CHANNEL}")  # sent at commit
            return self._select_one(c, rollout_id)

        return self._run(work)

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._run(lambda c: self._select_one(c, rollout_id), write=False)

    def _query_rollouts(self, query: RolloutQuery) -> List[Rollout]:
        sql, params = _sql.query_rollouts_sql(DIALECT, query)
        rows = self._run(lambda c: c.execute(sql, params).fetchall(), write=False)
        return [rollout_from_row(row) for row in rows]

    def query_attempts(self, rollout_id: str) -> List[Attempt]:
        def work(c: Any) -> List[Attempt]:
            sql = f"SELECT {ATTEMPT_COLS} FROM agl_attempts a WHERE a.rollout_id = %s ORDER BY a.sequence"
            rows = c.execute(sql, (rollout_id,)).fetchall()
            if not rows:
                self._select_one(c, rollout_id)  # raises if the rollout is unknown
            return [attempt_from_row(row) for row in rows]

        return self._run(work, write=False)

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> List[Rollout]:
        wait = functools.partial(self._wait, DONE_CHANNEL)
        return wait_for_rollouts(self.query_rollouts, rollout_ids, timeout, self._statuses, self._reap, wait)

    def _statuses(self, ids: Sequence[str]) -> Dict[str, str]:
        sql = "SELECT rollout_id, status FROM agl_rollouts WHERE rollout_id = ANY(%s)"
        return dict(self._run(lambda c: c.execute(sql, (list(ids),)).fetchall(), write=False))

    def reap_expired(self) -> List[Rollout]:
        return self._reap()[0]

    def renew_heartbeats(self) -> int:
        return self._run(lambda c: c.execute(RENEW_HEARTBEATS, {"t": self._now()}).rowcount)
