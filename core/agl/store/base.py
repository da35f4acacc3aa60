"""The LightningStore contract: the one place where trainers and runners meet.

The interface is synchronous and thread-safe: runners call it from worker threads or processes, the
trainer from its main thread, and the HTTP server from its request handlers. Every backend (in-memory,
SQLite, PostgreSQL, the HTTP client) implements exactly this class and passes the same test suite.

State machine of a rollout (see docs/store.md):

    queued --dequeue--> running --complete(succeeded)--> succeeded
                        running --complete(failed|timeout|unresponsive)--> queued  (attempts left)
                                                                      \\-> failed  (no attempts left)
    queued|running --cancel--> cancelled

Each dequeue creates a new Attempt; spans are keyed by (rollout_id, attempt_id), so spans of a failed
attempt are kept and never mixed into its retry.
"""

from __future__ import annotations

import abc
import logging
import os
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    Iterable,
    List,
    Literal,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypedDict,
    cast,
)

from pydantic import BaseModel, Field, field_validator

from agl.errors import (
    UnknownAttemptError,
    UnknownResourcesError,
    UnknownRolloutError,
    UnsupportedStoreError,
)
from agl.store import _rules, async_calls
from agl.types import (
    Attempt,
    AttemptStatus,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
)

logger = logging.getLogger("agl.store")


class EnqueueRequest(BaseModel):
    """One rollout to enqueue. ``task_id`` groups rollouts of the same task (GRPO groups).

    ``rollout_id`` lets the caller choose the id, so that a retried enqueue (the HTTP client after a lost
    response) is recognised: an id that is already stored raises DuplicateRolloutError and enqueues
    nothing of the batch. None (the usual case): the store picks a fresh id.
    """

    rollout_id: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    input: Any = None
    task_id: Optional[str] = None
    mode: RolloutMode = "train"
    resources_id: Optional[str] = None
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: Dict[str, Any] = Field(default_factory=dict)
    runner_id: Optional[str] = Field(
        default=None,
        description="start the rollout at once for this runner: it skips the queue and comes back running, its "
        "first attempt in `attempt` (for code that runs the agent itself: `start_rollout`)",
    )

    @field_validator("runner_id")
    @classmethod
    def _storable_runner_id(cls, value: Optional[str]) -> Optional[str]:
        _rules.check_id(value, "runner_id")
        return value


class Completion(NamedTuple):
    """The arguments of ``complete_attempt`` as one value, so that each backend's implementation takes them
    without restating the public signature (and its checks)."""

    rollout_id: str
    attempt_id: str
    status: AttemptStatus
    reward: Optional[float]
    error: Optional[str]

    def checked(self) -> Completion:
        """This completion as every backend stores it: refused unless its status ends an attempt and its reward is
        finite (:func:`_rules.check_completion`), with the reward a float and the error as free text
        (:func:`_rules.free_text`)."""
        reward = _rules.check_completion(self.status, self.reward)
        return self._replace(reward=reward, error=_rules.free_text(self.error))


class RolloutQuery(NamedTuple):
    """The filters of ``query_rollouts``, each iterable read once into a list, as every backend applies them."""

    status: Optional[List[RolloutStatus]]
    rollout_ids: Optional[List[str]]
    task_id: Optional[str]
    mode: Optional[RolloutMode]
    limit: Optional[int]
    offset: int


class StoreStats(BaseModel):
    rollouts: Dict[str, int] = Field(default_factory=dict, description="count per rollout status")
    attempts: int = 0
    spans: int = 0
    resources_versions: int = 0


class LightningStoreStatistics(TypedDict, total=False):
    """Agent Lightning's ``statistics()``: :class:`StoreStats` under its names."""

    name: str
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int


class LightningStoreCapabilities(TypedDict, total=False):
    """Agent Lightning's ``capabilities``: every agl store is thread-safe; ``zero_copy``: processes share it."""

    thread_safe: bool
    async_safe: bool
    zero_copy: bool
    otlp_traces: bool


#: Agent Lightning's rollout modes as well as agl's: "test" is agl's "val", None (no mode) "train".
PeerMode = Optional[Literal["train", "val", "dev", "test"]]
_MODES: Dict[Optional[str], RolloutMode] = {None: "train", "test": "val"}
#: Agent Lightning's rollout statuses that agl names otherwise (it queues, requeues and prepares; agl queues and runs).
_STATUSES: Dict[str, RolloutStatus] = {"queuing": "queued", "requeuing": "queued", "preparing": "running"}


