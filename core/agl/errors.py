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
