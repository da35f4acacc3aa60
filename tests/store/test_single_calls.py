"""Single store calls (one rollout enqueued, dequeued, completed): what they cost the database, and that the
shortcuts taking them there answer as the general paths do.

A single call's time is mostly its commit (SQLite) or its round trip and commit (PostgreSQL), so the cost is
asserted as what the database is asked: the statements SQLite runs for a call, the round trips PostgreSQL
makes (counted by a real TCP proxy in front of the server). Behaviour is asserted on every backend."""

from __future__ import annotations

import socket
import threading
from typing import Callable, Iterator, List, Tuple, TypeVar
from urllib.parse import urlsplit

import pytest
from local_tcp_listener import Forwarder

from agl.errors import DuplicateRolloutError, UnknownResourcesError
from agl.store import EnqueueRequest, LightningStore, SqliteLightningStore
from agl.store.postgres.store import PostgresLightningStore
from agl.types import LLM, RolloutConfig

T = TypeVar("T")


def _statements(store: SqliteLightningStore, call: Callable[[], object]) -> List[str]:
    """The first two words of each statement SQLite runs on this thread's connection during ``call()``."""
    ran: List[str] = []
    conn = store._conn()
    conn.set_trace_callback(lambda sql: ran.append(" ".join(sql.split()[:2])))
    try:
        call()
    finally:
        conn.set_trace_callback(None)
    return ran


def test_a_sqlite_enqueue_is_one_insert_in_one_transaction(sqlite_store: SqliteLightningStore) -> None:
    sqlite_store.enqueue_rollout("warm")
    ran = _statements(sqlite_store, lambda: sqlite_store.enqueue_rollout("x"))
    assert ran == ["BEGIN IMMEDIATE", "INSERT INTO", "COMMIT"], "the queue position is part of the INSERT"


def test_a_sqlite_dequeue_reads_once_then_claims_in_one_transaction(sqlite_store: SqliteLightningStore) -> None:
    sqlite_store.enqueue_many([EnqueueRequest(input=i) for i in range(2)])
    sqlite_store.dequeue_rollout("warm")
    ran = _statements(sqlite_store, lambda: sqlite_store.dequeue_rollout("runner-1"))
    # one read: anything to reap, anything queued; the claim's read also gives the last attempt's aid
    assert ran == [
        "SELECT (SELECT",
        "BEGIN IMMEDIATE",
        "SELECT r.rollout_id,",
        "UPDATE rollouts",
        "INSERT INTO",
        "COMMIT",
    ]


class RoundTripCounter(Forwarder):
    """A TCP proxy on 127.0.0.1 in front of a PostgreSQL server, counting round trips: each time the server
    answers after the client has sent something."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.round_trips = 0
        self._client_spoke = False
        self._lock = threading.Lock()
        super().__init__()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:  # counted before it is forwarded: before the client can see the answer
                    if from_client:
                        self._client_spoke = True
                    elif self._client_spoke:
                        self.round_trips += 1
                        self._client_spoke = False
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            sock.close()


@pytest.fixture
def counted(postgres_dsn: str) -> Iterator[tuple]:
    """(the round-trip counter, a store reaching its database through it)."""
    parts = urlsplit(postgres_dsn)
    proxy = RoundTripCounter(parts.port or 5432)
    store = PostgresLightningStore(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}").geturl())
    yield proxy, store
    store.close()
    proxy.close()


def test_each_single_postgres_call_of_a_rollout_cycle_is_one_round_trip(counted: tuple) -> None:
    proxy, store = counted

    def round_trips(call: Callable[[], T]) -> Tuple[int, T]:
        before = proxy.round_trips
        result = call()
        return proxy.round_trips - before, result

    def cycle() -> List[int]:
        """Round trips of: an enqueue, a dequeue that claims it, one that finds nothing, the completion."""
        enqueue, _ = round_trips(lambda: store.enqueue_rollout("x"))
        claim, rollout = round_trips(lambda: store.dequeue_rollout("runner-1"))
        empty, _ = round_trips(lambda: store.dequeue_rollout("runner-1"))
        assert rollout is not None and rollout.attempt is not None
        attempt_id = rollout.attempt.attempt_id
        complete, _ = round_trips(lambda: store.complete_attempt(rollout.rollout_id, attempt_id, "succeeded"))
        return [enqueue, claim, empty, complete]

    for _ in range(6):  # psycopg prepares a statement at its fifth execution, in a round trip of its own
        cycle()
    assert cycle() == [1, 1, 1, 1], "enqueue, dequeue (claiming, finding nothing), complete: one statement each"


# -- behaviour of one rollout enqueued, on every backend ---------------------------------------------------------


def test_one_enqueue_reads_back_as_it_was_returned(store: LightningStore) -> None:
    config = RolloutConfig(max_attempts=3, timeout_seconds=60.5, heartbeat_timeout_seconds=7)
    enqueued = store.enqueue_rollout({"q": [1, "two"]}, task_id="task-7", mode="val", config=config, metadata={"k": 1})
    assert enqueued.status == "queued" and enqueued.attempt is None and enqueued.task_id == "task-7"
    assert store.get_rollout(enqueued.rollout_id) == enqueued


def test_one_enqueue_of_unknown_resources_is_refused_and_stores_nothing(store: LightningStore) -> None:
    with pytest.raises(UnknownResourcesError, match="'res-missing'.*add_resources"):
        store.enqueue_rollout("x", resources_id="res-missing")
    assert sum(store.stats().rollouts.values()) == 0
    update = store.add_resources({"llm": LLM(endpoint="http://x/v1", model="m")})
    enqueued = store.enqueue_rollout("x", resources_id=update.resources_id)
    assert store.get_rollout(enqueued.rollout_id).resources_id == update.resources_id


def test_one_enqueue_of_a_stored_rollout_id_is_refused_and_changes_nothing(store: LightningStore) -> None:
    [mine] = store.enqueue_many([EnqueueRequest(rollout_id="ro-mine", input=1)])
    with pytest.raises(DuplicateRolloutError, match="'ro-mine'"):
        store.enqueue_many([EnqueueRequest(rollout_id="ro-mine", input=2)])
    assert store.query_rollouts() == [mine]


def test_single_and_batched_enqueues_are_dequeued_in_enqueue_order(store: LightningStore) -> None:
    first = store.enqueue_rollout(1)
    batch = store.enqueue_many([EnqueueRequest(input=2), EnqueueRequest(input=3)])
    last = store.enqueue_rollout(4)
    claimed = [store.dequeue_rollout("runner-1") for _ in range(4)]
    assert [r.rollout_id for r in claimed if r is not None] == [r.rollout_id for r in [first, *batch, last]]
