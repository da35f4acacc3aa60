"""State-machine rules and error messages shared by every store backend, so the backends cannot drift.

Each backend keeps its own data layout; what a status change *means* (retry or fail, which error the
caller gets, when an attempt expires) is decided here once.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, to_json

from agl.checks import is_finite_number
from agl.errors import DuplicateRolloutError, IllegalTransitionError, InvalidSpanError, StaleAttemptError
from agl.types import TERMINAL_ROLLOUT_STATUSES, Span, array_as_json, parse_resources

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
    if reward is not None and not (isinstance(reward, bool) or is_finite_number(reward)):
        raise ValueError(
            f"complete_attempt got reward {reward!r} ({type(reward).__name__}): a reward must be a finite int or "
            "float, or None"
        )
    return None if reward is None else float(reward)


def encode_json(value: Any, what: str) -> str:
    """JSON text of a rollout's input or metadata; every backend stores these as JSON, so all refuse alike."""
    try:
        return json_bytes(value, fallback=array_as_json).decode()
    except PydanticSerializationError as exc:
        raise TypeError(
            f"{what} must be JSON-serialisable (dicts, lists, str, numbers, pydantic models): {exc}"
        ) from exc


def encode_resources(resources: Dict[str, Any], resources_id: Optional[str]) -> str:
    """The JSON text of a resources version as every backend stores it, once ``resources_id`` is known to be one a
    store keeps (:func:`check_id`) and ``resources`` parse."""
    check_id(resources_id, "resources_id")
    return encode_json(parse_resources(dict(resources)), "resources")


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


def check_limit(limit: int) -> None:
    if limit < 1:
        raise ValueError(f"dequeue limit must be at least 1, got {limit}")


def check_claim(runner_id: str, limit: int) -> None:
    """Refuse a dequeue whose limit is below 1 or whose runner id cannot be stored (see :func:`check_id`)."""
    check_limit(limit)
    check_id(runner_id, "runner_id")


# -- NUL characters and lone surrogates -------------------------------------------------------------------------
# PostgreSQL's text cannot hold NUL (\x00), nothing encoded as UTF-8 can hold a lone UTF-16 surrogate (U+D800 to
# U+DFFF, which a Python str can: "\ud83d" from an emoji a model's reply cut in half, decoded by json.loads), and
# every backend must keep the same thing. Free text (an error message, a span name) may well contain either (an
# agent's exception quoting binary tool output or a cut-off model reply): refusing it lost the real error and killed
# the runner, so it is kept with each NUL and lone surrogate replaced. An id is matched exactly later, so a changed
# id would silently name nothing: it is refused instead. JSON values (inputs, metadata, span attributes and events,
# resources) are stored as JSON text, where NUL is the escape \u0000: they keep it exactly and are never scanned; a
# lone surrogate cannot be written as JSON, so only a value that fails to encode for that reason is copied with its
# surrogates replaced (free text's rule, applied to its strings and keys).

#: What a NUL character or a lone surrogate in free text becomes: U+FFFD, the replacement character, is one
#: character (lengths and offsets stay as they were), is what decoders put for a character they cannot represent,
#: and cannot be mistaken for text that was there (a visible "\x00" is what a repr of bytes already holds).
NUL_REPLACEMENT = "\ufffd"

_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None  # isascii is O(1): ASCII text is not scanned


