"""The LightningStore contract, run against every backend (see conftest.BACKENDS).

Timeouts are tiny (0.05 s) and the tests sleep a little past them, then assert on states, never on timing.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import pytest

from agl.errors import (
    AglError,
    DuplicateResourcesError,
    DuplicateRolloutError,
    IllegalTransitionError,
    InvalidSpanError,
    StaleAttemptError,
    StoreClosedError,
    UnknownAttemptError,
    UnknownResourcesError,
    UnknownRolloutError,
)
from agl.store import EnqueueRequest, LightningStore
from agl.types import LLM, PromptTemplate, Rollout, RolloutConfig, Span, SpanEvent

MakeSpan = Callable[..., Any]


def claim(store: LightningStore, runner_id: str = "runner-1") -> Rollout:
    rollout = store.dequeue_rollout(runner_id)
    assert rollout is not None and rollout.attempt is not None
    return rollout


def aid(rollout: Rollout) -> str:
    assert rollout.attempt is not None
    return rollout.attempt.attempt_id


def fail(store: LightningStore, rollout: Rollout, error: str = "boom") -> Rollout:
    return store.complete_attempt(rollout.rollout_id, aid(rollout), "failed", error=error)


# -- queue -------------------------------------------------------------------------------------------------


def test_enqueue_dequeue_is_fifo(store: LightningStore) -> None:
    enqueued = store.enqueue_many([EnqueueRequest(input={"i": i}) for i in range(5)])
    assert [r.status for r in enqueued] == ["queued"] * 5
    first_two = store.dequeue_many("runner-1", 2)
    third = store.dequeue_rollout("runner-2")
    rest = store.dequeue_many("runner-3", 10)
    assert [r.input for r in first_two] == [{"i": 0}, {"i": 1}]
    assert third is not None and third.input == {"i": 2}
    assert [r.input for r in rest] == [{"i": 3}, {"i": 4}]
    assert store.dequeue_rollout("runner-1") is None
    assert store.dequeue_many("runner-1", 3) == []


def test_dequeue_creates_running_attempt(store: LightningStore) -> None:
    queued = store.enqueue_rollout({"q": "6*7"}, task_id="task-1", metadata={"split": "a"})
    rollout = claim(store, "runner-7")
    assert rollout.rollout_id == queued.rollout_id
    assert (rollout.status, rollout.n_attempts, rollout.task_id, rollout.metadata) == (
        "running",
        1,
        "task-1",
        {"split": "a"},
    )
    assert rollout.start_time is not None and rollout.end_time is None
    attempt = rollout.attempt
    assert attempt is not None
    assert (attempt.sequence, attempt.runner_id, attempt.status, attempt.rollout_id) == (
        1,
        "runner-7",
        "running",
        rollout.rollout_id,
    )
    assert store.get_rollout(rollout.rollout_id) == rollout
    assert store.query_attempts(rollout.rollout_id) == [attempt]


def test_enqueued_rollout_reads_back_equal(store: LightningStore) -> None:
    inputs: List[Any] = [None, "text", 3, [1, "two", {"three": 3.0}], {"nested": {"list": [1, 2]}}]
    for value in inputs:
        rollout = store.enqueue_rollout(value, mode="val", config=RolloutConfig(max_attempts=2, timeout_seconds=5))
        assert rollout.input == value and rollout.attempt is None and rollout.task_id
        assert store.get_rollout(rollout.rollout_id) == rollout


def test_dequeue_limit_must_be_positive(store: LightningStore) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        store.dequeue_many("runner-1", 0)


def test_non_json_input_is_refused(store: LightningStore) -> None:
    with pytest.raises(TypeError, match="JSON-serialisable"):
        store.enqueue_rollout(object())
    assert sum(store.stats().rollouts.values()) == 0


def test_enqueue_checks_resources_and_keeps_resources_id(store: LightningStore) -> None:
    with pytest.raises(UnknownResourcesError, match="add_resources"):
        store.enqueue_many([EnqueueRequest(), EnqueueRequest(resources_id="res-missing")])
    assert sum(store.stats().rollouts.values()) == 0, "a refused batch enqueues nothing"
    update = store.add_resources({"llm": LLM(endpoint="http://x/v1", model="m")})
    store.enqueue_many([EnqueueRequest(resources_id=update.resources_id), EnqueueRequest()])
    store.add_resources({"llm": LLM(endpoint="http://y/v1", model="m")})
    with_id, without_id = store.dequeue_many("runner-1", 2)
    assert with_id.resources_id == update.resources_id
    assert without_id.resources_id is None, "None means 'latest at run time' and stays None"


def test_caller_chosen_rollout_ids_are_kept_and_never_reused(store: LightningStore) -> None:
    """What makes a retried enqueue safe (the HTTP client chooses ids and recognises its own)."""
    mine, theirs = store.enqueue_many([EnqueueRequest(rollout_id="ro-mine-1", input=1), EnqueueRequest(input=2)])
    assert mine.rollout_id == "ro-mine-1" and theirs.rollout_id != "ro-mine-1"
    assert store.get_rollout("ro-mine-1") == mine
    with pytest.raises(DuplicateRolloutError, match="'ro-mine-1'.*nothing of this batch"):
        store.enqueue_many([EnqueueRequest(rollout_id="ro-new"), EnqueueRequest(rollout_id="ro-mine-1")])
    with pytest.raises(DuplicateRolloutError, match="'ro-twice'"):
        store.enqueue_many([EnqueueRequest(rollout_id="ro-twice"), EnqueueRequest(rollout_id="ro-twice")])
    assert [r.rollout_id for r in store.query_rollouts()] == [mine.rollout_id, theirs.rollout_id]
    with pytest.raises(ValueError, match="rollout_id"):
        EnqueueRequest(rollout_id="no/slashes")


# -- completing, retries -----------------------------------------------------------------------------------


def test_complete_succeeded_keeps_reward(store: LightningStore) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    done = store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded", reward=0.75)
    assert (done.status, done.final_reward, done.error) == ("succeeded", 0.75, None)
    assert done.end_time is not None
    assert done.attempt is not None and done.attempt.status == "succeeded" and done.attempt.end_time is not None
    assert store.get_rollout(rollout.rollout_id) == done


def test_failure_retries_up_to_max_attempts(store: LightningStore) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=3))
    for sequence in (1, 2):
        rollout = claim(store)
        assert rollout.attempt is not None and rollout.attempt.sequence == sequence
        requeued = store.complete_attempt(
            rollout.rollout_id, aid(rollout), "failed", reward=1.0, error=f"error {sequence}"
        )
        assert (requeued.status, requeued.error, requeued.n_attempts) == ("queued", f"error {sequence}", sequence)
        assert requeued.final_reward is None and requeued.end_time is None
        assert requeued.attempt is not None and requeued.attempt.status == "failed"
    last = claim(store)
    assert last.attempt is not None and last.attempt.sequence == 3
    failed = store.complete_attempt(last.rollout_id, aid(last), "unresponsive", error="gone")
    assert (failed.status, failed.error, failed.n_attempts, failed.final_reward) == ("failed", "gone", 3, None)
    assert failed.end_time is not None
    attempts = store.query_attempts(last.rollout_id)
    assert [(a.sequence, a.status, a.error) for a in attempts] == [
        (1, "failed", "error 1"),
        (2, "failed", "error 2"),
        (3, "unresponsive", "gone"),
    ]
    assert len({a.attempt_id for a in attempts}) == 3
    assert store.dequeue_rollout("runner-1") is None


def test_requeued_rollout_goes_to_the_back(store: LightningStore) -> None:
    first, second = store.enqueue_many(
        [EnqueueRequest(input="a", config=RolloutConfig(max_attempts=2)), EnqueueRequest(input="b")]
    )
    fail(store, claim(store))
    assert [r.rollout_id for r in store.dequeue_many("runner-1", 2)] == [second.rollout_id, first.rollout_id]


def test_stale_attempt_is_refused_and_changes_nothing(store: LightningStore) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2))
    old = claim(store)
    fail(store, old)
    new = claim(store)
    before = store.get_rollout(new.rollout_id)
    with pytest.raises(StaleAttemptError, match="already ended as 'failed'"):
        store.complete_attempt(old.rollout_id, aid(old), "succeeded", reward=1.0)
    with pytest.raises(StaleAttemptError, match="dequeue new work"):
        store.heartbeat(old.rollout_id, aid(old))
    assert store.get_rollout(new.rollout_id) == before
    store.complete_attempt(new.rollout_id, aid(new), "succeeded", reward=1.0)
    with pytest.raises(StaleAttemptError):
        store.complete_attempt(new.rollout_id, aid(new), "failed")
    assert store.get_rollout(new.rollout_id).status == "succeeded"


def test_complete_and_dequeue_completes_then_claims(store: LightningStore) -> None:
    store.enqueue_many([EnqueueRequest(input={"i": i}) for i in range(4)])
    first = claim(store)
    completed, claimed = store.complete_and_dequeue(
        first.rollout_id, aid(first), "succeeded", reward=0.5, runner_id="runner-2", limit=2
    )
    assert completed.status == "succeeded" and completed.final_reward == 0.5
    assert completed.attempt is not None and completed.attempt.status == "succeeded"
    assert [r.input for r in claimed] == [{"i": 1}, {"i": 2}]
    for rollout in claimed:
        assert rollout.status == "running" and rollout.attempt is not None and rollout.attempt.runner_id == "runner-2"
        assert store.get_rollout(rollout.rollout_id) == rollout
    last = claim(store)
    done, none = store.complete_and_dequeue(last.rollout_id, aid(last), "succeeded", runner_id="runner-2")
    assert done.status == "succeeded" and none == []  # an empty queue: nothing, at once


def test_complete_and_dequeue_claims_after_the_completion(store: LightningStore) -> None:
    """A failed attempt's rollout is requeued by the completion, so the same call can claim it again."""
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2))
    first = claim(store)
    requeued, claimed = store.complete_and_dequeue(first.rollout_id, aid(first), "failed", error="boom", runner_id="r")
    assert requeued.status == "queued" and requeued.error == "boom"
    assert [r.rollout_id for r in claimed] == [first.rollout_id]
    assert claimed[0].attempt is not None and claimed[0].attempt.sequence == 2


