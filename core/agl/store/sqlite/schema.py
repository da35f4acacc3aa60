"""The SQLite store's schema and the conversions between its rows and agl's models.

Layout choices, for write speed (every state change is one commit, and a commit writes each B-tree page
it touched to the WAL):
- ``attempts`` and ``spans`` hang off integer keys that grow with time (``attempts.aid``, the rowids), so
  the pages that updates touch are the few recent ones, not pages picked at random by uuid-like ids.
  The public ids stay unique through their own indexes, which are written on insert only.
- ``rollouts`` has no index on ``status``: a status change would rewrite it on every transition, while
  listing by status is rare and scans fine. The queue is a partial index over queued rollouts only.
- ``spans`` keeps its rollout and attempt ids as text next to ``aid`` so rows read on their own with the
  ``sqlite3`` shell.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from pydantic_core import PydanticSerializationError, from_json, to_json

from agl.errors import InvalidSpanError
from agl.store import _rules
from agl.store.span_codec import PrefixRef, decode_attributes, encode_attributes
from agl.types import Attempt, Rollout, RolloutConfig, Span, SpanEvent, trusted

SCHEMA_VERSION = 1

# rollouts.queue_pos: set while queued; FIFO order (a requeued rollout goes to the back).
# rollouts.latest_aid: the rollout's latest attempt. attempts.deadline: when reap_expired ends a running one.
SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    input TEXT NOT NULL,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    resources_id TEXT,
    max_attempts INTEGER NOT NULL,
    timeout_seconds REAL,
    heartbeat_timeout_seconds REAL,
    metadata TEXT NOT NULL,
    n_attempts INTEGER NOT NULL DEFAULT 0,
    final_reward REAL,
    error TEXT,
    create_time REAL NOT NULL,
    start_time REAL,
    end_time REAL,
    queue_pos INTEGER,
    latest_aid INTEGER
);
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts (queue_pos) WHERE queue_pos IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_task ON rollouts (task_id);
CREATE TABLE IF NOT EXISTS attempts (
    aid INTEGER PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    runner_id TEXT,
    status TEXT NOT NULL,
    start_time REAL NOT NULL,
    end_time REAL,
    last_heartbeat REAL NOT NULL,
    error TEXT,
    deadline REAL,
    UNIQUE (rollout_id, attempt_id)
);
CREATE INDEX IF NOT EXISTS attempts_deadline ON attempts (deadline) WHERE status = 'running' AND deadline IS NOT NULL;
CREATE TABLE IF NOT EXISTS spans (
    aid INTEGER NOT NULL,
    span_id TEXT NOT NULL,
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    sequence_id INTEGER NOT NULL,
    trace_id TEXT NOT NULL,
    parent_id TEXT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    start_time INTEGER NOT NULL,
    end_time INTEGER NOT NULL,
    status TEXT NOT NULL,
    error TEXT,
    attributes TEXT NOT NULL,
    events TEXT NOT NULL,
    UNIQUE (aid, span_id)
);
CREATE TABLE IF NOT EXISTS resources (
    version INTEGER PRIMARY KEY,
    resources_id TEXT NOT NULL UNIQUE,
    resources TEXT NOT NULL,
    create_time REAL NOT NULL
);
"""

