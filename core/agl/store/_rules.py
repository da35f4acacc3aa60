"""State-machine rules and error messages shared by every store backend, so the backends cannot drift.

Each backend keeps its own data layout; what a status change *means* (retry or fail, which error the
caller gets, when an attempt expires) is decided here once.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Set, Tuple

from pydantic_core import PydanticSerializationError, to_json

from agl.errors import DuplicateRolloutError, IllegalTransitionError, InvalidSpanError, StaleAttemptError
from agl.types import TERMINAL_ROLLOUT_STATUSES, Span, array_as_json

ROLLOUT_STATUSES: Tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")

#: The statuses a runner may end its attempt with (``cancelled`` goes through ``cancel_rollout``).
COMPLETE_STATUSES = frozenset({"succeeded", "failed", "timeout", "unresponsive"})


def check_completion(status: str, reward: Optional[float]) -> Optional[float]:
    """Reject a ``complete_attempt`` whose status does not end an attempt, or whose reward is not a finite
    number, before anything is touched (SQLite would keep a NaN as "no reward", JSON carries it as null).
    Returns the reward as every backend stores it: a float (``1`` and ``True`` become ``1.0``)."""
    if status == "cancelled":
        raise IllegalTransitionError(
            "complete_attempt cannot end an attempt as 'cancelled': call cancel_rollout(rollout_id) instead"
        )
    if status not in COMPLETE_STATUSES:
        raise IllegalTransitionError(
            f"complete_attempt needs a final status ({', '.join(sorted(COMPLETE_STATUSES))}), got {status!r}; "
            "report progress of a running attempt with heartbeat()"
        )
    if reward is not None and (not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        raise ValueError(
            f"complete_attempt got reward {reward!r} ({type(reward).__name__}): a reward must be a finite int or "
            "float, or None"
        )
    return None if reward is None else float(reward)


def encode_json(value: Any, what: str) -> str:
    """JSON text of a rollout's input or metadata; every backend stores these as JSON, so all refuse alike."""
    try:
        return to_json(value, fallback=array_as_json).decode()
    except PydanticSerializationError as exc:
        raise TypeError(
            f"{what} must be JSON-serialisable (dicts, lists, str, numbers, pydantic models): {exc}"
        ) from exc


def check_new_rollout_ids(requests: Sequence[Any], is_stored: Callable[[str], bool]) -> None:
    """Refuse a batch naming a caller-chosen rollout id twice, or one already stored (DuplicateRolloutError)."""
    seen: Set[str] = set()
    for request in requests:
        rollout_id = request.rollout_id
        if rollout_id is None:
            continue
        if rollout_id in seen or is_stored(rollout_id):
            raise DuplicateRolloutError(rollout_id)
        seen.add(rollout_id)


def encode_span(span: Any) -> bytes:
    """A span's JSON as every backend stores it (see :func:`storable_span`), or the InvalidSpanError every
    backend raises for a non-Span or an unserialisable value."""
    span = storable_span(span)
    try:
        return span.model_dump_json().encode()
    except PydanticSerializationError as exc:
        raise InvalidSpanError(
            f"span {span.span_id!r} ({span.name!r}) has a value that is not JSON-serialisable: {exc}; "
            "nothing of this batch was stored"
        ) from exc


def check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"dequeue limit must be at least 1, got {limit}")


def check_claim(runner_id: str, limit: int) -> None:
    """Refuse a dequeue whose limit is below 1 or whose runner id cannot be stored (see :func:`check_id`)."""
    check_limit(limit)
    check_id(runner_id, "runner_id")


# -- NUL characters ------------------------------------------------------------------------------------------
# PostgreSQL's text cannot hold NUL (\x00), and every backend must keep the same thing. Free text (an error
# message, a span name) may well contain one (an agent's exception quoting binary tool output): refusing it
# lost the real error and killed the runner, so it is kept with each NUL replaced. An id is matched exactly
# later, so a changed id would silently name nothing: it is refused instead. JSON values (inputs, metadata,
# span attributes and events, resources) are stored as JSON text, where NUL is the escape \u0000: they keep
# it exactly and are never scanned.

#: What a NUL character in free text becomes: U+FFFD, the replacement character, is one character (lengths and
#: offsets stay as they were), is what decoders put for a character they cannot represent, and cannot be mistaken
#: for text that was there (a visible "\x00" is what a repr of bytes already holds).
NUL_REPLACEMENT = "\ufffd"


def free_text(text: Optional[str]) -> Optional[str]:
    """``text`` with each NUL character replaced by :data:`NUL_REPLACEMENT` (one scan when it has none)."""
    if text is None or "\x00" not in text:
        return text
    return text.replace("\x00", NUL_REPLACEMENT)


def check_id(value: Optional[str], what: str) -> None:
    """Refuse (ValueError) an id holding a NUL character, on every backend alike."""
    if value is not None and "\x00" in value:
        raise ValueError(f"{what} {value!r} contains a NUL character (\\x00), which no store keeps in an id")