def test_a_refused_completion_claims_nothing(store: LightningStore) -> None:
    store.enqueue_many([EnqueueRequest(input=i) for i in range(2)])
    rollout = claim(store)
    store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded")
    with pytest.raises(StaleAttemptError):
        store.complete_and_dequeue(rollout.rollout_id, aid(rollout), "succeeded", runner_id="r")
    with pytest.raises(UnknownRolloutError):
        store.complete_and_dequeue("ro-ghost", "at-ghost", "succeeded", runner_id="r")
    with pytest.raises(ValueError, match="limit"):
        store.complete_and_dequeue(rollout.rollout_id, aid(rollout), "succeeded", runner_id="r", limit=0)
    assert [r.status for r in store.query_rollouts()] == ["succeeded", "queued"]


@pytest.mark.parametrize("status", ["running", "cancelled", "done"])
def test_complete_needs_a_final_status(store: LightningStore, status: str) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    with pytest.raises(IllegalTransitionError, match="complete_attempt"):
        store.complete_attempt(rollout.rollout_id, aid(rollout), status)  # type: ignore[arg-type]
    assert store.get_rollout(rollout.rollout_id) == rollout


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "1.0", pytest.param(10**400, id="int-beyond-float")])
def test_complete_refuses_a_reward_that_is_not_a_finite_number(store: LightningStore, reward: Any) -> None:
    # every backend alike, the HTTP client before sending (JSON would carry a NaN as null: no reward)
    store.enqueue_rollout("x")
    rollout = claim(store)
    with pytest.raises(ValueError, match="a reward must be a finite int or float"):
        store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded", reward=reward)
    with pytest.raises(ValueError, match="a reward must be a finite int or float"):
        store.complete_and_dequeue(rollout.rollout_id, aid(rollout), "succeeded", reward=reward, runner_id="r")
    assert store.get_rollout(rollout.rollout_id) == rollout
    done = store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded", reward=True)  # a bool is an int
    assert done.final_reward == 1.0 and type(done.final_reward) is float
    assert store.get_rollout(rollout.rollout_id).model_dump_json() == done.model_dump_json()


