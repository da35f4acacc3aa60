"""The PostgreSQL store's schema and SQL.

Layout choices:
- The same columns, in the same order, as the SQLite store (:mod:`agl.store._sqlite_schema`), so both
  share one set of row conversions. Inputs, metadata, attributes and events are JSON kept as ``text``,
  not ``jsonb``: ``jsonb`` reorders object keys, and what a caller stored must read back as it was.
- Tables are prefixed ``agl_`` so that the store can live in a database that holds other tables.
- ``agl_rollouts.queue_pos`` comes from a sequence: a requeued rollout goes to the back of the queue.
  The queue is a partial index over queued rollouts only, read with ``FOR UPDATE SKIP LOCKED`` so that
  runners on many machines claim disjoint rollouts without waiting for each other.
- ``agl_attempts.aid`` and ``agl_spans.sid`` grow with time: updates and inserts touch recent pages, and
  ``sid`` orders spans with equal sequence ids in the order they arrived.
- ``agl_schema`` holds the schema version; a store refuses a database written by a newer agl.
"""

from __future__ import annotations

from agl.store._sqlite_schema import ATTEMPT_COLS, ROLLOUT_COLS, SPAN_COLS

SCHEMA_VERSION = 1

#: Serialises schema creation between machines that open a new database at the same moment.
SCHEMA_LOCK_KEY = 0x61676C5F73636865  # "agl_sche"

#: NOTIFY channels: work was enqueued or requeued / a rollout finished or a deadline appeared.
QUEUE_CHANNEL = "agl_queue"
DONE_CHANNEL = "agl_done"

SCHEMA = """
CREATE SEQUENCE agl_queue_pos;
CREATE TABLE agl_rollouts (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id text NOT NULL UNIQUE,
    task_id text NOT NULL,
    input text NOT NULL,
    mode text NOT NULL,
    status text NOT NULL,
    resources_id text,
    max_attempts integer NOT NULL,
    timeout_seconds double precision,
    heartbeat_timeout_seconds double precision,
    metadata text NOT NULL,
    n_attempts integer NOT NULL DEFAULT 0,
    final_reward double precision,
    error text,
    create_time double precision NOT NULL,
    start_time double precision,
    end_time double precision,
    queue_pos bigint,
    latest_aid bigint
);
CREATE INDEX agl_rollouts_queue ON agl_rollouts (queue_pos) WHERE queue_pos IS NOT NULL;
CREATE INDEX agl_rollouts_task ON agl_rollouts (task_id);
CREATE TABLE agl_attempts (
    aid bigserial PRIMARY KEY,
    rollout_id text NOT NULL,
    attempt_id text NOT NULL,
    sequence integer NOT NULL,
    runner_id text,
    status text NOT NULL,
    start_time double precision NOT NULL,
    end_time double precision,
    last_heartbeat double precision NOT NULL,
    error text,
    deadline double precision,
    UNIQUE (rollout_id, attempt_id)
);
CREATE INDEX agl_attempts_deadline ON agl_attempts (deadline) WHERE status = 'running' AND deadline IS NOT NULL;
CREATE TABLE agl_spans (
    sid bigint GENERATED ALWAYS AS IDENTITY,
    aid bigint NOT NULL,
    span_id text NOT NULL,
    rollout_id text NOT NULL,
    attempt_id text NOT NULL,
    sequence_id bigint NOT NULL,
    trace_id text NOT NULL,
    parent_id text,
    name text NOT NULL,
    kind text NOT NULL,
    start_time bigint NOT NULL,
    end_time bigint NOT NULL,
    status text NOT NULL,
    error text,
    attributes text NOT NULL,
    events text NOT NULL,
    UNIQUE (aid, span_id)
);
CREATE TABLE agl_resources (
    version integer PRIMARY KEY,
    resources_id text NOT NULL UNIQUE,
    resources text NOT NULL,
    create_time double precision NOT NULL
);
CREATE TABLE agl_schema (version integer NOT NULL);
"""

# Empties a store's database (for test databases that are lent again). DELETE, not TRUNCATE: on a few rows it
# takes a millisecond, TRUNCATE ~50. The internal sequences keep counting, which nothing of the API shows.
RESET = "DELETE FROM agl_rollouts; DELETE FROM agl_attempts; DELETE FROM agl_spans; DELETE FROM agl_resources"

SELECT_ROLLOUTS = (
    f"SELECT {ROLLOUT_COLS}, {ATTEMPT_COLS} FROM agl_rollouts r LEFT JOIN agl_attempts a ON a.aid = r.latest_aid"
)

INSERT_ROLLOUT = (
    "INSERT INTO agl_rollouts (rollout_id, task_id, input, mode, resources_id, max_attempts, timeout_seconds, "
    "heartbeat_timeout_seconds, metadata, create_time, status, queue_pos) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 'queued', nextval('agl_queue_pos'))"
)

# Claims the first ``limit`` queued rollouts nobody else is claiming right now; returns the SELECT_ROLLOUTS
# rollout columns as they are after the claim, the new attempt's aid and the queue position (for order).
CLAIM = (
    "UPDATE agl_rollouts r SET status = 'running', queue_pos = NULL, n_attempts = r.n_attempts + 1, "
    "start_time = coalesce(r.start_time, %(now)s), latest_aid = nextval('agl_attempts_aid_seq') "
    "FROM (SELECT seq, queue_pos FROM agl_rollouts WHERE queue_pos IS NOT NULL ORDER BY queue_pos "
    "LIMIT %(limit)s FOR UPDATE SKIP LOCKED) p "
    f"WHERE r.seq = p.seq RETURNING {ROLLOUT_COLS}, r.latest_aid, p.queue_pos"
)