def check_request_ids(requests: Sequence[Any]) -> None:
    """:func:`check_id` for the ids an ``EnqueueRequest`` names (its own pattern already refuses a ``rollout_id``
    with a NUL)."""
    for request in requests:
        check_id(request.task_id, "task_id")
        check_id(request.resources_id, "resources_id")


_SPAN_IDS = ("rollout_id", "attempt_id", "trace_id", "span_id", "parent_id")


def storable_span(span: Any) -> Span:
    """``span`` as every backend stores it: a NUL in its name or error replaced (a copy is made only then); an
    id with a NUL, or a non-Span, is refused with InvalidSpanError (nothing of its batch is stored)."""
    if not isinstance(span, Span):
        raise InvalidSpanError(f"add_spans takes agl.types.Span objects, got {type(span).__name__}")
    if not (  # the hot path: a few short scans, no copy (an f-string joining them took twice as long)
        "\x00" in span.name or "\x00" in span.span_id or "\x00" in span.trace_id
        or "\x00" in span.rollout_id or "\x00" in span.attempt_id
        or (span.parent_id is not None and "\x00" in span.parent_id)
        or (span.error is not None and "\x00" in span.error)
    ):
        return span
    for what in _SPAN_IDS:
        if "\x00" in (getattr(span, what) or ""):
            raise InvalidSpanError(
                f"span {span.span_id!r} has a NUL character (\\x00) in its {what}, which no store keeps in an id; "
                "nothing of this batch was stored"
            )
    return span.model_copy(update={"name": free_text(span.name), "error": free_text(span.error)})


def next_rollout_status(attempt_status: str, n_attempts: int, max_attempts: int) -> str:
    """Where a running rollout goes when its live attempt ends with ``attempt_status``.

    Success ends the rollout; any other ending requeues it while attempts are left (``max_attempts``
    counts the first attempt too), else the rollout fails.
    """
    if attempt_status == "succeeded":
        return "succeeded"
    return "queued" if n_attempts < max_attempts else "failed"


#: A span batch refreshes its running attempt's heartbeat only when the stored one is at least this old, or a
#: tenth of the heartbeat timeout if that is shorter (see :func:`span_heartbeat_due`).
SPAN_HEARTBEAT_RESOLUTION = 1.0


def span_heartbeat_due(last_heartbeat: float, now: float, heartbeat_timeout_seconds: Optional[float]) -> bool:
    """Whether a span batch arriving ``now`` should rewrite its attempt's heartbeat.

    Spans count as heartbeats, but rewriting the attempt on every batch costs the SQLite store a page write
    per batch (about 7% of a rollout cycle); a heartbeat is a liveness signal, so a resolution of a second,
    or of a tenth of the heartbeat timeout, is enough: an attempt sending spans is never reaped before 90% of
    its heartbeat timeout has passed without any.
    """
    resolution = SPAN_HEARTBEAT_RESOLUTION
    if heartbeat_timeout_seconds is not None:
        resolution = min(resolution, heartbeat_timeout_seconds / 10)
    return now - last_heartbeat >= resolution


def attempt_deadline(
    start_time: float,
    last_heartbeat: float,
    timeout_seconds: Optional[float],
    heartbeat_timeout_seconds: Optional[float],
) -> Optional[float]:
    """The wall-clock time at which a running attempt expires (None: it never does)."""
    bounds = []
    if timeout_seconds is not None:
        bounds.append(start_time + timeout_seconds)
    if heartbeat_timeout_seconds is not None:
        bounds.append(last_heartbeat + heartbeat_timeout_seconds)
    return min(bounds) if bounds else None


def expiry(
    start_time: float,
    now: float,
    timeout_seconds: Optional[float],
    heartbeat_timeout_seconds: Optional[float],
) -> Tuple[str, str]:
    """Status and error of an attempt found past its deadline: a wall-time timeout wins over silence."""
    if timeout_seconds is not None and now >= start_time + timeout_seconds:
        return "timeout", f"attempt ran past timeout_seconds={timeout_seconds} and was ended by the store"
    return "unresponsive", (
        f"no heartbeat or span for heartbeat_timeout_seconds={heartbeat_timeout_seconds}: the runner is presumed "
        "dead and the attempt was ended by the store"
    )


def stale_error(rollout_id: str, attempt_id: str, attempt_status: str, rollout_status: str) -> StaleAttemptError:
    return StaleAttemptError(
        f"attempt {attempt_id!r} of rollout {rollout_id!r} already ended as {attempt_status!r} (the rollout is now "
        f"{rollout_status!r}), so this update was ignored: stop working on it and dequeue new work"
    )


def cancel_error(rollout_id: str, status: str) -> IllegalTransitionError:
    return IllegalTransitionError(
        f"rollout {rollout_id!r} is already {status!r}; only queued or running rollouts can be cancelled"
    )


def check_spans_deletable(rollout_id: str, status: str) -> None:
    """``delete_spans`` takes finished rollouts only: a live one may still be writing its spans."""
    if status not in TERMINAL_ROLLOUT_STATUSES:
        raise IllegalTransitionError(
            f"cannot delete the spans of rollout {rollout_id!r}: it is {status}, and its spans may still be "
            "written or read by its runner; delete spans of finished rollouts only (succeeded, failed, cancelled)"
        )