def test_heartbeat_updates_last_heartbeat(store: LightningStore) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    assert rollout.attempt is not None
    time.sleep(0.01)
    attempt = store.heartbeat(rollout.rollout_id, aid(rollout))
    assert attempt.status == "running" and attempt.last_heartbeat > rollout.attempt.last_heartbeat
    assert store.query_attempts(rollout.rollout_id) == [attempt]


# -- unknown ids -------------------------------------------------------------------------------------------


def test_unknown_ids_raise_helpful_errors(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    calls: List[Callable[[], Any]] = [
        lambda: store.get_rollout("ro-missing"),
        lambda: store.heartbeat("ro-missing", "at-x"),
        lambda: store.complete_attempt("ro-missing", "at-x", "succeeded"),
        lambda: store.cancel_rollout("ro-missing"),
        lambda: store.query_attempts("ro-missing"),
        lambda: store.query_spans("ro-missing"),
        lambda: store.query_spans("ro-missing", None),
        lambda: store.wait_for_rollouts([rollout.rollout_id, "ro-missing"], timeout=0),
    ]
    for call in calls:
        with pytest.raises(UnknownRolloutError) as info:
            call()
        assert "'ro-missing'" in str(info.value) and "agl store rollouts" in str(info.value)
        assert isinstance(info.value, KeyError) and isinstance(info.value, AglError)
    for call in [
        lambda: store.heartbeat(rollout.rollout_id, "at-missing"),
        lambda: store.complete_attempt(rollout.rollout_id, "at-missing", "succeeded"),
        lambda: store.query_spans(rollout.rollout_id, "at-missing"),
        lambda: store.add_spans([make_span(rollout, attempt_id="at-missing")]),
    ]:
        with pytest.raises(UnknownAttemptError, match="'at-missing'.*rollout.attempt.attempt_id"):
            call()
    with pytest.raises(UnknownResourcesError, match="'res-missing'"):
        store.get_resources("res-missing")
    assert store.get_rollout(rollout.rollout_id) == rollout


# -- cancel ------------------------------------------------------------------------------------------------


def test_cancel_running_rollout_ends_its_attempt(store: LightningStore) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=3))
    live = claim(store)
    cancelled = store.cancel_rollout(live.rollout_id)
    assert (cancelled.status, cancelled.attempt and cancelled.attempt.status) == ("cancelled", "cancelled")
    assert cancelled.end_time is not None
    with pytest.raises(StaleAttemptError, match="'cancelled'"):
        store.complete_attempt(live.rollout_id, aid(live), "failed")
    assert store.cancel_rollout(live.rollout_id) == cancelled, "cancelling twice is harmless"
    assert store.dequeue_rollout("runner-1") is None, "a cancelled rollout is not retried"


def test_cancel_queued_rollout_is_never_dequeued(store: LightningStore) -> None:
    first, second = store.enqueue_many([EnqueueRequest(input=1), EnqueueRequest(input=2)])
    cancelled = store.cancel_rollout(first.rollout_id)
    assert cancelled.status == "cancelled" and cancelled.attempt is None
    assert [r.rollout_id for r in store.dequeue_many("runner-1", 5)] == [second.rollout_id]