def _request(
    input: Any,
    mode: PeerMode,
    resources_id: Optional[str],
    config: Optional[RolloutConfig],
    metadata: Optional[Dict[str, Any]],
    **ids: Optional[str],
) -> EnqueueRequest:
    return EnqueueRequest(
        input=input,
        mode=_MODES.get(mode, mode),
        resources_id=resources_id,
        config=config or RolloutConfig(),
        metadata=metadata or {},
        **ids,
    )


def _statuses(statuses: Iterable[str]) -> List[RolloutStatus]:
    return list(dict.fromkeys(_STATUSES.get(s, cast(RolloutStatus, s)) for s in statuses))


def _not_in_agl(name: str, instead: str) -> Callable[..., Any]:
    """A method of Agent Lightning's API that agl has no counterpart for: one line naming what to do instead."""

    def refuse(self: LightningStore, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedStoreError(f"{name}() is Agent Lightning's; {instead}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not in agl: {instead}."
    return refuse


class LightningStore(abc.ABC):
    """Abstract store. All methods are thread-safe; ids that do not exist raise ``Unknown*Error``."""

    #: True when forked/spawned runner processes can use this same store object (SQLite, HTTP client).
    multiprocess_safe: ClassVar[bool] = False

    # -- rollouts ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def enqueue_many(self, requests: Sequence[EnqueueRequest]) -> List[Rollout]:
        """Add rollouts to the queue (FIFO) in one transaction and wake waiting runners."""

    def enqueue_rollout(
        self,
        input: Any = None,
        *,
        task_id: Optional[str] = None,
        mode: PeerMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[Dict[str, Any]] = None,
    ) -> Rollout:
        """Add one rollout to the queue. ``mode`` also takes Agent Lightning's ``"test"`` (agl's ``"val"``) and
        ``None`` (``"train"``)."""
        request = _request(input, mode, resources_id, config, metadata, task_id=task_id)
        return self.enqueue_many([request])[0]

    @abc.abstractmethod
    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        """Claim up to ``limit`` queued rollouts for ``runner_id``, creating one new Attempt each.

        Waits up to ``timeout`` seconds for work if the queue is empty (woken when work arrives, not by
        polling where the backend can be woken). Returned rollouts have ``attempt`` set.
        """

    def dequeue_rollout(
        self, runner_id: Optional[str] = None, *, timeout: float = 0.0, worker_id: Optional[str] = None
    ) -> Optional[Rollout]:
        """Claim one queued rollout (see ``dequeue_many``). ``worker_id`` is Agent Lightning's name for
        ``runner_id``; with neither, the runner is named after this process."""
        claimed = self.dequeue_many(runner_id or worker_id or f"pid-{os.getpid()}", 1, timeout=timeout)
        return claimed[0] if claimed else None

    @abc.abstractmethod
    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        """Record that the runner of this attempt is alive. Raises StaleAttemptError if it already ended."""

    def complete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus,
        *,
        reward: Optional[float] = None,
        error: Optional[str] = None,
    ) -> Rollout:
        """End the live attempt with ``status`` and move the rollout on (succeeded, requeued or failed).

        ``reward`` is the rollout's final reward (kept on success only). Ending an attempt that is not the
        rollout's live attempt raises StaleAttemptError and changes nothing.
        """
        return self._complete_attempt(Completion(rollout_id, attempt_id, status, reward, error).checked())

    @abc.abstractmethod
    def _complete_attempt(self, done: Completion) -> Rollout:
        """``complete_attempt`` of a completion already checked (:meth:`Completion.checked`)."""

    def complete_and_dequeue(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus,
        *,
        reward: Optional[float] = None,
        error: Optional[str] = None,
        runner_id: str,
        limit: int = 1,
    ) -> Tuple[Rollout, List[Rollout]]:
        """``complete_attempt``, then claim up to ``limit`` queued rollouts for ``runner_id`` without waiting:
        a runner's step from one rollout to the next, in one round trip to a store server.

        The completion comes first and decides: if it raises, nothing is claimed. A claim that fails after a
        recorded completion gives no rollouts (logged), never an error, so the caller does not report the
        completion again; it dequeues as usual when it gets none.
        """
        return self._complete_and_dequeue(Completion(rollout_id, attempt_id, status, reward, error), runner_id, limit)

    def _complete_and_dequeue(self, done: Completion, runner_id: str, limit: int) -> Tuple[Rollout, List[Rollout]]:
        """``complete_and_dequeue`` of a completion as the caller gave it: ``complete_attempt``, then a claim (the
        client of a store server overrides this to do both in one request)."""
        _rules.check_limit(limit)
        completed = self.complete_attempt(
            done.rollout_id, done.attempt_id, done.status, reward=done.reward, error=done.error
        )
        return completed, self._claim_after_completion(runner_id, limit)

    def _claim_after_completion(self, runner_id: str, limit: int) -> List[Rollout]:
        try:
            return self.dequeue_many(runner_id, limit, timeout=0)
        except Exception as exc:  # noqa: BLE001 - the completion is recorded; the runner will dequeue again
            logger.warning("claim after a completion failed (the runner will dequeue again): %s", exc)
            return []

    @abc.abstractmethod
    def cancel_rollout(self, rollout_id: str) -> Rollout:
        """Cancel a queued or running rollout; its live attempt (if any) ends as cancelled."""

    @abc.abstractmethod
    def get_rollout(self, rollout_id: str) -> Rollout:
        """The rollout with its latest attempt in ``attempt`` (None if never dequeued)."""

    def query_rollouts(
        self,
        *,
        status: Optional[Iterable[RolloutStatus]] = None,
        rollout_ids: Optional[Iterable[str]] = None,
        task_id: Optional[str] = None,
        mode: Optional[RolloutMode] = None,
        limit: Optional[int] = None,
        offset: int = 0,
        status_in: Optional[Iterable[str]] = None,
        rollout_id_in: Optional[Iterable[str]] = None,
    ) -> List[Rollout]:
        """Rollouts in enqueue order, filtered. ``status_in`` and ``rollout_id_in`` are Agent Lightning's names
        for ``status`` and ``rollout_ids`` (its statuses are read as agl's: queuing and requeuing are queued,
        preparing is running); its ``limit=-1`` means no limit."""
        status = status if status_in is None else _statuses(status_in)
        rollout_ids = rollout_ids if rollout_id_in is None else rollout_id_in
        statuses = None if status is None else list(status)
        ids = None if rollout_ids is None else list(rollout_ids)
        limit = None if limit == -1 else limit
        return self._query_rollouts(RolloutQuery(statuses, ids, task_id, mode, limit, offset))

    @abc.abstractmethod
    def _query_rollouts(self, query: RolloutQuery) -> List[Rollout]:
        """``query_rollouts`` with its filters gathered in one value (each iterable read once, into a list)."""

    @abc.abstractmethod
    def query_attempts(self, rollout_id: str) -> List[Attempt]:
        """Every attempt of a rollout, first first."""

    @abc.abstractmethod
    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> List[Rollout]:
        """Wait until every listed rollout is terminal or ``timeout`` passes; return the terminal ones."""

    @abc.abstractmethod
    def reap_expired(self) -> List[Rollout]:
        """End attempts past their timeout or heartbeat deadline (retrying per max_attempts).

        Backends call this themselves on dequeue and wait; a long-running server also calls it on a timer.
        Returns the rollouts that changed.
        """

    @abc.abstractmethod
    def renew_heartbeats(self) -> int:
        """Count every running attempt that has a heartbeat timeout as having sent a heartbeat now; returns
        how many it renewed.

        For after the store was unreachable: no runner could send a heartbeat meanwhile, so an outage longer
        than the heartbeat timeout would otherwise end every running attempt as unresponsive (failing the
        rollouts that have no attempt left) the moment the store is back, runners alive or not. The store
        server calls this when it starts; a PostgreSQL store does the same by itself for attempts whose last
        heartbeat predates the database server's start. A runner that really died is still ended, one
        heartbeat timeout later. ``timeout_seconds`` (an attempt's wall time) is not extended.
        """

    # -- spans ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def add_spans(self, spans: Sequence[Span]) -> int:
        """Store spans in one transaction. A span of an unknown rollout or attempt raises and stores nothing.

        A span whose (rollout, attempt, span_id) is already stored is ignored (idempotent retries), never
        overwritten. A span of a running attempt counts as its heartbeat. Returns the number stored.
        """

    @abc.abstractmethod
    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = "latest") -> List[Span]:
        """Spans of one attempt (``"latest"``: the newest attempt; ``None``: every attempt), by sequence id."""

    @abc.abstractmethod
    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        """Delete every span of the listed rollouts (all attempts) in one transaction; returns how many.

        The way to bound a long training run's store: spans (prompts, responses, token ids) are nearly all of
        its volume, and once an update has learnt from a rollout nothing reads them again except a person
        inspecting it. The rollouts themselves (status, reward, attempts) stay. Only finished rollouts
        (succeeded, failed, cancelled) qualify: a queued or running one raises IllegalTransitionError, an
        unknown id UnknownRolloutError, and in either case nothing is deleted. Deleting twice deletes 0.
        """

    # -- resources -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def add_resources(self, resources: Dict[str, Resource], resources_id: Optional[str] = None) -> ResourcesUpdate:
        """Store a new resources version; it becomes the latest."""

    @abc.abstractmethod
    def get_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        """A resources version by id (raises if unknown), or the latest (None if there is none)."""

    # -- misc ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def stats(self) -> StoreStats: ...

    def ride_out_outages(self, seconds: float) -> None:  # noqa: B027 - a no-op by default: only remote stores have outages
        """Keep each call trying for up to ``seconds`` while the server behind this store is unreachable,
        unless the store was given its own setting. For long-lived users (a Trainer, ``agl runner``) of a store
        that reaches a server; the in-process stores have no outages and ignore it."""

    def close(self) -> None:  # noqa: B027 - a no-op by default: the in-memory store holds no connection
        """Release connections. Safe to call twice."""

    def __enter__(self) -> LightningStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every store's API is awaitable from user coroutines (:mod:`agl.store.async_calls` says why)."""
        super().__init_subclass__(**kwargs)
        async_calls.install(cls, _API)

    # -- Agent Lightning v0.3's names for the calls above (docs/agent-lightning.md) -----------------------------
    def start_rollout(
        self,
        input: Any = None,
        mode: PeerMode = None,
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[Dict[str, Any]] = None,
        worker_id: Optional[str] = None,
    ) -> Rollout:
        """A rollout that skips the queue and comes back running, its first attempt in ``attempt``: for code that
        runs the agent itself (a tracer's ``trace_context`` with ``rollout.attempt.attempt_id``), then ends the
        attempt with ``complete_attempt``."""
        request = _request(input, mode, resources_id, config, metadata, runner_id=worker_id or f"pid-{os.getpid()}")
        rollout = self.enqueue_many([request])[0]
        if rollout.attempt is None:  # a store server of an agl release before start_rollout: it only enqueued
            raise UnsupportedStoreError(
                f"the store behind {self!r} enqueued rollout {rollout.rollout_id} instead of starting it (an older agl "
                "serves it): upgrade agl on the store server, or enqueue_rollout() and let a runner dequeue it"
            )
        return rollout

    def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRequest]) -> List[Rollout]:
        """Agent Lightning's name for ``enqueue_many``."""
        return self.enqueue_many(rollouts)

    def dequeue_many_rollouts(self, *, limit: int = 1, worker_id: Optional[str] = None) -> List[Rollout]:
        """Agent Lightning's ``dequeue_many_rollouts``: ``dequeue_many`` without waiting."""
        return self.dequeue_many(worker_id or f"pid-{os.getpid()}", limit)

    def get_rollout_by_id(self, rollout_id: str) -> Optional[Rollout]:
        """``get_rollout``, None for an unknown id."""
        try:
            return self.get_rollout(rollout_id)
        except UnknownRolloutError:
            return None

    def get_latest_attempt(self, rollout_id: str) -> Optional[Attempt]:
        """The rollout's newest attempt, None while it is queued for the first time."""
        attempts = self.query_attempts(rollout_id)
        return attempts[-1] if attempts else None

    def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        """``get_resources()``: the latest version, None if there is none."""
        return self.get_resources()

    def get_resources_by_id(self, resources_id: str) -> Optional[ResourcesUpdate]:
        """``get_resources(resources_id)``, None for an unknown id."""
        try:
            return self.get_resources(resources_id)
        except UnknownResourcesError:
            return None

    def update_resources(self, resources_id: str, resources: Dict[str, Resource]) -> ResourcesUpdate:
        """Agent Lightning's upsert, as far as agl's immutable versions allow: a new id is added as the latest
        version; an id already stored raises DuplicateResourcesError (add a new version instead)."""
        return self.add_resources(resources, resources_id)

    def query_resources(self, *, resources_id: Optional[str] = None) -> List[ResourcesUpdate]:
        """The version ``resources_id`` (a list of one, or none if unknown). agl's stores do not list every version:
        without an id this refuses, naming ``get_latest_resources``."""
        if resources_id is None:
            raise UnsupportedStoreError(
                "query_resources() without resources_id: agl's stores do not list every resources version; "
                "ask get_latest_resources() or get_resources(resources_id)"
            )
        found = self.get_resources_by_id(resources_id)
        return [] if found is None else [found]

    def add_span(self, span: Span) -> Optional[Span]:
        """``add_spans([span])``: the span, or None if it was already stored."""
        return span if self.add_spans([span]) else None

    def add_many_spans(self, spans: Sequence[Span]) -> List[Span]:
        """``add_spans(spans)``; returns the spans given (any already stored were ignored)."""
        self.add_spans(spans)
        return list(spans)

    def update_attempt(
        self, rollout_id: str, attempt_id: str, status: Optional[str] = None, **unsupported: Any
    ) -> Attempt:
        """Agent Lightning's ``update_attempt`` for what agl has: a status that ends an attempt is
        ``complete_attempt``, none (or "running") a ``heartbeat``; ``attempt_id="latest"`` is the newest attempt.
        Other fields (worker, metadata, heartbeat time) are refused with the agl call to use."""
        if unsupported:
            raise UnsupportedStoreError(
                f"update_attempt({', '.join(sorted(unsupported))}=...): agl's attempts keep no such field; end an "
                "attempt with complete_attempt(rollout_id, attempt_id, status, reward=) and send heartbeat()"
            )
        if attempt_id == "latest":
            latest = self.get_latest_attempt(rollout_id)
            if latest is None:
                raise UnknownAttemptError(rollout_id, attempt_id)
            attempt_id = latest.attempt_id
        if status is None or status in ("running", "preparing"):
            return self.heartbeat(rollout_id, attempt_id)
        ended = self.complete_attempt(rollout_id, attempt_id, status)  # type: ignore[arg-type]  # checked there
        return next(a for a in self.query_attempts(ended.rollout_id) if a.attempt_id == attempt_id)

    def statistics(self) -> LightningStoreStatistics:
        """Agent Lightning's ``statistics()`` from ``stats()``."""
        stats = self.stats()
        return LightningStoreStatistics(
            name=type(self).__name__,
            total_rollouts=sum(stats.rollouts.values()),
            total_attempts=stats.attempts,
            total_spans=stats.spans,
            total_resources=stats.resources_versions,
        )

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        """Agent Lightning's ``capabilities``. agl's tracer sends spans itself, so no store takes OTLP from it."""
        return LightningStoreCapabilities(
            thread_safe=True, async_safe=True, zero_copy=self.multiprocess_safe, otlp_traces=False
        )

    update_rollout = _not_in_agl(
        "update_rollout", "agl changes a rollout only through its attempts: cancel_rollout(), complete_attempt()"
    )
    start_attempt = _not_in_agl(
        "start_attempt", "agl starts attempts when a runner dequeues: a failed attempt is retried per max_attempts"
    )
    add_otel_span = _not_in_agl(
        "add_otel_span", "agl's tracer records spans itself: agl.instrument(), then add_spans() for Span objects"
    )
    get_next_span_sequence_id = _not_in_agl(
        "get_next_span_sequence_id", "agl's tracer numbers spans itself (Span.sequence_id)"
    )
    get_many_span_sequence_ids = _not_in_agl(
        "get_many_span_sequence_ids", "agl's tracer numbers spans itself (Span.sequence_id)"
    )
    query_workers = _not_in_agl("query_workers", "agl's stores track attempts, not workers: query_attempts()")
    get_worker_by_id = _not_in_agl("get_worker_by_id", "agl's stores track attempts, not workers: query_attempts()")
    update_worker = _not_in_agl("update_worker", "a runner's liveness is its attempt's heartbeat(): heartbeat()")