def _without_surrogates(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD; a high surrogate followed by a low one (UTF-16 text
    decoded unit by unit) becomes the character the pair encodes."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def free_text(text: Optional[str]) -> Optional[str]:
    """``text`` with each NUL character and lone surrogate replaced by :data:`NUL_REPLACEMENT` (the same object,
    after one scan, when it has none)."""
    if text is None:
        return text
    if "\x00" in text:
        text = text.replace("\x00", NUL_REPLACEMENT)
    if _has_surrogate(text):
        text = _without_surrogates(text)
    return text


def json_value(value: Any) -> Any:
    """``value`` with free text's surrogate rule applied to every string in it (dict keys too, pydantic models and
    dataclasses field by field): for a JSON value that failed to encode because of a lone surrogate."""
    if isinstance(value, str):
        return _without_surrogates(value) if _has_surrogate(value) else value
    if isinstance(value, dict):
        return {json_value(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [json_value(v) for v in value]
    if isinstance(value, BaseModel):
        return value.model_copy(update={name: json_value(getattr(value, name)) for name in type(value).model_fields})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_value(dataclasses.asdict(value))
    return value


def is_surrogate_error(exc: BaseException) -> bool:
    """Whether a JSON encoding failed on a lone surrogate (pydantic wraps the UnicodeEncodeError in its message)."""
    return "surrogates not allowed" in str(exc)


def json_bytes(value: Any, fallback: Optional[Callable[[Any], Any]] = None) -> bytes:
    """``to_json(value)``; a value holding a lone surrogate is encoded with it replaced (see :func:`json_value`)."""
    try:
        return to_json(value, fallback=fallback)
    except PydanticSerializationError as exc:
        if not is_surrogate_error(exc):
            raise
    return to_json(json_value(value), fallback=fallback)


def _id_problem(value: str) -> Optional[str]:
    if "\x00" in value:
        return "a NUL character (\\x00)"
    found = _SURROGATE.search(value) if not value.isascii() else None
    if found is not None:
        return f"a lone surrogate ({ascii(found.group())[1:-1]}, half of a UTF-16 pair)"
    return None


def check_id(value: Optional[str], what: str) -> None:
    """Refuse (ValueError) an id holding a NUL character or a lone surrogate, on every backend alike."""
    problem = None if value is None else _id_problem(value)
    if problem is not None:
        raise ValueError(f"{what} {value!r} contains {problem}, which no store keeps in an id")


def check_request_ids(requests: Sequence[Any]) -> None:
    """:func:`check_id` for the ids an ``EnqueueRequest`` names (its own pattern already refuses a ``rollout_id``
    that is not plain ASCII)."""
    for request in requests:
        check_id(request.task_id, "task_id")
        check_id(request.resources_id, "resources_id")


_SPAN_IDS = ("rollout_id", "attempt_id", "trace_id", "span_id", "parent_id")
_INT64_MIN, _INT64_END = -(2**63), 2**63  # what every backend keeps in an integer column (SQLite, bigint)


def storable_span(span: Any) -> Span:
    """``span`` as every backend stores it: a NUL or lone surrogate in its name or error replaced (a copy is made
    only then); an id with either, an integer field beyond 64 bits, or a non-Span, is refused with
    InvalidSpanError (nothing of its batch is stored)."""
    if not isinstance(span, Span):
        raise InvalidSpanError(f"add_spans takes agl.types.Span objects, got {type(span).__name__}")
    if not (  # the hot path: a few short scans, no copy (an f-string joining them took twice as long)
        "\x00" in span.name
        or "\x00" in span.span_id
        or "\x00" in span.trace_id
        or "\x00" in span.rollout_id
        or "\x00" in span.attempt_id
        or not (
            span.name.isascii()
            and span.span_id.isascii()
            and span.trace_id.isascii()
            and span.rollout_id.isascii()
            and span.attempt_id.isascii()
        )
        or (span.parent_id is not None and ("\x00" in span.parent_id or not span.parent_id.isascii()))
        or (span.error is not None and ("\x00" in span.error or not span.error.isascii()))
        or not (
            _INT64_MIN <= span.start_time < _INT64_END
            and _INT64_MIN <= span.end_time < _INT64_END
            and span.sequence_id < _INT64_END
        )
    ):
        return span
    for what in _SPAN_IDS:
        value = getattr(span, what)
        problem = None if value is None else _id_problem(value)
        if problem is not None:
            raise InvalidSpanError(
                f"span {span.span_id!r} has {problem} in its {what}, which no store keeps in an id; "
                "nothing of this batch was stored"
            )
    for what in ("sequence_id", "start_time", "end_time"):
        number = getattr(span, what)
        if not _INT64_MIN <= number < _INT64_END:
            raise InvalidSpanError(
                f"span {span.span_id!r} ({free_text(span.name)!r}) has {what}={number}, beyond the 64-bit integers "
                f"every store keeps ({_INT64_MIN} to {_INT64_END - 1}); nothing of this batch was stored"
            )
    name, error = free_text(span.name), free_text(span.error)
    if name is span.name and error is span.error:
        return span
    return span.model_copy(update={"name": name, "error": error})


def next_rollout_status(attempt_status: str, n_attempts: int, max_attempts: int) -> str:
    """Where a running rollout goes when its live attempt ends with ``attempt_status``.

    Success ends the rollout; any other ending requeues it while attempts are left (``max_attempts``
    counts the first attempt too), else the rollout fails.
    """
    if attempt_status == "succeeded":
        return "succeeded"
    return "queued" if n_attempts < max_attempts else "failed"


@dataclasses.dataclass(frozen=True)
class AttemptEnd:
    """How a live attempt ends and what that does to its rollout (see :func:`end_attempt`): decided here once, so
    that every backend stores the same outcome."""

    #: The attempt's final status, its end time and its error.
    status: str
    end_time: float
    error: Optional[str]
    #: The rollout's fields that change, with their new values; ``status`` (where the rollout goes) first.
    rollout: Dict[str, Any]

    @property
    def requeued(self) -> bool:
        """Whether the rollout goes back to the end of the queue (attempts are left)."""
        return bool(self.rollout["status"] == "queued")


def end_attempt(
    status: str, error: Optional[str], reward: Optional[float], n_attempts: int, max_attempts: int, now: float
) -> AttemptEnd:
    """Ending a rollout's live attempt (its ``n_attempts``-th) ``now`` with ``status``: the rollout succeeds (keeping
    ``reward``), is requeued, or fails, per :func:`next_rollout_status`; ``error`` goes to both."""
    nxt = next_rollout_status(status, n_attempts, max_attempts)
    if nxt == "succeeded":
        changes: Dict[str, Any] = {"status": nxt, "final_reward": reward, "error": None, "end_time": now}
    elif nxt == "queued":
        changes = {"status": nxt, "error": error}
    else:
        changes = {"status": nxt, "error": error, "end_time": now}
    return AttemptEnd(status, now, error, changes)


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
