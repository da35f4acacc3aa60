"""The store for many machines: one PostgreSQL database shared by the trainer and runners anywhere.

    store = PostgresLightningStore("postgresql://agl:secret@db-host:5432/agl")   # or open_store(url)

Why it is built this way:
- Runners on many machines claim work with ``FOR UPDATE SKIP LOCKED``: each claim locks the queued rows it
  takes and skips rows another claim holds, so claims never wait for each other nor hand out a rollout
  twice. Every other state change locks its rollout row (then the attempt's) first, so a completion, a
  cancel and a reap of the same attempt are applied one after the other, each seeing what the one before
  committed, and the shared rules (:mod:`agl.store._rules`) decide the outcome as in the other backends.
- Waiters are woken by ``LISTEN``/``NOTIFY``, not by polling: a writer's ``NOTIFY`` is sent when its
  transaction commits. Each store object keeps one listening connection per process (started on the
  first wait), whose thread wakes the waiting threads of that process.
- Connections come from a small pool (``max_connections`` per store object and process), opened on
  demand. A connection the server dropped (restart, ``pg_terminate_backend``, network cut) is replaced and
  the operation retried when nothing of it can have been committed; if the connection died while
  committing, the caller gets a :class:`~agl.errors.StoreUnavailableError` saying the outcome is unknown.
- Fork-safe (``multiprocess_safe``): a child process never touches its parent's connections (they stay
  referenced, never closed, as closing would end the parent's sessions) and opens its own. The object
  pickles as its DSN and options.
- Times come from this machine's clock corrected by its offset from the database server's clock
  (measured when the store opens), so machines whose clocks disagree still agree on deadlines.
- Spans go in with ``COPY`` (about ten times faster than ``INSERT`` here); a batch holding a span that is
  already stored (sent again) is inserted with ``ON CONFLICT DO NOTHING`` instead, so it is ignored.
- The calls of a runner's rollout cycle (claim, small span batches, completion, resources) also exist as
  coroutines (:class:`~agl.store.base.AsyncRolloutCalls`) on psycopg's async connections, for the store
  server's event loop: the same statements, results, errors and retries, without the hop to a worker
  thread, which costs the server more CPU than the call (see :mod:`agl.store.postgres.async_pool`).

The schema (tables prefixed ``agl_``) is created on first use and versioned; see
:mod:`agl.store.postgres.schema`.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from pydantic_core import from_json

from agl.store import _rules, _sql
from agl.store.base import AsyncRolloutCalls, Completion, LightningStore, StoreStats
from agl.store.postgres.connections import redacted
from agl.store.postgres.rollouts import DIALECT, ROLLOUT_EXISTS, _unknown
from agl.store.postgres.schema import ADD_SPANS, COMPLETE, claim_statement
from agl.store.postgres.spans import _SMALL_SPAN_BATCH, PostgresSpans, _small_batch_params
from agl.types import Resource, ResourcesUpdate, Rollout, Span


class PostgresLightningStore(PostgresSpans, LightningStore, AsyncRolloutCalls):
    """A LightningStore in a PostgreSQL database, shared by every process on every machine that opens it.

    Its connections and retries come from :class:`~agl.store.postgres.database.PostgresDatabase`, the rollout
    cycle from :class:`~agl.store.postgres.rollouts.PostgresRollouts`, the spans from
    :class:`~agl.store.postgres.spans.PostgresSpans`; resources, stats and the async calls are its own.
    """

    multiprocess_safe: ClassVar[bool] = True

    def __getstate__(self) -> Dict[str, Any]:
        return {"dsn": self.dsn, "max_connections": self.max_connections, "reconnect_timeout": self.reconnect_timeout}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        PostgresLightningStore.__init__(self, **state)  # not a subclass's __init__: it may take other arguments

    def __repr__(self) -> str:
        return f"PostgresLightningStore({redacted(self.dsn)!r})"

    # -- resources -----------------------------------------------------------------------------------------
    def add_resources(self, resources: Dict[str, Resource], resources_id: Optional[str] = None) -> ResourcesUpdate:
        encoded = _rules.encode_resources(resources, resources_id)

        def work(c: Any) -> Tuple[str, int, float]:
            now = self._now()
            # versions are numbered 1, 2, 3, ... across machines: one writer at a time (readers go on)
            c.execute("LOCK TABLE agl_resources IN SHARE ROW EXCLUSIVE MODE")
            rid, version = _sql.insert_resources(DIALECT, c, resources_id, encoded, now)
            return rid, version, now

        rid, version, now = self._run(work)
        return _sql.resources_from_row((version, rid, encoded, now))

    def get_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        sql, params = _sql.resources_query(DIALECT, resources_id)
        return _sql.resources_update(self._run(lambda c: c.execute(sql, params).fetchone(), write=False), resources_id)

    # -- the calls of a rollout cycle, for an event loop (see agl.store.base.AsyncRolloutCalls) ----------------
    async def aclaim(self, runner_id: str, limit: int = 1) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)
        params = self._claim_params(runner_id, limit)
        rows = await self._arun(claim_statement(limit), params, write=True, fetch_all=True)
        claimed, _, next_before, now = self._claimed(rows, params["now"])
        if next_before is not None and next_before <= now:  # an attempt has expired: reap (rare) on a thread
            reaped, _ = await asyncio.to_thread(self._reap)
            if reaped and len(claimed) < limit:  # the reap may have requeued some: claim them in this call
                claimed += await self.aclaim(runner_id, limit - len(claimed))
        return claimed

    async def aadd_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            self._state()
            return 0
        if len(spans) > _SMALL_SPAN_BATCH:
            return await asyncio.to_thread(self.add_spans, spans)  # big batches go in with COPY, on a thread
        rows, learnt = self._pg_rows(spans)
        keys = list(dict.fromkeys((row[0], row[1]) for row in rows))
        params = _small_batch_params(rows, keys)
        while True:
            params["now"] = self._now()
            known, stored = await self._arun(ADD_SPANS, params, write=True)
            if known:
                self._prefixes.learn(learnt)
                return int(stored)
            await asyncio.to_thread(self._check_span_attempts, keys)

    async def _acomplete_attempt(self, done: Completion) -> Rollout:
        row = await self._arun(COMPLETE, self._complete_params(done), write=True)
        if row is None:
            exists = await self._arun(ROLLOUT_EXISTS, (done.rollout_id,), write=False) is not None
            raise _unknown(exists, done.rollout_id, done.attempt_id)
        return self._completed(row, done.rollout_id, done.attempt_id)

    async def aget_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        sql, params = _sql.resources_query(DIALECT, resources_id)
        return _sql.resources_update(await self._arun(sql, params, write=False), resources_id)

    # -- misc ----------------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        sql = (  # one statement: every count from the same snapshot
            "SELECT (SELECT coalesce(json_object_agg(status, n), '{}') FROM "
            "(SELECT status, count(*) AS n FROM agl_rollouts GROUP BY status) s)::text, "
            "(SELECT count(*) FROM agl_attempts), (SELECT count(*) FROM agl_spans), "
            "(SELECT count(*) FROM agl_resources)"
        )
        by_status, n_attempts, n_spans, n_versions = self._run(lambda c: c.execute(sql).fetchone(), write=False)
        counts = {status: 0 for status in _rules.ROLLOUT_STATUSES}
        counts.update(from_json(by_status))
        return StoreStats(rollouts=counts, attempts=n_attempts, spans=n_spans, resources_versions=n_versions)
