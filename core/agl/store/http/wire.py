"""The store server's wire format, shared by the server (agl.store.http.server) and its client (agl.store.http.client).

Request and response bodies are pydantic models, so the server validates them and FastAPI documents them
in the OpenAPI schema. Errors travel as ``{"error": <exception class>, "message": ..., <ids>}`` and the
client raises the same exception class the in-process store would have raised, with the same message.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

from pydantic import BaseModel, Field, model_validator

from agl.errors import (
    AglError,
    DuplicateResourcesError,
    DuplicateRolloutError,
    IllegalTransitionError,
    InvalidSpanError,
    StaleAttemptError,
    StoreAuthError,
    StoreClosedError,
    StoreRequestError,
    StoreUnavailableError,
    UnknownAttemptError,
    UnknownResourcesError,
    UnknownRolloutError,
)
from agl.store.base import EnqueueRequest
from agl.types import SPAN_JSON, Attempt, AttemptStatus, ResourcesUpdate, Rollout, RolloutMode, RolloutStatus, Span

#: Header of a client-chosen key that makes a retried request return the first one's answer.
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: Where the bearer token goes (OTLP exporters: OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer <token>").
AUTH_HEADER = "Authorization"
#: Environment variable with the shared token, read by ``agl store serve`` and by the client.
TOKEN_ENV = "AGL_STORE_TOKEN"

_ID = Field(min_length=1, max_length=256)


INT64 = (-(2**63), 2**63 - 1)  # what every backend can store in an integer column


def _check_int64(where: str, value: Optional[int]) -> None:
    if value is not None and not INT64[0] <= value <= INT64[1]:
        raise ValueError(f"{where} = {value} is out of range: stores keep 64-bit integers")


class EnqueueBody(BaseModel):
    requests: List[EnqueueRequest] = Field(description="rollouts to enqueue in one transaction, FIFO")

    @model_validator(mode="after")
    def _fits_the_store(self) -> EnqueueBody:
        for i, request in enumerate(self.requests):
            _check_int64(f"requests.{i}.config.max_attempts", request.config.max_attempts)
        return self


class DequeueBody(BaseModel):
    runner_id: str = _ID
    limit: int = Field(default=1, ge=1, le=10_000)
    timeout: float = Field(
        default=0.0,
        ge=0,
        description="seconds to wait for work; the server waits at most its max poll time per request "
        "and the client asks again (a long poll: the server is woken by the store, nobody sleeps-and-polls)",
    )


class WaitBody(BaseModel):
    rollout_ids: List[str]
    timeout: float = Field(default=0.0, ge=0, description="seconds to wait; capped per request like dequeue")


class QueryBody(BaseModel):
    status: Optional[List[RolloutStatus]] = None
    rollout_ids: Optional[List[str]] = None
    task_id: Optional[str] = None
    mode: Optional[RolloutMode] = None
    limit: Optional[int] = Field(default=None, ge=0, le=INT64[1])
    offset: int = Field(default=0, ge=0, le=INT64[1])


class CompleteBody(BaseModel):
    status: AttemptStatus
    reward: Optional[float] = None
    error: Optional[str] = None


class CompleteAndDequeueBody(CompleteBody):
    """A completion, then a claim for ``runner_id`` without waiting (``LightningStore.complete_and_dequeue``)."""

    runner_id: str = _ID
    limit: int = Field(default=1, ge=1, le=10_000)


class CompletedAndClaimed(BaseModel):
    rollout: Rollout = Field(description="the completed attempt's rollout, as complete returns it")
    claimed: List[Rollout] = Field(description="rollouts claimed after the completion (none if the queue was empty)")


class SpansBody(BaseModel):
    spans: List[Span]

    @model_validator(mode="after")
    def _fits_the_store(self) -> SpansBody:
        for i, span in enumerate(self.spans):
            for name in ("sequence_id", "start_time", "end_time"):
                _check_int64(f"spans.{i}.{name}", getattr(span, name))
            for j, event in enumerate(span.events):
                _check_int64(f"spans.{i}.events.{j}.timestamp", event.timestamp)
        return self


class DeleteSpansBody(BaseModel):
    rollout_ids: List[str] = Field(description="finished rollouts whose spans (every attempt's) are deleted")


class Deleted(BaseModel):
    deleted: int = Field(description="spans deleted")


class Renewed(BaseModel):
    renewed: int = Field(description="running attempts whose heartbeat was renewed")


class ResourcesBody(BaseModel):
    resources: Dict[str, Dict[str, Any]] = Field(description="name -> LLM / ProxyLLM / PromptTemplate fields")
    resources_id: Optional[str] = Field(default=None, min_length=1, max_length=256)


class RolloutList(BaseModel):
    rollouts: List[Rollout]


class AttemptList(BaseModel):
    attempts: List[Attempt]


class SpanList(BaseModel):
    model_config = SPAN_JSON

    spans: List[Span]


class Stored(BaseModel):
    stored: int = Field(description="spans newly stored (re-sent spans are ignored, never overwritten)")


class MaybeResources(BaseModel):
    update: Optional[ResourcesUpdate] = Field(description="null when the store has no resources yet")


class ErrorBody(BaseModel):
    error: str = Field(description="the exception class the client raises, e.g. UnknownRolloutError")
    message: str = Field(description="what was wrong and what to do")
    rollout_id: Optional[str] = None
    attempt_id: Optional[str] = None
    resources_id: Optional[str] = None


# exception class -> HTTP status. Order matters: subclasses before their bases.
_STATUS: Tuple[Tuple[Type[BaseException], int], ...] = (
    (UnknownRolloutError, 404),
    (UnknownAttemptError, 404),
    (UnknownResourcesError, 404),
    (StaleAttemptError, 409),
    (IllegalTransitionError, 409),
    (DuplicateResourcesError, 409),
    (DuplicateRolloutError, 409),
    (InvalidSpanError, 422),
    (StoreAuthError, 401),
    (StoreRequestError, 400),
    (StoreClosedError, 503),
    (StoreUnavailableError, 503),  # the database behind the server is down: clients retry, as for a restart
    (ValueError, 422),  # bad arguments the store refused (e.g. an unknown resource_type)
    (OverflowError, 422),  # a number too large for the store's columns
    (TypeError, 422),
)
_BY_NAME: Dict[str, Type[BaseException]] = {cls.__name__: cls for cls, _ in _STATUS}
_ID_FIELDS = ("rollout_id", "attempt_id", "resources_id")


def error_status(exc: BaseException) -> Optional[int]:
    """The HTTP status for an exception the store raised on purpose; None for anything else (a bug: 500)."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return None