def test_cancel_finished_rollout_is_illegal(store: LightningStore) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded")
    with pytest.raises(IllegalTransitionError, match="already 'succeeded'"):
        store.cancel_rollout(rollout.rollout_id)


# -- expiry ------------------------------------------------------------------------------------------------


# These check what happens when a deadline passes, not how fast anything is: the deadlines are short so
# the tests stay quick, with margins wide enough for the HTTP and PostgreSQL backends on a busy machine.
EXPIRY_S = 0.3


def test_timeout_expires_and_retries(store: LightningStore) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, timeout_seconds=EXPIRY_S))
    first = claim(store)
    assert store.reap_expired() == []
    time.sleep(EXPIRY_S + 0.05)
    (requeued,) = store.reap_expired()
    assert requeued.rollout_id == first.rollout_id and requeued.status == "queued"
    assert requeued.attempt is not None and requeued.attempt.status == "timeout"
    assert "timeout_seconds" in (requeued.attempt.error or "")
    with pytest.raises(StaleAttemptError, match="'timeout'"):
        store.complete_attempt(first.rollout_id, aid(first), "succeeded")
    second = claim(store)
    assert second.attempt is not None and second.attempt.sequence == 2
    time.sleep(EXPIRY_S + 0.05)
    (failed,) = store.reap_expired()
    assert failed.status == "failed" and "timeout_seconds" in (failed.error or "")
    assert [a.status for a in store.query_attempts(first.rollout_id)] == ["timeout", "timeout"]


def test_heartbeat_timeout_marks_unresponsive(store: LightningStore) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(heartbeat_timeout_seconds=EXPIRY_S))
    rollout = claim(store)
    time.sleep(EXPIRY_S + 0.05)
    (failed,) = store.reap_expired()
    assert failed.status == "failed" and failed.attempt is not None and failed.attempt.status == "unresponsive"
    assert "heartbeat_timeout_seconds" in (failed.error or "")
    with pytest.raises(StaleAttemptError):
        store.heartbeat(rollout.rollout_id, aid(rollout))


def test_heartbeats_keep_an_attempt_alive(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(heartbeat_timeout_seconds=0.5))
    rollout = claim(store)
    for i in range(4):
        time.sleep(0.1)
        if i % 2:
            store.heartbeat(rollout.rollout_id, aid(rollout))
        else:
            store.add_spans([make_span(rollout, i)])  # a span counts as a heartbeat
        assert store.reap_expired() == []
    assert store.get_rollout(rollout.rollout_id).status == "running"


def test_renew_heartbeats_gives_running_attempts_a_new_heartbeat_deadline_only(store: LightningStore) -> None:
    """What the store server does when it starts (its runners could not beat while it was down): every running
    attempt with a heartbeat timeout counts as having just beaten; a wall-time timeout is not extended, and a
    runner that stays silent is still ended, one heartbeat timeout later."""
    silent = store.enqueue_rollout("silent", config=RolloutConfig(heartbeat_timeout_seconds=1.0))
    walled = store.enqueue_rollout("walled", config=RolloutConfig(heartbeat_timeout_seconds=30, timeout_seconds=1.0))
    store.enqueue_rollout("forever")  # no heartbeat timeout: nothing to renew
    queued = store.enqueue_rollout("queued", config=RolloutConfig(heartbeat_timeout_seconds=1.0))
    claimed = store.dequeue_many("runner-1", 3)
    assert len(claimed) == 3
    time.sleep(0.6)
    assert store.renew_heartbeats() == 2
    (beaten,) = [a for a in store.query_attempts(silent.rollout_id)]
    assert beaten.last_heartbeat >= beaten.start_time + 0.5
    time.sleep(0.6)  # past the silent attempt's first deadline, before its renewed one
    store.reap_expired()  # (a store server's timer may have reaped first: the outcome is what counts)
    assert [a.status for a in store.query_attempts(walled.rollout_id)] == ["timeout"]
    assert store.get_rollout(silent.rollout_id).status == "running"
    time.sleep(0.5)
    store.reap_expired()
    assert [a.status for a in store.query_attempts(silent.rollout_id)] == ["unresponsive"]
    assert store.get_rollout(queued.rollout_id).status == "queued"
    assert store.renew_heartbeats() == 0


def test_dequeue_reaps_expired_attempts_itself(store: LightningStore) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, timeout_seconds=0.05))
    first = claim(store)
    time.sleep(0.1)
    again = claim(store, "runner-2")
    assert again.rollout_id == first.rollout_id
    assert again.attempt is not None and (again.attempt.sequence, again.attempt.runner_id) == (2, "runner-2")


def test_wait_for_rollouts_reaps_without_other_activity(store: LightningStore) -> None:
    """A waiter wakes up at the next deadline by itself: an abandoned attempt cannot hang the trainer."""
    store.enqueue_rollout("x", config=RolloutConfig(timeout_seconds=0.1))
    rollout = claim(store)
    (done,) = store.wait_for_rollouts([rollout.rollout_id], timeout=30)
    assert done.status == "failed" and done.attempt is not None and done.attempt.status == "timeout"


# -- waiting -----------------------------------------------------------------------------------------------


