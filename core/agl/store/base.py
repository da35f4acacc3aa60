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
from typing import Any, ClassVar, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from pydantic import BaseModel, Field

from agl.store import _rules
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
        mode: RolloutMode = "train",
        resources_id: Optional[str] = None,
        config: Optional[RolloutConfig] = None,
        metadata: Optional[Dict[str, Any]] = None,
    ) -> Rollout:
        request = EnqueueRequest(
            input=input,
            task_id=task_id,
            mode=mode,
            resources_id=resources_id,
            config=config or RolloutConfig(),
            metadata=metadata or {},
        )
        return self.enqueue_many([request])[0]

    @abc.abstractmethod
    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        """Claim up to ``limit`` queued rollouts for ``runner_id``, creating one new Attempt each.

        Waits up to ``timeout`` seconds for work if the queue is empty (woken when work arrives, not by
        polling where the backend can be woken). Returned rollouts have ``attempt`` set.
        """

    def dequeue_rollout(self, runner_id: str, *, timeout: float = 0.0) -> Optional[Rollout]:
        claimed = self.dequeue_many(runner_id, 1, timeout=timeout)
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
    ) -> List[Rollout]:
        """Rollouts in enqueue order, filtered."""
        statuses = None if status is None else list(status)
        ids = None if rollout_ids is None else list(rollout_ids)
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