ROLLOUT_COLS = (
    "r.rollout_id, r.task_id, r.input, r.mode, r.status, r.resources_id, r.max_attempts, r.timeout_seconds, "
    "r.heartbeat_timeout_seconds, r.metadata, r.n_attempts, r.final_reward, r.error, r.create_time, "
    "r.start_time, r.end_time"
)
ATTEMPT_COLS = (
    "a.rollout_id, a.attempt_id, a.sequence, a.runner_id, a.status, a.start_time, a.end_time, a.last_heartbeat, a.error"
)
SELECT_ROLLOUTS = f"SELECT {ROLLOUT_COLS}, {ATTEMPT_COLS} FROM rollouts r LEFT JOIN attempts a ON a.aid = r.latest_aid"
# In INSERT_SPAN's order, so that a row as inserted (span_to_row) reads back as one selected (span_from_row).
SPAN_COLS = (
    "s.rollout_id, s.attempt_id, s.span_id, s.sequence_id, s.trace_id, s.parent_id, s.name, s.kind, "
    "s.start_time, s.end_time, s.status, s.error, s.attributes, s.events"
)
#: The Span field of each of ``SPAN_COLS``, in order (``s.rollout_id`` holds ``rollout_id``).
_SPAN_FIELDS = tuple(column.strip()[2:] for column in SPAN_COLS.split(","))
INSERT_SPAN = (
    "INSERT OR IGNORE INTO spans (aid, rollout_id, attempt_id, span_id, sequence_id, trace_id, parent_id, name, "
    "kind, start_time, end_time, status, error, attributes, events) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
#: A span as ``span_to_row`` gives it: ``INSERT_SPAN``'s parameters after ``aid``, in ``SPAN_COLS``'s order.
Row = Tuple[Any, ...]
SPAN_PARAMS = 15  # parameters per row of INSERT_SPAN
# Rows per multi-row INSERT: within SQLite's oldest parameter limit (999). One statement per chunk instead of
# one per row matters: Python's sqlite3 releases the GIL around every statement step, and in a process
# whose agent thread is busy each release can cost the writing thread a 5 ms wait to get the GIL back.
SPAN_ROWS_PER_INSERT = 999 // SPAN_PARAMS


def insert_spans_sql(n_rows: int) -> str:
    """``INSERT_SPAN`` for ``n_rows`` rows at once (parameters row after row)."""
    return INSERT_SPAN + ", (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)" * (n_rows - 1)


NEXT_QUEUE_POS = "(SELECT coalesce(max(queue_pos), 0) + 1 FROM rollouts WHERE queue_pos IS NOT NULL)"


def attempt_from_row(row: Sequence[Any]) -> Attempt:
    """An ``ATTEMPT_COLS`` row (the store's own, so built without validation; see ``agl.types.trusted``)."""
    return trusted(
        Attempt,
        {
            "rollout_id": row[0],
            "attempt_id": row[1],
            "sequence": row[2],
            "runner_id": row[3],
            "status": row[4],
            "start_time": row[5],
            "end_time": row[6],
            "last_heartbeat": row[7],
            "error": row[8],
        },
    )


def rollout_from_row(row: Sequence[Any]) -> Rollout:
    """A ``SELECT_ROLLOUTS`` row: rollout columns, then the latest attempt's (NULLs if never dequeued)."""
    config = {"max_attempts": row[6], "timeout_seconds": row[7], "heartbeat_timeout_seconds": row[8]}
    return trusted(
        Rollout,
        {
            "rollout_id": row[0],
            "task_id": row[1],
            "input": from_json(row[2]),
            "mode": row[3],
            "status": row[4],
            "resources_id": row[5],
            "config": trusted(RolloutConfig, config),
            "metadata": from_json(row[9]),
            "n_attempts": row[10],
            "final_reward": row[11],
            "error": row[12],
            "create_time": row[13],
            "start_time": row[14],
            "end_time": row[15],
            "attempt": None if row[17] is None else attempt_from_row(row[16:]),
        },
    )


def span_to_row(span: Span, prefix: Optional[Tuple[str, int]] = None) -> Row:
    """``INSERT_SPAN`` parameters without the leading ``aid`` (known only inside the transaction); the attributes in
    their compact form (:mod:`agl.store.span_codec`, with ``prefix`` as it says), which every backend stores."""
    if not isinstance(span, Span):
        raise InvalidSpanError(f"add_spans takes agl.types.Span objects, got {type(span).__name__}")
    try:
        attributes = encode_attributes(span.attributes, prefix)
        events = _rules.json_bytes(span.events).decode() if span.events else "[]"
    except PydanticSerializationError as exc:
        raise InvalidSpanError(
            f"span {span.span_id!r} ({span.name!r}) has a value that is not JSON-serialisable: {exc}; "
            "nothing of this batch was stored"
        ) from exc
    return (
        span.rollout_id,
        span.attempt_id,
        span.span_id,
        span.sequence_id,
        span.trace_id,
        span.parent_id,
        span.name,
        span.kind,
        span.start_time,
        span.end_time,
        span.status,
        span.error,
        attributes,
        events,
    )


def storable_row(span: Any, prefix: Optional[Tuple[str, int]] = None) -> Row:
    """``span_to_row`` of ``span`` as every backend stores it (``_rules.storable_span``), or its InvalidSpanError."""
    return span_to_row(_rules.storable_span(span), prefix)


def span_fields(row: Sequence[Any], refs: Optional[List[PrefixRef]] = None) -> Dict[str, Any]:
    """A ``SPAN_COLS`` row as a Span's fields, events as plain dicts. Its attributes are compact or, in rows an
    older agl wrote, JSON text; both read the same. A prompt stored as a reference goes to ``refs``
    (:func:`agl.store.prefixes.spans_with_prefixes` resolves them); ValueError without ``refs``."""
    fields = dict(zip(_SPAN_FIELDS, row))
    fields["attributes"] = decode_attributes(fields["attributes"], refs)
    events = fields["events"]
    fields["events"] = [] if events == "[]" else from_json(events)  # most spans have none
    return fields


def span_from_row(row: Sequence[Any], refs: Optional[List[PrefixRef]] = None) -> Span:
    """A ``SPAN_COLS`` row (the store's own, so built without validation; see ``agl.types.trusted``)."""
    fields = span_fields(row, refs)
    fields["events"] = [trusted(SpanEvent, event) for event in fields["events"]]
    return trusted(Span, fields)


def json_list(values: Iterable[str]) -> str:
    """One SQL parameter holding any number of values, unpacked with ``json_each``."""
    return to_json(list(values)).decode()