def _in_thread(target: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_wait_for_rollouts_wakes_when_another_thread_completes(store: LightningStore) -> None:
    ids = [r.rollout_id for r in store.enqueue_many([EnqueueRequest(input=i) for i in range(3)])]
    claimed = store.dequeue_many("runner-1", 3)

    def finish() -> None:
        for i, rollout in enumerate(claimed):
            time.sleep(0.05)
            if i == 1:
                store.cancel_rollout(rollout.rollout_id)
            else:
                store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded", reward=float(i))

    thread = _in_thread(finish)
    done = store.wait_for_rollouts(list(reversed(ids)), timeout=30)
    thread.join()
    assert [r.rollout_id for r in done] == list(reversed(ids))
    assert [r.status for r in done] == ["succeeded", "cancelled", "succeeded"]


def test_wait_for_rollouts_returns_the_terminal_ones_on_timeout(store: LightningStore) -> None:
    finished, pending = store.enqueue_many([EnqueueRequest(), EnqueueRequest()])
    rollout = claim(store)
    store.complete_attempt(rollout.rollout_id, aid(rollout), "succeeded")
    done = store.wait_for_rollouts([pending.rollout_id, finished.rollout_id], timeout=0.05)
    assert [r.rollout_id for r in done] == [finished.rollout_id]
    assert store.wait_for_rollouts([pending.rollout_id], timeout=0) == []
    assert store.wait_for_rollouts([]) == []


def test_dequeue_with_timeout_wakes_when_another_thread_enqueues(store: LightningStore) -> None:
    def enqueue_later() -> None:
        time.sleep(0.1)
        store.enqueue_rollout("late")

    thread = _in_thread(enqueue_later)
    rollout = store.dequeue_rollout("runner-1", timeout=30)
    thread.join()
    assert rollout is not None and rollout.input == "late" and rollout.status == "running"


def test_dequeue_with_timeout_gives_up(store: LightningStore) -> None:
    assert store.dequeue_many("runner-1", 2, timeout=0.05) == []


# -- spans -------------------------------------------------------------------------------------------------


def test_spans_are_returned_by_sequence_id(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    spans = [make_span(rollout, i) for i in (2, 0, 1)]
    assert store.add_spans(spans) == 3
    assert store.query_spans(rollout.rollout_id) == sorted(spans, key=lambda s: s.sequence_id)
    assert store.query_spans(rollout.rollout_id, aid(rollout)) == sorted(spans, key=lambda s: s.sequence_id)
    assert store.add_spans([]) == 0


def test_non_finite_attribute_values_come_back_as_they_were_made(store: LightningStore, make_span: MakeSpan) -> None:
    """A -inf logprob is data: every backend (and the HTTP wire both ways) returns it, and NaN, unchanged.
    Before, SQLite and PostgreSQL kept them while the in-memory store and the HTTP client turned them to null."""
    store.enqueue_rollout("x")
    rollout = claim(store)
    values = {"logprobs": [-0.5, float("-inf")], "nan": float("nan"), "inf": float("inf")}
    assert store.add_spans([make_span(rollout, 0, attributes=values)]) == 1
    (stored,) = store.query_spans(rollout.rollout_id)
    got = stored.attributes
    assert got["logprobs"] == [-0.5, float("-inf")] and got["inf"] == float("inf") and math.isnan(got["nan"])


def test_query_spans_of_a_rollout_never_dequeued_is_empty(store: LightningStore) -> None:
    rollout = store.enqueue_rollout("x")
    assert store.query_spans(rollout.rollout_id) == []
    assert store.query_spans(rollout.rollout_id, None) == []


def test_span_readd_is_ignored_never_overwritten(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    original = make_span(rollout, 0, span_id="00000000000000aa", attributes={"v": "first"})
    changed = original.model_copy(update={"attributes": {"v": "second"}, "name": "renamed"})
    assert store.add_spans([original]) == 1
    assert store.add_spans([changed, make_span(rollout, 1)]) == 1
    assert store.add_spans([original, original]) == 0
    stored = store.query_spans(rollout.rollout_id)
    assert [s.attributes for s in stored] == [{"v": "first"}, {"gen_ai.request.model": "tiny", "n": 1}]
    assert stored[0] == original
    assert store.stats().spans == 2


def test_spans_of_unknown_ids_store_nothing_of_the_batch(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_rollout("x")
    rollout = claim(store)
    ghost = rollout.model_copy(update={"rollout_id": "ro-ghost"})
    with pytest.raises(UnknownRolloutError, match="'ro-ghost'"):
        store.add_spans([make_span(rollout, 0), make_span(ghost, 1)])
    with pytest.raises(UnknownAttemptError):
        store.add_spans([make_span(rollout, 0), make_span(rollout, 1, attempt_id="at-ghost")])
    with pytest.raises(InvalidSpanError, match="JSON"):
        store.add_spans([make_span(rollout, 0), make_span(rollout, 1, attributes={"bad": object()})])
    with pytest.raises(InvalidSpanError, match="Span objects"):
        store.add_spans([make_span(rollout, 0), {"span_id": "x"}])  # type: ignore[list-item]
    assert store.query_spans(rollout.rollout_id) == [] and store.stats().spans == 0


# -- NUL characters (PostgreSQL's text cannot hold them; the rule is in agl.store._rules) ----------------------


def failed_span_holding(span: Span, odd: str, error: str) -> Span:
    """``span`` failed with ``error``, with ``odd`` (text a backend may not store as it is) in its name and in
    an event's name and attribute."""
    event = SpanEvent(name=f"e{odd}", timestamp=1, attributes={"v": odd})
    return span.model_copy(update={"name": f"tool{odd}call", "status": "error", "error": error, "events": [event]})


def test_nul_in_free_text_is_replaced_and_json_values_keep_it(store: LightningStore, make_span: MakeSpan) -> None:
    """An agent error or span name with a NUL made PostgreSQL refuse the completion (the runner died, the rollout
    waited for its heartbeat timeout) and the span batch; SQLite and memory kept it. Every backend now keeps free
    text with NUL replaced by U+FFFD, and JSON values (where NUL is the escape \\u0000) exactly."""
    store.enqueue_rollout({"text": "a\x00b"}, metadata={"m\x00": "\x00"})
    rollout = claim(store)
    assert rollout.input == {"text": "a\x00b"} and rollout.metadata == {"m\x00": "\x00"}
    output = {"gen_ai.completion": "model said \x00", "k\x00": ["\x00"]}
    span = failed_span_holding(make_span(rollout, 0, attributes=output), "\x00", error="bad \x00 bytes")
    assert store.add_spans([make_span(rollout, 1), span]) == 2
    stored = store.query_spans(rollout.rollout_id)[0]
    assert (stored.name, stored.error) == ("tool\ufffdcall", "bad \ufffd bytes")
    assert stored.attributes == output and stored.events == span.events
    failed = store.complete_attempt(rollout.rollout_id, aid(rollout), "failed", error="RuntimeError: b'\x00\x01'")
    assert failed.status == "failed" and failed.error == "RuntimeError: b'\ufffd\x01'"
    assert failed.attempt is not None and failed.attempt.error == failed.error
    assert store.get_rollout(rollout.rollout_id) == failed
    assert store.query_rollouts(rollout_ids=[rollout.rollout_id])[0].input == {"text": "a\x00b"}
    store.add_resources({"p": PromptTemplate(template="\x00{q}")})
    assert store.get_resources().resources["p"].template == "\x00{q}"  # type: ignore[union-attr]


# (what is refused, then the bad characters of: a task id, a resources id, a runner id, a resources id, a span id)
BAD_IDS = {
    "nul": ("NUL", "\x00", "\x00", "\x00", "\x00", "\x00"),
    "lone-surrogates": ("lone surrogate", "\ud83d", "\udc00", "\ud83d", "\ud83d", "\ud83d"),
}


@pytest.mark.parametrize("bad_ids", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_ids_with_nul_or_lone_surrogates_are_refused_alike_and_store_nothing(
    store: LightningStore, make_span: MakeSpan, bad_ids: Tuple[str, ...]
) -> None:
    """NUL: SQLite and memory kept them, PostgreSQL refused them (422 over HTTP). Lone surrogates: SQLite and
    PostgreSQL raised UnicodeEncodeError (HTTP: a pydantic serialisation error), memory kept them. Now every
    backend refuses them."""
    refused, task, resources, runner, resources_again, span_id = bad_ids
    store.enqueue_rollout("x")
    rollout = claim(store)
    for bad in ({"task_id": "t" + task}, {"resources_id": "res-" + resources}):
        with pytest.raises(ValueError, match=refused):
            store.enqueue_many([EnqueueRequest(input=1), EnqueueRequest(input=2, **bad)])
    with pytest.raises(ValueError, match=refused):
        store.dequeue_rollout("runner-" + runner)
    with pytest.raises(ValueError, match=refused):
        store.add_resources({}, resources_id="res-" + resources_again)
    for field in ("span_id", "trace_id", "parent_id"):
        bad_span = make_span(rollout, 1).model_copy(update={field: "00" + span_id})
        with pytest.raises(InvalidSpanError, match=f"{refused}.*{field}"):
            store.add_spans([make_span(rollout, 0), bad_span])
    stats = store.stats()
    assert (stats.rollouts["queued"], stats.rollouts["running"], stats.spans, stats.resources_versions) == (0, 1, 0, 0)


# -- lone surrogates (no UTF-8 text can hold them; the same rule as NUL) -----------------------------------


def test_lone_surrogates_in_free_text_and_json_values_become_u_fffd(store: LightningStore, make_span: MakeSpan) -> None:
    """An agent error quoting a cut-off model reply ("\\ud83d", half an emoji) crashed complete_attempt with
    UnicodeEncodeError on SQLite and PostgreSQL (the runner died, the rollout waited for its heartbeat timeout)
    and memory kept it; a span whose name or attributes held one was refused by every backend. Now every backend
    keeps them with each lone surrogate replaced by U+FFFD (a split pair becomes its character)."""
    store.enqueue_rollout({"text": "cut \ud83d"}, metadata={"m\udc00": ["\ud83d"]})
    rollout = claim(store)
    assert rollout.input == {"text": "cut \ufffd"} and rollout.metadata == {"m\ufffd": ["\ufffd"]}
    span = make_span(rollout, 0, attributes={"gen_ai.completion": "model said \ud83d", "k\udc00": ["\ud83d", 1]})
    span = failed_span_holding(span, "\ud83d", error="pair \ud83d\ude00 lone \udc00 nul \x00")
    assert store.add_spans([make_span(rollout, 1), span]) == 2
    stored = next(s for s in store.query_spans(rollout.rollout_id) if s.span_id == span.span_id)
    assert (stored.name, stored.error) == ("tool\ufffdcall", "pair \U0001f600 lone \ufffd nul \ufffd")
    assert stored.attributes == {"gen_ai.completion": "model said \ufffd", "k\ufffd": ["\ufffd", 1]}
    assert stored.events == [SpanEvent(name="e\ufffd", timestamp=1, attributes={"v": "\ufffd"})]
    failed = store.complete_attempt(rollout.rollout_id, aid(rollout), "failed", error="ValueError: said \ud83d")
    assert failed.status == "failed" and failed.error == "ValueError: said \ufffd"
    assert failed.attempt is not None and failed.attempt.error == failed.error
    assert store.get_rollout(rollout.rollout_id) == failed
    store.add_resources({"p": PromptTemplate(template="\ud83d{q}")})
    assert store.get_resources().resources["p"].template == "\ufffd{q}"  # type: ignore[union-attr]


@pytest.mark.parametrize("field", ["sequence_id", "start_time", "end_time"])
def test_span_integers_beyond_64_bits_are_refused_alike(store: LightningStore, make_span: MakeSpan, field: str) -> None:
    """SQLite raised a raw OverflowError (which the span writer would retry for ever), memory kept the span and
    HTTP answered 422: every backend now refuses the batch with InvalidSpanError naming the field."""
    store.enqueue_rollout("x")
    rollout = claim(store)
    bad_span = make_span(rollout, 1).model_copy(update={field: 2**63})
    with pytest.raises(InvalidSpanError, match=f"{field}={2**63}.*64-bit"):
        store.add_spans([make_span(rollout, 0), bad_span])
    assert store.stats().spans == 0
    assert store.add_spans([make_span(rollout, 2).model_copy(update={field: 2**63 - 1})]) == 1


def test_span_refreshes_heartbeat_of_running_attempt(store: LightningStore, make_span: MakeSpan) -> None:
    # a heartbeat older than a tenth of the heartbeat timeout is always rewritten (see span_heartbeat_due)
    store.enqueue_rollout("x", config=RolloutConfig(heartbeat_timeout_seconds=0.3))
    rollout = claim(store)
    assert rollout.attempt is not None
    time.sleep(0.05)
    store.add_spans([make_span(rollout, 0)])
    (attempt,) = store.query_attempts(rollout.rollout_id)
    assert attempt.last_heartbeat > rollout.attempt.last_heartbeat


def test_spans_of_failed_attempt_are_kept_apart_from_the_retry(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2))
    first = claim(store)
    first_spans = [make_span(first, i) for i in range(2)]
    store.add_spans(first_spans)
    fail(store, first)
    late = make_span(first, 2)
    assert store.add_spans([late]) == 1, "late spans of an ended attempt (a flush after timeout) are kept"
    ended = store.query_attempts(first.rollout_id)[0]
    assert ended.status == "failed"
    second = claim(store)
    assert store.query_spans(second.rollout_id) == [], "the retry starts with no spans"
    second_spans = [make_span(second, i) for i in range(3)]
    store.add_spans(second_spans)
    assert store.query_spans(second.rollout_id) == second_spans
    assert store.query_spans(second.rollout_id, "latest") == second_spans
    assert store.query_spans(first.rollout_id, aid(first)) == first_spans + [late]
    assert store.query_spans(first.rollout_id, None) == first_spans + [late] + second_spans


def test_delete_spans_of_finished_rollouts_keeps_the_rollouts(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_many([EnqueueRequest(input=i, config=RolloutConfig(max_attempts=2)) for i in range(4)])
    retried, done, kept, cancelled = store.dequeue_many("runner-1", 4)
    store.add_spans([make_span(retried, 0), make_span(done, 0), make_span(done, 1), make_span(kept, 0)])
    fail(store, retried)
    again = claim(store)
    store.add_spans([make_span(again, 0)])
    store.complete_attempt(again.rollout_id, aid(again), "failed", error="twice")
    store.complete_attempt(done.rollout_id, aid(done), "succeeded", reward=1.0)
    store.complete_attempt(kept.rollout_id, aid(kept), "succeeded", reward=0.5)
    store.cancel_rollout(cancelled.rollout_id)
    before = {r.rollout_id: r for r in store.query_rollouts()}

    ids = [retried.rollout_id, done.rollout_id, cancelled.rollout_id, done.rollout_id]
    assert store.delete_spans(ids) == 4, "every attempt's spans (the failed first attempt's too), each id once"
    assert store.query_spans(retried.rollout_id, None) == []
    assert store.query_spans(done.rollout_id) == []
    assert len(store.query_spans(kept.rollout_id)) == 1, "other rollouts keep theirs"
    assert {r.rollout_id: r for r in store.query_rollouts()} == before, "rollouts, rewards, attempts stay as they were"
    assert store.stats().spans == 1
    assert store.delete_spans(ids) == 0, "deleting again deletes nothing"
    assert store.delete_spans([]) == 0


def test_delete_spans_refuses_live_or_unknown_rollouts_and_deletes_nothing(
    store: LightningStore, make_span: MakeSpan
) -> None:
    store.enqueue_many([EnqueueRequest(input=i) for i in range(3)])
    done, running = store.dequeue_many("runner-1", 2)
    store.add_spans([make_span(done, 0), make_span(running, 0)])
    store.complete_attempt(done.rollout_id, aid(done), "succeeded")
    (queued,) = store.query_rollouts(status=["queued"])
    for live, status in ((running, "running"), (queued, "queued")):
        with pytest.raises(IllegalTransitionError, match=f"it is {status}.*finished rollouts only"):
            store.delete_spans([done.rollout_id, live.rollout_id])
    with pytest.raises(UnknownRolloutError, match="nope"):
        store.delete_spans([done.rollout_id, "nope"])
    assert len(store.query_spans(done.rollout_id)) == 1, "a refused call deletes nothing of its list"
    assert len(store.query_spans(running.rollout_id)) == 1
    assert store.stats().spans == 2


# -- resources ---------------------------------------------------------------------------------------------


def test_resources_versions(store: LightningStore) -> None:
    assert store.get_resources() is None
    updates = [store.add_resources({"llm": LLM(endpoint=f"http://host-{i}/v1", model="m")}) for i in range(3)]
    assert [u.version for u in updates] == [1, 2, 3]
    assert len({u.resources_id for u in updates}) == 3
    assert store.get_resources() == updates[-1]
    assert store.get_resources(updates[0].resources_id) == updates[0]
    with pytest.raises(UnknownResourcesError, match="add_resources"):
        store.get_resources("res-missing")
    assert store.stats().resources_versions == 3


def test_resources_from_dicts_and_explicit_ids(store: LightningStore) -> None:
    raw: Dict[str, Any] = {
        "llm": {"endpoint": "http://x/v1", "model": "m", "sampling_parameters": {"temperature": 0.5}},
        "proxy": {"resource_type": "proxy_llm", "endpoint": "http://p/v1", "model": "m"},
        "prompt": {"resource_type": "prompt_template", "template": "Q: {q}"},
    }
    update = store.add_resources(raw, resources_id="res-initial")
    assert update.resources_id == "res-initial" and update.version == 1
    stored = store.get_resources("res-initial")
    assert stored is not None and stored == update
    assert isinstance(stored.resources["llm"], LLM) and stored.resources["llm"].sampling_parameters == {
        "temperature": 0.5
    }
    assert type(stored.resources["proxy"]).__name__ == "ProxyLLM"
    assert (
        isinstance(stored.resources["prompt"], PromptTemplate) and stored.resources["prompt"].format(q="hi") == "Q: hi"
    )
    with pytest.raises(DuplicateResourcesError, match="never overwritten"):
        store.add_resources({}, resources_id="res-initial")
    assert store.get_resources() == update


# -- queries and stats -------------------------------------------------------------------------------------


def test_query_rollouts_filters_in_enqueue_order(store: LightningStore) -> None:
    rollouts = store.enqueue_many(
        [EnqueueRequest(input=i, task_id=f"task-{i % 2}", mode="val" if i == 3 else "train") for i in range(5)]
    )
    ids = [r.rollout_id for r in rollouts]
    running = claim(store)
    assert [r.rollout_id for r in store.query_rollouts()] == ids
    assert [r.rollout_id for r in store.query_rollouts(status=["running"])] == [running.rollout_id]
    assert store.query_rollouts(status=["running"])[0] == running
    assert [r.rollout_id for r in store.query_rollouts(status=["queued", "succeeded"])] == ids[1:]
    assert [r.rollout_id for r in store.query_rollouts(task_id="task-1")] == [ids[1], ids[3]]
    assert [r.rollout_id for r in store.query_rollouts(mode="val")] == [ids[3]]
    assert [r.rollout_id for r in store.query_rollouts(rollout_ids=[ids[4], ids[0], "ro-missing"])] == [ids[0], ids[4]]
    assert [r.rollout_id for r in store.query_rollouts(limit=2, offset=1)] == ids[1:3]
    assert store.query_rollouts(status=[]) == []


def test_stats_count_everything(store: LightningStore, make_span: MakeSpan) -> None:
    store.enqueue_many([EnqueueRequest(config=RolloutConfig(max_attempts=2)) for _ in range(4)])
    a, b, c = store.dequeue_many("runner-1", 3)
    store.complete_attempt(a.rollout_id, aid(a), "succeeded")
    fail(store, b)
    store.cancel_rollout(c.rollout_id)
    store.add_spans([make_span(a, 0), make_span(a, 1), make_span(b, 0)])
    store.add_resources({})
    stats = store.stats()
    assert stats.rollouts == {"queued": 2, "running": 0, "succeeded": 1, "failed": 0, "cancelled": 1}
    assert (stats.attempts, stats.spans, stats.resources_versions) == (3, 3, 1)


def test_closed_store_refuses_calls(store: LightningStore) -> None:
    store.enqueue_rollout("x")
    store.close()
    store.close()
    with pytest.raises(StoreClosedError, match="closed"):
        store.query_rollouts()
    with pytest.raises(StoreClosedError):
        store.enqueue_rollout("y")
