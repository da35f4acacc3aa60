"""The PostgreSQL store's schema and SQL.

Layout choices:
- The same columns, in the same order, as the SQLite store (:mod:`agl.store.sqlite.schema`), so both
  share one set of row conversions. Inputs, metadata and events are JSON kept as ``text``, not ``jsonb``:
  ``jsonb`` reorders object keys, and what a caller stored must read back as it was. A span's attributes are
  compact bytes (:mod:`agl.store.span_codec`) in ``payload``; rows of schema 1 keep their JSON ``attributes``
  (and a NULL ``payload``), which read the same. Rows up to half a page stay in the table
  (``toast_tuple_target``): payloads are compressed already, and moving each ~2 KB one to TOAST took ~12% more
  bytes; longer ones go to TOAST, as a row of more than half a page would leave the rest of its page empty.
- Tables are prefixed ``agl_`` so that the store can live in a database that holds other tables.
- ``agl_rollouts.queue_pos`` comes from a sequence: a requeued rollout goes to the back of the queue.
  The queue is a partial index over queued rollouts only, read with ``FOR UPDATE SKIP LOCKED`` so that
  runners on many machines claim disjoint rollouts without waiting for each other.
- ``agl_attempts.aid`` and ``agl_spans.sid`` grow with time: updates and inserts touch recent pages, and
  ``sid`` orders spans with equal sequence ids in the order they arrived.
- ``agl_schema`` holds the schema version; a store refuses a database written by a newer agl.
"""

from __future__ import annotations

import functools

from agl.store.sqlite.schema import ATTEMPT_COLS, ROLLOUT_COLS, SPAN_COLS

SCHEMA_VERSION = 2
#: What turns an older schema into this one, by the version it starts from.
MIGRATIONS = {
    1: ("ALTER TABLE agl_spans ADD COLUMN payload bytea", "ALTER TABLE agl_spans SET (toast_tuple_target = 4080)")
}

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
    payload bytea,
    UNIQUE (aid, span_id)
) WITH (toast_tuple_target = 4080);
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

# The whole of a claim in one statement (one round trip, committed on its own): takes the first
# ``limit`` queued rollouts nobody else is claiming right now, starts an attempt of each (ids from
# ``attempt_ids``, in queue order; its deadline is ``_rules.attempt_deadline(now, now, ...)``: ``least``
# skips NULLs as that rule skips absent bounds) and notifies DONE_CHANNEL if one can expire, so that a
# waiter sleeping until the next expiry learns of it. Returns one row per claimed rollout (SELECT_ROLLOUTS
# columns, then the new deadline and the queue position), or one row of NULLs when none was; every row
# ends with the earliest deadline of the attempts that were running before (the snapshot precedes the
# claim), which tells the caller whether it must reap, then whether it notified.
_CLAIM = (
    "WITH p AS (SELECT seq, queue_pos FROM agl_rollouts WHERE queue_pos IS NOT NULL{only} ORDER BY queue_pos "
    "LIMIT {limit} FOR UPDATE SKIP LOCKED), "
    "c AS (UPDATE agl_rollouts r SET status = 'running', queue_pos = NULL, n_attempts = r.n_attempts + 1, "
    "start_time = coalesce(r.start_time, %(now)s), latest_aid = nextval('agl_attempts_aid_seq') FROM p "
    f"WHERE r.seq = p.seq RETURNING {ROLLOUT_COLS}, r.latest_aid, p.queue_pos, "
    "least(%(now)s + r.timeout_seconds, %(now)s + r.heartbeat_timeout_seconds) AS deadline), "
    "n AS (SELECT c.*, (%(attempt_ids)s::text[])[row_number() OVER (ORDER BY c.queue_pos)] AS attempt_id FROM c), "
    "i AS (INSERT INTO agl_attempts (aid, rollout_id, attempt_id, sequence, runner_id, status, start_time, "
    "last_heartbeat, deadline) SELECT n.latest_aid, n.rollout_id, n.attempt_id, n.n_attempts, %(runner_id)s, "
    "'running', %(now)s, %(now)s, n.deadline FROM n), "
    "d AS (SELECT min(deadline) AS next_deadline, "
    f"(SELECT count(pg_notify('{DONE_CHANNEL}', '')) FROM n WHERE n.deadline IS NOT NULL) AS notified "
    "FROM agl_attempts WHERE status = 'running' AND deadline IS NOT NULL) "
    "SELECT n.rollout_id, n.task_id, n.input, n.mode, n.status, n.resources_id, n.max_attempts, n.timeout_seconds, "
    "n.heartbeat_timeout_seconds, n.metadata, n.n_attempts, n.final_reward, n.error, n.create_time, n.start_time, "
    "n.end_time, n.rollout_id, n.attempt_id, n.n_attempts, %(runner_id)s, 'running', %(now)s, NULL, %(now)s, NULL, "
    "n.deadline, n.queue_pos, d.next_deadline, d.notified FROM d LEFT JOIN n ON TRUE ORDER BY n.queue_pos"
)