INSERT_ATTEMPT = (
    "INSERT INTO agl_attempts (aid, rollout_id, attempt_id, sequence, runner_id, status, start_time, "
    "last_heartbeat, deadline) VALUES (%s, %s, %s, %s, %s, 'running', %s, %s, %s)"
)

# The attempt's row joined with its rollout's bookkeeping, both rows locked (rollout first, as every state
# change locks them) until the transaction ends. Both must be locked: a row read but not locked would be
# the version of the statement's start, and miss a reap or cancel that committed while this one waited.
LIVE_ATTEMPT = (
    "SELECT a.aid, a.status, r.status, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds, "
    "r.n_attempts, r.max_attempts FROM agl_rollouts r JOIN agl_attempts a ON a.rollout_id = r.rollout_id "
    "WHERE r.rollout_id = %s AND a.attempt_id = %s FOR UPDATE OF r, a"
)

# Ends a live attempt and moves its rollout on (one of the ROLLOUT_* updates), notifies ``channel`` at commit,
# and returns the SELECT_ROLLOUTS row of the rollout as it now is (the ended attempt is its latest).
END_ATTEMPT = (
    "WITH a AS (UPDATE agl_attempts a SET status = %s, end_time = %s, error = %s, deadline = NULL WHERE a.aid = %s "
    f"RETURNING {ATTEMPT_COLS}), "
    "r AS (UPDATE agl_rollouts r SET {rollout_update} WHERE r.rollout_id = %s "
    f"RETURNING {ROLLOUT_COLS}) "
    "SELECT r.*, a.* FROM r, a, pg_notify(%s, '')"
)
ROLLOUT_SUCCEEDED = "status = 'succeeded', final_reward = %s, error = NULL, end_time = %s"
ROLLOUT_REQUEUED = "status = 'queued', error = %s, queue_pos = nextval('agl_queue_pos')"
ROLLOUT_FAILED = "status = 'failed', error = %s, end_time = %s"

NEXT_DEADLINE = "SELECT min(deadline) FROM agl_attempts WHERE status = 'running' AND deadline IS NOT NULL"

# Expired attempts that no other machine is ending right now.
EXPIRED = (
    "SELECT a.aid, a.rollout_id, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds, "
    "r.n_attempts, r.max_attempts FROM agl_rollouts r JOIN agl_attempts a ON a.rollout_id = r.rollout_id "
    "WHERE a.status = 'running' AND a.deadline <= %s ORDER BY a.aid FOR UPDATE OF r, a SKIP LOCKED"
)

SPAN_COLUMNS = (
    "aid, rollout_id, attempt_id, span_id, sequence_id, trace_id, parent_id, name, kind, start_time, end_time, "
    "status, error, attributes, events"
)
# The fast way in for spans none of which is stored yet (a stored one makes it fail: UniqueViolation).
COPY_SPANS = f"COPY agl_spans ({SPAN_COLUMNS}) FROM STDIN"
# The way that skips stored spans; one array per column: one statement for a batch of any size.
INSERT_SPANS = (
    f"INSERT INTO agl_spans ({SPAN_COLUMNS}) "
    "SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[], %s::text[], "
    "%s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[]) "
    "ON CONFLICT (aid, span_id) DO NOTHING"
)

HEARTBEAT = f"UPDATE agl_attempts a SET last_heartbeat = %s, deadline = %s WHERE a.aid = %s RETURNING {ATTEMPT_COLS}"
# Heartbeats of several attempts at once: ``now``, then their aids and new deadlines as arrays.
HEARTBEATS = (
    "UPDATE agl_attempts a SET last_heartbeat = %s, deadline = b.deadline "
    "FROM unnest(%s::bigint[], %s::float8[]) AS b(aid, deadline) WHERE a.aid = b.aid AND a.status = 'running'"
)

SPAN_ATTEMPTS = (
    "SELECT a.rollout_id, a.attempt_id, a.aid, a.status, a.start_time, r.timeout_seconds, "
    "r.heartbeat_timeout_seconds FROM agl_attempts a JOIN agl_rollouts r ON r.rollout_id = a.rollout_id "
    "WHERE (a.rollout_id, a.attempt_id) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
)

__all__ = [
    "ATTEMPT_COLS",
    "CLAIM",
    "COPY_SPANS",
    "DONE_CHANNEL",
    "END_ATTEMPT",
    "EXPIRED",
    "HEARTBEAT",
    "HEARTBEATS",
    "INSERT_ATTEMPT",
    "INSERT_ROLLOUT",
    "INSERT_SPANS",
    "LIVE_ATTEMPT",
    "NEXT_DEADLINE",
    "QUEUE_CHANNEL",
    "RESET",
    "ROLLOUT_FAILED",
    "ROLLOUT_REQUEUED",
    "ROLLOUT_SUCCEEDED",
    "ROLLOUT_COLS",
    "SCHEMA",
    "SCHEMA_LOCK_KEY",
    "SCHEMA_VERSION",
    "SELECT_ROLLOUTS",
    "SPAN_ATTEMPTS",
    "SPAN_COLS",
]