#: The store API: awaitable from user coroutines on every store (:mod:`agl.store.async_calls`).
_API = async_calls.public_methods(LightningStore)
async_calls.install(LightningStore, _API)


class AsyncRolloutCalls(abc.ABC):
    """Optional, for a networked store: the calls of a runner's rollout cycle as coroutines that wait for the
    database on the running event loop, without a thread. The store server uses them when a store has them.

    Why: the server would otherwise run each call of a networked store on a worker thread, and the hop there
    and back costs more server CPU than the call (see ``benchmarks/server_overhead.py``). Each does exactly
    what its synchronous namesake does (same results, same errors, same retries), ``aclaim`` being
    ``dequeue_many(runner_id, limit, timeout=0)``: waiting for work stays with the synchronous call.
    """

    @abc.abstractmethod
    async def aclaim(self, runner_id: str, limit: int = 1) -> List[Rollout]: ...

    @abc.abstractmethod
    async def aadd_spans(self, spans: Sequence[Span]) -> int: ...

    async def acomplete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus,
        *,
        reward: Optional[float] = None,
        error: Optional[str] = None,
    ) -> Rollout:
        return await self._acomplete_attempt(Completion(rollout_id, attempt_id, status, reward, error).checked())

    @abc.abstractmethod
    async def _acomplete_attempt(self, done: Completion) -> Rollout:
        """``acomplete_attempt`` of a completion already checked (:meth:`Completion.checked`)."""

    @abc.abstractmethod
    async def aget_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]: ...