@functools.lru_cache(maxsize=64)
def claim_statement(limit: int) -> str:
    """The claim of up to ``limit`` rollouts, the limit written into the statement.

    Why not ``LIMIT %(limit)s``: with the limit unknown, PostgreSQL's generic plan for the prepared statement
    expects hundreds of claimed rows and joins them by scanning the table (2-3 ms), so it re-plans the
    statement on every call instead (planning is half of its ~470 µs of PostgreSQL CPU). With the limit in the
    text the generic plan is the right one and is reused: ~260 µs. Runners use one or two limits, so this
    makes one or two prepared statements per connection.
    """
    return _CLAIM.replace("{limit}", str(int(limit))).replace("{only}", "")


#: The claim of one rollout, ``%(rollout_id)s``, just enqueued in the same transaction (``start_rollout``).
START = _CLAIM.replace("{limit}", "1").replace("{only}", " AND rollout_id = %(rollout_id)s")


# The attempt's row joined with its rollout's bookkeeping, both rows locked (rollout first, as every state
# change locks them) until the transaction ends. Both must be locked: a row read but not locked would be
# the version of the statement's start, and miss a reap or cancel that committed while this one waited.
LIVE_ATTEMPT = (
    "SELECT a.aid, a.status, r.status, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds, "
    "r.n_attempts, r.max_attempts FROM agl_rollouts r JOIN agl_attempts a ON a.rollout_id = r.rollout_id "
    "WHERE r.rollout_id = %s AND a.attempt_id = %s FOR UPDATE OF r, a"
)

# Ends a live attempt and moves its rollout on (``_sql.rollout_assignments``), notifies ``channel`` at commit,
# and returns the SELECT_ROLLOUTS row of the rollout as it now is (the ended attempt is its latest).
END_ATTEMPT = (
    "WITH a AS (UPDATE agl_attempts a SET status = %s, end_time = %s, error = %s, deadline = NULL WHERE a.aid = %s "
    f"RETURNING {ATTEMPT_COLS}), "
    "r AS (UPDATE agl_rollouts r SET {rollout_update} WHERE r.rollout_id = %s "
    f"RETURNING {ROLLOUT_COLS}) "
    "SELECT r.*, a.* FROM r, a, pg_notify(%s, '')"
)

# ``complete_attempt`` in one statement (one round trip, committed on its own): locks the rollout and the
# attempt (rollout first, as every state change does) and, only if the attempt is still running, ends it
# as END_ATTEMPT would. Where the rollout goes is ``on_retry`` while attempts are left, else ``on_last``
# (both decided by ``_rules.next_rollout_status``). Returns one row, or none for unknown ids: the attempt's
# and the rollout's status as locked (a non-running attempt was left alone), then the SELECT_ROLLOUTS
# columns of the rollout as it now is (NULLs when nothing changed). The locked row is the newest version
# (a reap that committed while this waited is seen), and the updates re-check it.
COMPLETE = (
    "WITH l AS (SELECT a.aid, a.status AS attempt_status, r.status AS rollout_status, "
    "CASE WHEN r.n_attempts < r.max_attempts THEN %(on_retry)s ELSE %(on_last)s END AS next "
    "FROM agl_rollouts r JOIN agl_attempts a ON a.rollout_id = r.rollout_id "
    "WHERE r.rollout_id = %(rollout_id)s AND a.attempt_id = %(attempt_id)s FOR UPDATE OF r, a), "
    "a AS (UPDATE agl_attempts a SET status = %(status)s, end_time = %(now)s, error = %(error)s, deadline = NULL "
    f"FROM l WHERE a.aid = l.aid AND l.attempt_status = 'running' RETURNING {ATTEMPT_COLS}), "
    "r AS (UPDATE agl_rollouts r SET status = l.next, "
    "final_reward = CASE WHEN l.next = 'succeeded' THEN %(reward)s::float8 ELSE r.final_reward END, "
    "error = CASE WHEN l.next = 'succeeded' THEN NULL ELSE %(error)s END, "
    "end_time = CASE WHEN l.next = 'queued' THEN r.end_time ELSE %(now)s END, "
    "queue_pos = CASE WHEN l.next = 'queued' THEN nextval('agl_queue_pos') ELSE r.queue_pos END "
    "FROM l WHERE r.rollout_id = %(rollout_id)s AND l.attempt_status = 'running' "
    f"RETURNING {ROLLOUT_COLS}, l.next) "
    "SELECT l.attempt_status, l.rollout_status, r.rollout_id, r.task_id, r.input, r.mode, r.status, r.resources_id, "
    "r.max_attempts, r.timeout_seconds, r.heartbeat_timeout_seconds, r.metadata, r.n_attempts, r.final_reward, "
    "r.error, r.create_time, r.start_time, r.end_time, a.*, "
    f"(SELECT pg_notify(CASE WHEN r.next = 'queued' THEN '{QUEUE_CHANNEL}' ELSE '{DONE_CHANNEL}' END, '') "
    "WHERE r.next IS NOT NULL) "
    "FROM l LEFT JOIN r ON TRUE LEFT JOIN a ON TRUE"
)

