"""Errors agl raises on bad input. Each message says what was wrong and what to do."""

from __future__ import annotations


class AglError(Exception):
    """Base class of every error agl raises on purpose."""


class UnknownRolloutError(AglError, KeyError):
    def __init__(self, rollout_id: str):
        super().__init__(
            f"unknown rollout id {rollout_id!r}: no rollout with this id is in the store "
            "(list them with `agl store rollouts`, or check you are pointing at the right store)"
        )
        self.rollout_id = rollout_id

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return str(self.args[0])


class UnknownAttemptError(AglError, KeyError):
    def __init__(self, rollout_id: str, attempt_id: str):
        super().__init__(
            f"unknown attempt id {attempt_id!r} for rollout {rollout_id!r}: "
            "use the attempt id returned by dequeue_rollout (rollout.attempt.attempt_id)"
        )
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownResourcesError(AglError, KeyError):
    def __init__(self, resources_id: str):
        super().__init__(
            f"unknown resources id {resources_id!r}: add it with store.add_resources(...) first, "
            "or pass None to use the latest resources"
        )
        self.resources_id = resources_id

    def __str__(self) -> str:
        return str(self.args[0])


class IllegalTransitionError(AglError, ValueError):
    """A status change the rollout state machine does not allow (nothing was changed)."""


class StaleAttemptError(IllegalTransitionError):
    """An update for an attempt that is no longer the rollout's live attempt (it timed out or was retried)."""


class InvalidSpanError(AglError, ValueError):
    """A span that cannot be stored (missing ids, wrong types). Nothing of its batch was stored."""


class StoreClosedError(AglError, RuntimeError):
    """The store was closed; open a new one."""


class DuplicateResourcesError(AglError, ValueError):
    """``add_resources`` was given a ``resources_id`` that is already stored (versions are never overwritten)."""

    def __init__(self, resources_id: str):
        super().__init__(
            f"resources id {resources_id!r} is already stored and versions are never overwritten: "
            "call add_resources without resources_id to get a fresh id, or pick an unused one"
        )


class UnsupportedStoreError(AglError, NotImplementedError):
    """A store URL whose backend this version of agl does not provide."""


class StoreAddressError(AglError, ValueError):
    """A store URL or path that names no store agl can open (a typo, a missing scheme, a file that is not a
    store); the message says what was wrong and what to pass instead."""


class StoreNotFoundError(AglError, FileNotFoundError):
    """A SQLite store file that does not exist, opened by something that only reads (``create=False``)."""


class DuplicateRolloutError(AglError, ValueError):
    """``enqueue_many`` was given a ``rollout_id`` that is already stored (nothing of the batch was enqueued)."""

    def __init__(self, rollout_id: str):
        super().__init__(
            f"rollout id {rollout_id!r} is already stored, so nothing of this batch was enqueued: leave "
            "EnqueueRequest.rollout_id unset to get a fresh id, or pick an unused one"
        )
        self.rollout_id = rollout_id


class StoreUnavailableError(AglError, ConnectionError):
    """The store server could not be reached (or kept failing) after every retry. Transient: every call
    of the HTTP client is safe to repeat, so callers that can wait (the span writer, a runner) try again."""


class StoreStorageError(StoreUnavailableError):
    """The disk under the store's database is full, or reading or writing it failed (an I/O error); the call's
    change was rolled back. An outage like a store that does not answer: it passes once there is room again,
    so runners ride it out, the span writer retries and the store server answers 503, as for any outage."""


class StoreAuthError(AglError, PermissionError):
    """The store server refused the request's token (missing or not accepted); nothing was changed."""


class StoreRequestError(AglError, ValueError):
    """The store server refused a malformed or oversize request (4xx); nothing was changed."""


class NoTrainableSamples(AglError, ValueError):
    """Training steps had nothing to train on (every rollout failed, no LLM call recorded or selected, every
    sample dropped); the message says why and what to check."""


class MissingTokenIdsError(AglError, ValueError):
    """An LLM call selected for training has no token ids (the server did not return them)."""

    def __init__(self, rollout_id: str, attempt_id: str, span_id: str, agent_name: object, reason: str):
        super().__init__(
            f"LLM call span {span_id} (agent {agent_name!r}) of rollout {rollout_id} attempt {attempt_id} has no "
            f"token ids: {reason}. Serve the model with `agl serve` or vLLM (agl asks for return_token_ids), or "
            "pass tokenizer=... to LightningRL to re-tokenize the recorded messages (approximate: the ids may "
            "differ from what the model sampled), or leave such calls out: by agent with agent_match, by model "
            "with llm_call_match (a regex on the call's model, e.g. to leave out an LLM judge's calls)"
        )
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.span_id = span_id
        self.agent_name = agent_name
        self.reason = reason


class RolloutTimedOutError(AglError, TimeoutError):
    """A model call made by the agent of a rollout that ran past its timeout and was ended: refused before it
    reaches the model server (see :func:`agl.tracing.context.refuse_calls_after_timeout`)."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            f"agl: rollout {rollout_id} ran past its timeout and was ended; this model call from its agent, still "
            "running where agl could not stop it (a sync agent, or a framework's worker thread), is refused so "
            "that it does not take the model server from the rollouts running now. Make the agent finish within "
            "the rollout timeout, or raise it (Trainer(rollout_timeout=...))"
        )