def error_body(exc: BaseException) -> ErrorBody:
    ids = {name: getattr(exc, name) for name in _ID_FIELDS if isinstance(getattr(exc, name, None), str)}
    name = type(exc).__name__ if type(exc).__name__ in _BY_NAME else _nearest_known(exc)
    return ErrorBody(error=name, message=str(exc), **ids)


def _nearest_known(exc: BaseException) -> str:
    for cls, _ in _STATUS:
        if isinstance(exc, cls):
            return cls.__name__
    return type(exc).__name__


def raise_for_error(status: int, body: Mapping[str, Any]) -> None:
    """Raise what the server's error body names: the same class and message as the store raised."""
    if "error" in body:
        message = str(body.get("message") or f"the store server answered HTTP {status}")
    else:  # no agl error body: another service answered (the policy server's port, a proxy, a typo)
        detail = body.get("message") or body.get("detail")
        message = (
            f"the server answered HTTP {status}{f' ({detail})' if detail else ''} without an agl store error: "
            "check that the address is an agl store server's (`agl store serve`), not the policy server's or "
            "another service's"
        )
    cls: Type[BaseException] = _BY_NAME.get(str(body.get("error")), AglError)
    if status in (401, 403):
        cls = StoreAuthError
    elif cls is AglError and 400 <= status < 500:
        cls = StoreRequestError
    exc = cls.__new__(cls)  # rebuilt without __init__: the message is already the final text
    Exception.__init__(exc, message)
    for name in _ID_FIELDS:
        if isinstance(body.get(name), str):
            setattr(exc, name, body[name])
    raise exc