NEXT_DEADLINE = "SELECT min(deadline) FROM agl_attempts WHERE status = 'running' AND deadline IS NOT NULL"

# Expired attempts that no other machine is ending right now.
EXPIRED = (
    "SELECT a.aid, a.rollout_id, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds, "
    "r.n_attempts, r.max_attempts FROM agl_rollouts r JOIN agl_attempts a ON a.rollout_id = r.rollout_id "
    "WHERE a.status = 'running' AND a.deadline <= %s ORDER BY a.aid FOR UPDATE OF r, a SKIP LOCKED"
)

# Running attempts (with a heartbeat timeout) whose last heartbeat is older than %(t)s count as having sent
# one at %(t)s: ``_rules.attempt_deadline(start, t, ...)``, where ``least`` skips a NULL bound as it does.
RENEW_HEARTBEATS = (
    "UPDATE agl_attempts a SET last_heartbeat = %(t)s, "
    "deadline = least(a.start_time + r.timeout_seconds, %(t)s + r.heartbeat_timeout_seconds) "
    "FROM agl_rollouts r WHERE r.rollout_id = a.rollout_id AND a.status = 'running' AND a.deadline IS NOT NULL "
    "AND r.heartbeat_timeout_seconds IS NOT NULL AND a.last_heartbeat < %(t)s"
)

# When the database server started (its clock, as _now() is): no heartbeat could arrive while it was down.
SERVER_START = "SELECT extract(epoch FROM pg_postmaster_start_time())::float8"

SPAN_COLUMNS = (
    "aid, rollout_id, attempt_id, span_id, sequence_id, trace_id, parent_id, name, kind, start_time, end_time, "
    "status, error, attributes, events, payload"
)
#: SPAN_COLS as read here: the compact payload, or a schema-1 row's JSON attributes as bytes.
PG_SPAN_COLS = SPAN_COLS.replace("s.attributes", "coalesce(s.payload, convert_to(s.attributes, 'UTF8'))")
# The fast way in for spans none of which is stored yet (a stored one makes it fail: UniqueViolation).
COPY_SPANS = f"COPY agl_spans ({SPAN_COLUMNS}) FROM STDIN"
# The way that skips stored spans; one array per column: one statement for a batch of any size.
INSERT_SPANS = (
    f"INSERT INTO agl_spans ({SPAN_COLUMNS}) "
    "SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[], %s::text[], "
    "%s::text[], %s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[], %s::bytea[]) "
    "ON CONFLICT (aid, span_id) DO NOTHING"
)

HEARTBEAT = f"UPDATE agl_attempts a SET last_heartbeat = %s, deadline = %s WHERE a.aid = %s RETURNING {ATTEMPT_COLS}"
# Heartbeats of several attempts at once: ``now``, then their aids and new deadlines as arrays.
HEARTBEATS = (
    "UPDATE agl_attempts a SET last_heartbeat = %s, deadline = b.deadline "
    "FROM unnest(%s::bigint[], %s::float8[]) AS b(aid, deadline) WHERE a.aid = b.aid AND a.status = 'running'"
)

