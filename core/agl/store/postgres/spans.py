"""The spans of the PostgreSQL store (:class:`PostgresSpans`): small batches in one statement, big ones with
``COPY`` (insert-only, so a batch sent again is ignored), reading an attempt's spans, deleting finished ones."""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Optional, Sequence, Tuple

from psycopg import errors as pg_errors
from pydantic_core import to_json

from agl.errors import UnknownRolloutError
from agl.store import _rules, _sql
from agl.store.postgres.rollouts import DIALECT, PostgresRollouts
from agl.store.postgres.schema import ADD_SPANS, COPY_SPANS, HEARTBEATS, INSERT_SPANS, SPAN_ATTEMPTS
from agl.store.prefixes import Key, Last, SharedPrefixes
from agl.store.sqlite.schema import Row
from agl.types import Span

# Batches of up to this many spans go in with one statement (ADD_SPANS); bigger ones with COPY, which takes
# more round trips but less time per span.
_SMALL_SPAN_BATCH = 64


def pg_row(row: Row) -> Row:
    """A ``span_to_row`` row for ``agl_spans``: the compact attributes go to ``payload``; ``attributes`` stays
    empty (it holds JSON in rows of schema 1 only)."""
    return row[:12] + ("", row[13], row[12])


def _small_batch_params(rows: List[Tuple[Any, ...]], keys: List[Tuple[str, str]]) -> Dict[str, Any]:
    """ADD_SPANS's parameters: the batch as one JSON array, payloads in base64 (the first copy of a span wins)."""
    first: Dict[Tuple[str, str, str], Tuple[Any, ...]] = {}
    for row in rows:
        if row[:3] not in first:
            first[row[:3]] = row[:14] + (base64.b64encode(row[14]).decode(),)
    return {"spans": to_json(list(first.values())).decode(), "n_keys": len(keys)}


class PostgresSpans(SharedPrefixes, PostgresRollouts):
    """The span calls of the LightningStore contract on PostgreSQL."""

    def _pg_rows(self, spans: Sequence[Span]) -> Tuple[List[Row], Dict[Key, Last]]:
        """The batch's rows (encoded before any round trip), and what the prefix cache learns once stored."""
        rows, learnt = self._prefixes.rows(spans)
        return [pg_row(row) for row in rows], learnt

    def add_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            self._state()
            return 0
        rows, learnt = self._pg_rows(spans)
        stored = self._add_rows(rows)
        self._prefixes.learn(learnt)
        return stored

    def _add_rows(self, rows: List[Row]) -> int:
        keys = list(dict.fromkeys((row[0], row[1]) for row in rows))
        if len(rows) <= _SMALL_SPAN_BATCH:
            return self._add_small_batch(rows, keys)

        def work(c: Any, copy: bool) -> int:
            now = self._now()
            found = self._span_attempts(c, keys)
            first: Dict[Tuple[int, str], Tuple[Any, ...]] = {}  # (aid, span_id) -> row: the first copy wins
            for row in rows:
                aid = found[(row[0], row[1])][0]
                first.setdefault((aid, row[2]), (aid,) + row)
            with c.cursor() as cur:
                if copy:
                    with cur.copy(COPY_SPANS) as stream:
                        for row in first.values():
                            stream.write_row(row)
                    stored = len(first)
                else:
                    cur.execute(INSERT_SPANS, [list(column) for column in zip(*first.values())])
                    stored = cur.rowcount
                beats = [  # a span of a running attempt counts as its heartbeat
                    (aid, _rules.attempt_deadline(start, now, timeout, hb_timeout))
                    for aid, status, start, timeout, hb_timeout in found.values()
                    if status == "running"
                ]
                if beats:
                    cur.execute(HEARTBEATS, (now, [b[0] for b in beats], [b[1] for b in beats]))
            return stored

        try:  # COPY is ~10 times faster than INSERT here, but cannot skip spans that are already stored
            return self._run(lambda c: work(c, copy=True))
        except pg_errors.UniqueViolation:  # some were (a batch sent again): insert skipping those
            return self._run(lambda c: work(c, copy=False))

    def _add_small_batch(self, rows: List[Tuple[Any, ...]], keys: List[Tuple[str, str]]) -> int:
        """``add_spans`` of a small batch: one statement (ADD_SPANS) in the common case."""
        params = _small_batch_params(rows, keys)
        while True:
            params["now"] = self._now()
            known, stored = self._run(lambda c: c.execute(ADD_SPANS, params).fetchone(), single=True)
            if known:
                return int(stored)
            self._check_span_attempts(keys)
            # all are known now (enqueued or claimed meanwhile): store them

    def _check_span_attempts(self, keys: List[Tuple[str, str]]) -> None:
        """After ADD_SPANS found an attempt missing: raise for the first unknown (rollout, attempt)."""
        self._run(lambda c: self._span_attempts(c, keys), write=False)

    @staticmethod
    def _span_attempts(c: Any, keys: List[Tuple[str, str]]) -> Dict[Tuple[str, str], Tuple[Any, ...]]:
        """(rollout_id, attempt_id) -> (aid, status, start_time, timeout, heartbeat timeout) for each key;
        raises UnknownRolloutError/UnknownAttemptError for the first unknown one, as the other backends."""
        found = {
            (r[0], r[1]): r[2:]
            for r in c.execute(SPAN_ATTEMPTS, ([k[0] for k in keys], [k[1] for k in keys])).fetchall()
        }
        for rollout_id, attempt_id in keys:
            if (rollout_id, attempt_id) not in found:
                PostgresSpans._raise_unknown(c, rollout_id, attempt_id)
        return found

    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = "latest") -> List[Span]:
        return self._run(lambda c: _sql.query_spans(DIALECT, c, rollout_id, attempt_id), write=False)

    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        ids = list(dict.fromkeys(rollout_ids))

        def work(c: Any) -> int:
            # FOR SHARE: a finished rollout stays finished, but an unfinished one must not finish in between
            sql = "SELECT rollout_id, status FROM agl_rollouts WHERE rollout_id = ANY(%s) FOR SHARE"
            status = dict(c.execute(sql, (ids,)).fetchall())
            for rollout_id in ids:  # every id is checked before anything is deleted: all or nothing
                if rollout_id not in status:
                    raise UnknownRolloutError(rollout_id)
                _rules.check_spans_deletable(rollout_id, status[rollout_id])
            return c.execute(
                "DELETE FROM agl_spans WHERE aid IN (SELECT aid FROM agl_attempts WHERE rollout_id = ANY(%s))", (ids,)
            ).rowcount

        deleted = self._run(work) if ids else 0
        self._prefixes.forget(ids)
        return deleted
