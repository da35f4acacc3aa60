"""The SQL steps that the SQLite and PostgreSQL stores share, written once for both.

Both stores keep the same tables with the same columns (PostgreSQL's prefixed ``agl_``) and read them back with
the same row conversions (:mod:`agl.store.sqlite.schema`); what differs is spelled by a :class:`Dialect`, so a
filter, an ordering or an error cannot drift between the two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

from pydantic_core import from_json

from agl.errors import DuplicateResourcesError, UnknownAttemptError, UnknownResourcesError, UnknownRolloutError
from agl.store import _rules
from agl.store._rules import AttemptEnd
from agl.store.base import EnqueueRequest, RolloutQuery
from agl.store.prefixes import spans_with_prefixes
from agl.store.sqlite.schema import SPAN_COLS, json_list, rollout_from_row
from agl.types import ResourcesUpdate, Rollout, Span, new_id, parse_resources


@dataclasses.dataclass(frozen=True)
class ParamStyle:
    """How a database driver takes parameters (DB-API's ``paramstyle``), and the SQL that depends on it."""

    #: The parameter placeholder.
    param: str
    #: An always-true condition, to start a list of filters.
    true: str
    #: ``{column}`` is in the list given as one parameter (see :attr:`list_param`).
    any_of: str
    #: The one parameter holding a list of values.
    list_param: Callable[[Sequence[str]], Any]
    #: LIMIT's parameter for "no limit".
    no_limit: Any


#: sqlite3: ``?``; a list is one JSON text unpacked with ``json_each``; LIMIT -1 is no limit.
QMARK = ParamStyle("?", "1", "{column} IN (SELECT value FROM json_each(?))", json_list, -1)
#: psycopg: ``%s``; a list is an array; LIMIT NULL is no limit.
FORMAT = ParamStyle("%s", "TRUE", "{column} = ANY(%s)", list, None)


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one store's database spells what the shared statements need: its parameters and its schema."""

    style: ParamStyle
    #: What every table name starts with.
    prefix: str
    #: The schema's ``SELECT_ROLLOUTS``: a rollout with its latest attempt.
    select_rollouts: str
    #: The spans' column that orders spans of equal sequence id as they arrived.
    arrival: str
    #: The expression of a queue position behind every queued rollout.
    next_queue_pos: str
    #: What a span is read as: ``SPAN_COLS``, or the schema's own expressions for its columns.
    span_cols: str = SPAN_COLS

    @property
    def param(self) -> str:
        """The parameter placeholder of :attr:`style`."""
        return self.style.param


def new_rollout_rows(requests: Sequence[EnqueueRequest], now: float) -> List[Tuple[Any, ...]]:
    """Each request's row as both stores insert it (ids the caller left to the store picked here, input and metadata
    as JSON text): ``rollout_id, task_id, input, mode, resources_id, max_attempts, timeout_seconds,
    heartbeat_timeout_seconds, metadata, create_time``."""
    return [
        (
            request.rollout_id or new_id("ro"),
            request.task_id or new_id("task"),
            _rules.encode_json(request.input, "rollout input"),
            request.mode,
            request.resources_id,
            request.config.max_attempts,
            request.config.timeout_seconds,
            request.config.heartbeat_timeout_seconds,
            _rules.encode_json(request.metadata, "rollout metadata"),
            now,
        )
        for request in requests
    ]


def queued_rollout(row: Tuple[Any, ...]) -> Rollout:
    """The rollout a :func:`new_rollout_rows` row makes once stored, as a read would give it back (without the read):
    queued, no attempt yet."""
    return rollout_from_row(row[:4] + ("queued",) + row[4:9] + (0, None, None, row[9], None, None, None, None))


def select_rollout(d: Dialect, c: Any, rollout_id: str) -> Rollout:
    """The rollout with its latest attempt, read on the connection ``c``; UnknownRolloutError if there is none."""
    row = c.execute(f"{d.select_rollouts} WHERE r.rollout_id = {d.param}", (rollout_id,)).fetchone()
    if row is None:
        raise UnknownRolloutError(rollout_id)
    return rollout_from_row(row)


def rollout_assignments(d: Dialect, end: AttemptEnd) -> str:
    """The SET clause that moves a rollout on as ``end`` says (to the back of the queue when it is requeued); its
    parameters are ``end.rollout``'s values."""
    assignments = ", ".join(f"{column} = {d.param}" for column in end.rollout)
    return assignments + (f", queue_pos = {d.next_queue_pos}" if end.requeued else "")


def cancellable(d: Dialect, c: Any, rollout_id: str, lock: str = "") -> Tuple[str, Optional[int]]:
    """The status and latest attempt (aid) of a rollout ``cancel_rollout`` may change, read with ``lock`` after
    the statement; UnknownRolloutError, or for a finished rollout the IllegalTransitionError of every backend."""
    sql = f"SELECT status, latest_aid FROM {d.prefix}rollouts WHERE rollout_id = {d.param}{lock}"
    row = c.execute(sql, (rollout_id,)).fetchone()
    if row is None:
        raise UnknownRolloutError(rollout_id)
    status, aid = row
    if status not in ("queued", "running", "cancelled"):
        raise _rules.cancel_error(rollout_id, status)
    return status, aid


def query_rollouts_sql(d: Dialect, query: RolloutQuery) -> Tuple[str, List[Any]]:
    """The statement and parameters of ``query_rollouts``: its filters, in enqueue order, limited."""
    style = d.style
    where: List[str] = [style.true]
    params: List[Any] = []
    if query.status is not None:
        where.append(style.any_of.format(column="r.status"))
        params.append(style.list_param(query.status))
    if query.rollout_ids is not None:
        where.append(style.any_of.format(column="r.rollout_id"))
        params.append(style.list_param(query.rollout_ids))
    for column, value in (("task_id", query.task_id), ("mode", query.mode)):
        if value is not None:
            where.append(f"r.{column} = {d.param}")
            params.append(value)
    sql = f"{d.select_rollouts} WHERE {' AND '.join(where)} ORDER BY r.seq LIMIT {d.param} OFFSET {d.param}"
    return sql, params + [style.no_limit if query.limit is None else query.limit, query.offset]


def query_spans(d: Dialect, c: Any, rollout_id: str, attempt_id: Optional[str]) -> List[Span]:
    """``query_spans`` on the connection ``c``: one query in the common case, and only when it finds nothing a
    look at whether the rollout (and attempt) exist, raising UnknownRolloutError or UnknownAttemptError."""
    spans, attempts, p, by_arrival = f"{d.prefix}spans", f"{d.prefix}attempts", d.param, f"s.sequence_id, {d.arrival}"
    if attempt_id == "latest":
        sql = (
            f"SELECT {d.span_cols} FROM {spans} s "
            f"WHERE s.aid = (SELECT latest_aid FROM {d.prefix}rollouts WHERE rollout_id = {p}) ORDER BY {by_arrival}"
        )
        rows = c.execute(sql, (rollout_id,)).fetchall()
    elif attempt_id is None:
        sql = (
            f"SELECT {d.span_cols} FROM {attempts} a JOIN {spans} s ON s.aid = a.aid "
            f"WHERE a.rollout_id = {p} ORDER BY a.sequence, {by_arrival}"
        )
        rows = c.execute(sql, (rollout_id,)).fetchall()
    else:
        sql = (
            f"SELECT {d.span_cols} FROM {attempts} a JOIN {spans} s ON s.aid = a.aid "
            f"WHERE a.rollout_id = {p} AND a.attempt_id = {p} ORDER BY {by_arrival}"
        )
        rows = c.execute(sql, (rollout_id, attempt_id)).fetchall()
    if not rows:  # only now find out whether the ids exist, to keep the common path one query
        select_rollout(d, c, rollout_id)
        if attempt_id not in ("latest", None):
            sql = f"SELECT 1 FROM {attempts} WHERE rollout_id = {p} AND attempt_id = {p}"
            if c.execute(sql, (rollout_id, attempt_id)).fetchone() is None:
                raise UnknownAttemptError(rollout_id, attempt_id)
    return spans_with_prefixes(rows)


def insert_resources(d: Dialect, c: Any, resources_id: Optional[str], encoded: str, now: float) -> Tuple[str, int]:
    """Store a new resources version (the next number) in the open write transaction ``c``; returns its id (new
    unless ``resources_id`` is given, which must not be stored yet: DuplicateResourcesError) and version."""
    table = f"{d.prefix}resources"
    if resources_id is not None:
        if c.execute(f"SELECT 1 FROM {table} WHERE resources_id = {d.param}", (resources_id,)).fetchone():
            raise DuplicateResourcesError(resources_id)
    else:
        resources_id = new_id("res")
    version = c.execute(f"SELECT coalesce(max(version), 0) + 1 FROM {table}").fetchone()[0]
    p = d.param
    c.execute(f"INSERT INTO {table} VALUES ({p}, {p}, {p}, {p})", (version, resources_id, encoded, now))
    return resources_id, version


def resources_query(d: Dialect, resources_id: Optional[str]) -> Tuple[str, Tuple[Any, ...]]:
    """``get_resources``'s statement and parameters: the version ``resources_id``, or the latest if None."""
    if resources_id is None:
        return f"SELECT * FROM {d.prefix}resources ORDER BY version DESC LIMIT 1", ()
    return f"SELECT * FROM {d.prefix}resources WHERE resources_id = {d.param}", (resources_id,)


def resources_update(row: Optional[Sequence[Any]], resources_id: Optional[str]) -> Optional[ResourcesUpdate]:
    """``get_resources``'s answer from :func:`resources_query`'s row: None if there is no version yet, or
    UnknownResourcesError if the one asked for is not stored."""
    if row is None:
        if resources_id is not None:
            raise UnknownResourcesError(resources_id)
        return None
    return resources_from_row(row)


def resources_from_row(row: Sequence[Any]) -> ResourcesUpdate:
    """A resources version from its row (version, id, JSON text, create time), as stored or as read back."""
    version, rid, encoded, create_time = row
    return ResourcesUpdate(
        resources_id=rid, version=version, resources=parse_resources(from_json(encoded)), create_time=create_time
    )