# The attempt (and its rollout's timeouts) that the (rollout_id, attempt_id) of a row ``q`` names, looked up
# by index once per distinct pair: a plain join of a batch with the tables is planned as a hash join over
# the whole tables (the planner guesses a batch has 100 rows), which costs time growing with the store.
# The LIMIT keeps the planner from flattening the lookup into such a join.
_ATTEMPT_OF_KEY = (
    "LATERAL (SELECT a.aid, a.rollout_id, a.attempt_id, a.status, a.start_time, r.timeout_seconds, "
    "r.heartbeat_timeout_seconds FROM agl_attempts a JOIN agl_rollouts r ON r.rollout_id = a.rollout_id "
    "WHERE a.rollout_id = q.rollout_id AND a.attempt_id = q.attempt_id LIMIT 1)"
)

SPAN_ATTEMPTS = (
    "SELECT a.rollout_id, a.attempt_id, a.aid, a.status, a.start_time, a.timeout_seconds, "
    "a.heartbeat_timeout_seconds FROM unnest(%s::text[], %s::text[]) AS q(rollout_id, attempt_id), "
    f"{_ATTEMPT_OF_KEY} a"
)

# A small batch of spans in one statement (one round trip, committed on its own; COPY_SPANS takes more
# round trips but is faster for big batches): the spans come as one JSON array of ``pg_row`` rows (the payload
# in base64), without
# repeats (a JSON text is ~50 times cheaper to build than psycopg's text arrays, which escape every element
# with a regular expression); they are stored only if every (rollout_id, attempt_id) of the batch is known
# (``n_keys`` pairs); stored ones are skipped; each running attempt named gets a heartbeat (its deadline per
# ``_rules.attempt_deadline``: ``least`` skips NULLs as the rule skips absent bounds). Returns whether all
# were known and how many spans were stored.
ADD_SPANS = (
    "WITH v AS (SELECT e->>0 AS rollout_id, e->>1 AS attempt_id, e->>2 AS span_id, (e->>3)::bigint AS sequence_id, "
    "e->>4 AS trace_id, e->>5 AS parent_id, e->>6 AS name, e->>7 AS kind, (e->>8)::bigint AS start_time, "
    "(e->>9)::bigint AS end_time, e->>10 AS status, e->>11 AS error, e->>12 AS attributes, e->>13 AS events, "
    "decode(e->>14, 'base64') AS payload, k "
    "FROM jsonb_array_elements(%(spans)s::jsonb) WITH ORDINALITY AS j(e, k)), "
    f"k AS (SELECT a.* FROM (SELECT DISTINCT rollout_id, attempt_id FROM v) q, {_ATTEMPT_OF_KEY} a), "
    "ok AS (SELECT count(*) = %(n_keys)s AS known FROM k), "
    f"ins AS (INSERT INTO agl_spans ({SPAN_COLUMNS}) SELECT k.aid, v.rollout_id, v.attempt_id, v.span_id, "
    "v.sequence_id, v.trace_id, v.parent_id, v.name, v.kind, v.start_time, v.end_time, v.status, v.error, "
    "v.attributes, v.events, v.payload FROM v JOIN k ON k.rollout_id = v.rollout_id AND k.attempt_id = v.attempt_id "
    "WHERE (SELECT known FROM ok) ORDER BY v.k ON CONFLICT (aid, span_id) DO NOTHING RETURNING 1), "
    "hb AS (UPDATE agl_attempts a SET last_heartbeat = %(now)s, "
    "deadline = least(k.start_time + k.timeout_seconds, %(now)s + k.heartbeat_timeout_seconds) FROM k "
    "WHERE a.aid = k.aid AND k.status = 'running' AND a.status = 'running' AND (SELECT known FROM ok)) "
    "SELECT (SELECT known FROM ok), (SELECT count(*) FROM ins)"
)

__all__ = [
    "ADD_SPANS",
    "ATTEMPT_COLS",
    "claim_statement",
    "START",
    "COMPLETE",
    "COPY_SPANS",
    "DONE_CHANNEL",
    "END_ATTEMPT",
    "EXPIRED",
    "HEARTBEAT",
    "HEARTBEATS",
    "INSERT_ROLLOUT",
    "INSERT_SPANS",
    "LIVE_ATTEMPT",
    "NEXT_DEADLINE",
    "QUEUE_CHANNEL",
    "RESET",
    "ROLLOUT_COLS",
    "SCHEMA",
    "SCHEMA_LOCK_KEY",
    "SCHEMA_VERSION",
    "SELECT_ROLLOUTS",
    "SPAN_ATTEMPTS",
    "SPAN_COLS",
    "PG_SPAN_COLS",
    "MIGRATIONS",
]
