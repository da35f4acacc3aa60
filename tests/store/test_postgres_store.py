"""What only the PostgreSQL store promises, on a real server: many machines on one database, LISTEN/NOTIFY
wake-ups, reconnecting after lost sessions and a server restart, fork safety, the schema version; and
``open_store`` for ``postgresql://`` URLs. (The contract itself runs in test_store_contract.py.)

"Two machines" are two store objects on one database: they share nothing but the server, as two hosts would.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List
from urllib.parse import urlsplit

import psycopg
import pytest
from claim_race import drain, drain_in_forked_processes

import agl.testing.postgres
from agl.errors import (
    AglError,
    DuplicateRolloutError,
    StaleAttemptError,
    StoreClosedError,
    StoreUnavailableError,
    UnknownAttemptError,
    UnknownResourcesError,
    UnknownRolloutError,
)
from agl.store import EnqueueRequest, open_store
from agl.store.postgres.schema import INSERT_ROLLOUT, claim_statement
from agl.store.postgres.store import PostgresLightningStore
from agl.testing.postgres import (
    PostgresServer,
    PostgresUnavailableError,
    TemporaryPostgres,
    remove_abandoned_folders,
)
from agl.types import LLM, Rollout, RolloutConfig

fork = multiprocessing.get_context("fork")
MakeSpan = Callable[..., Any]


def _dbname(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


@pytest.fixture
def machines(postgres_dsn: str) -> Iterator[List[PostgresLightningStore]]:
    """Two store objects on one database."""
    stores = [PostgresLightningStore(postgres_dsn, max_connections=4) for _ in range(2)]
    yield stores
    for store in stores:
        store.close()


def _count_claims(store: PostgresLightningStore, monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Count every look at the queue ``store`` makes (a polling waiter would make many)."""
    calls = [0]
    claim = store._claim

    def counted(runner_id: str, limit: int) -> Any:
        calls[0] += 1
        return claim(runner_id, limit)

    monkeypatch.setattr(store, "_claim", counted)
    return calls


# sessions of this database waiting for a lock another transaction holds
_LOCK_WAITERS = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


# -- many machines -----------------------------------------------------------------------------------------


def test_two_machines_claim_disjoint_rollouts_under_contention(machines: List[PostgresLightningStore]) -> None:
    ids = {r.rollout_id for r in machines[0].enqueue_many([EnqueueRequest(input=i) for i in range(300)])}
    start = threading.Event()
    claimed: List[List[str]] = [[] for _ in range(8)]  # four runner threads per machine
    threads = [
        threading.Thread(target=drain, args=(machines[i % 2], f"machine-{i % 2}-runner-{i}", claimed[i], start))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    start.set()
    for thread in threads:
        thread.join(120)
    everything = [rollout_id for per_runner in claimed for rollout_id in per_runner]
    assert len(everything) == len(set(everything)) == 300 and set(everything) == ids
    per_machine = [sum(len(claimed[i]) for i in range(m, 8, 2)) for m in (0, 1)]
    assert all(per_machine), f"both machines should have claimed work: {per_machine}"
    for store in machines:  # both see the same final state
        stats = store.stats()
        assert stats.rollouts["succeeded"] == 300 and stats.attempts == 300


def test_forked_processes_share_the_store_object(
    postgres_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresLightningStore(postgres_dsn)
    ids = {r.rollout_id for r in store.enqueue_many([EnqueueRequest(input=i) for i in range(120)])}
    store.get_rollout(next(iter(ids)))  # the parent holds an open pooled connection across the fork
    claimed = drain_in_forked_processes(store, tmp_path, close_in_child=True)
    assert len(claimed) == len(set(claimed)) == 120 and set(claimed) == ids
    with caplog.at_level(logging.WARNING, logger="agl.store.postgres.store"):
        assert store.stats().rollouts["succeeded"] == 120
    assert "retrying" not in caplog.text, "the children must not have closed the parent's connection"
    store.close()


def test_store_pickles_as_its_dsn_and_hides_the_password(postgres_dsn: str) -> None:
    parts = urlsplit(postgres_dsn)
    with_password = parts._replace(netloc=f"agl:s3cret@{parts.hostname}:{parts.port}").geturl()
    store = PostgresLightningStore(with_password)  # the test server trusts 127.0.0.1: any password works
    rollout = store.enqueue_rollout("x")
    assert "s3cret" not in repr(store) and _dbname(postgres_dsn) in repr(store)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_rollout(rollout.rollout_id) == rollout
    clone.close()
    store.close()


# -- waking ------------------------------------------------------------------------------------------------


def test_enqueue_on_another_machine_wakes_a_waiting_dequeue(
    machines: List[PostgresLightningStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    waiter, other = machines
    claims = _count_claims(waiter, monkeypatch)
    got: Dict[str, Any] = {}

    def wait() -> None:
        got["rollout"] = waiter.dequeue_rollout("runner-1", timeout=60)
        got["at"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    _until(lambda: claims[0] >= 2, "the waiter looked at the queue twice (before and after LISTEN)")
    time.sleep(0.3)
    assert claims[0] == 2, "a waiting dequeue must sleep until notified, not poll the database"
    sent = time.monotonic()
    rollout = other.enqueue_rollout("wake up")
    thread.join(60)
    assert got["rollout"] is not None and got["rollout"].rollout_id == rollout.rollout_id
    assert got["at"] - sent < 10, "woken by the notification, not by its 60 s timeout"
    assert claims[0] == 3


def _commit_once_waited_for(dsn: str, holder: psycopg.Connection, target: Callable[[], None], what: str) -> None:
    """Runs ``target`` on a thread until it waits for a lock (``what``) that ``holder``, another machine's open
    transaction, holds; then commits ``holder`` and lets ``target`` finish."""
    watcher = psycopg.connect(dsn, autocommit=True)
    thread = threading.Thread(target=target)
    thread.start()
    _until(lambda: watcher.execute(_LOCK_WAITERS).fetchone()[0] >= 1, what)
    holder.commit()
    watcher.close()
    thread.join(30)


def test_a_completion_waiting_behind_another_machines_reap_is_refused(machines: List[PostgresLightningStore]) -> None:
    """The reap commits while the completion waits for the rollout's lock: the completion must see the reap."""
    runner, _ = machines
    runner.enqueue_rollout("x", config=RolloutConfig(max_attempts=2))
    rollout = runner.dequeue_rollout("runner-1")
    assert rollout is not None and rollout.attempt is not None
    outcome: Dict[str, Any] = {}

    def complete() -> None:
        assert rollout is not None and rollout.attempt is not None
        try:
            outcome["rollout"] = runner.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
        except StaleAttemptError as exc:
            outcome["error"] = exc

    with psycopg.connect(runner.dsn) as reaper:  # another machine's reap, its transaction still open
        reaper.execute("SELECT 1 FROM agl_rollouts WHERE rollout_id = %s FOR UPDATE", (rollout.rollout_id,))
        reaper.execute(
            "UPDATE agl_attempts SET status = 'timeout', end_time = 1 WHERE attempt_id = %s",
            (rollout.attempt.attempt_id,),
        )
        reaper.execute(
            "UPDATE agl_rollouts SET status = 'queued', queue_pos = nextval('agl_queue_pos') WHERE rollout_id = %s",
            (rollout.rollout_id,),
        )
        _commit_once_waited_for(runner.dsn, reaper, complete, "the completion waits for the lock")
    assert "error" in outcome, f"a completion of a reaped attempt was accepted: {outcome}"
    assert "'timeout'" in str(outcome["error"])
    after = runner.get_rollout(rollout.rollout_id)
    assert after.status == "queued" and after.attempt is not None and after.attempt.status == "timeout"


def test_a_chosen_rollout_id_stored_by_another_machine_meanwhile_is_a_duplicate(
    machines: List[PostgresLightningStore],
) -> None:
    """The other machine's insert commits while ours waits on the unique index: ours must say duplicate."""
    store, _ = machines
    outcome: Dict[str, Any] = {}

    def enqueue() -> None:
        try:
            outcome["rollouts"] = store.enqueue_many([EnqueueRequest(rollout_id="ro-chosen", input="mine")])
        except DuplicateRolloutError as exc:
            outcome["error"] = exc

    with psycopg.connect(store.dsn) as other:  # another machine's enqueue, its transaction still open
        other.execute(INSERT_ROLLOUT, ("ro-chosen", "task", '"theirs"', "train", None, 1, None, None, "{}", 1.0))
        _commit_once_waited_for(store.dsn, other, enqueue, "our insert waits on the unique index")
    assert "error" in outcome and "'ro-chosen'" in str(outcome["error"]), outcome
    assert store.get_rollout("ro-chosen").input == "theirs"
    assert store.stats().rollouts["queued"] == 1


def _complete_later(store: PostgresLightningStore, rollout: Rollout) -> None:
    time.sleep(0.2)
    assert rollout.attempt is not None
    store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=0.5)


def test_completion_on_another_machine_wakes_wait_for_rollouts(machines: List[PostgresLightningStore]) -> None:
    trainer, runner = machines
    queued = trainer.enqueue_rollout("x")
    rollout = runner.dequeue_rollout("runner-1")
    assert rollout is not None
    thread = threading.Thread(target=_complete_later, args=(runner, rollout))
    thread.start()
    start = time.monotonic()
    (done,) = trainer.wait_for_rollouts([queued.rollout_id], timeout=60)
    thread.join()
    assert (done.status, done.final_reward) == ("succeeded", 0.5)
    assert time.monotonic() - start < 10, "woken by the notification, not by its 60 s timeout"


def test_waiter_survives_its_listening_session_being_killed(
    postgres_server: PostgresServer, machines: List[PostgresLightningStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    waiter, other = machines
    claims = _count_claims(waiter, monkeypatch)
    got: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.update(rollout=waiter.dequeue_rollout("runner-1", timeout=60)))
    thread.start()
    _until(lambda: claims[0] >= 2, "the waiter is listening")
    assert postgres_server.terminate_connections(_dbname(waiter.dsn)) >= 1
    rollout = other.enqueue_rollout("after the cut")  # `other` reconnects; the waiter's listener reconnects too
    thread.join(60)
    assert got["rollout"] is not None and got["rollout"].rollout_id == rollout.rollout_id


# -- lost sessions, restarts, unreachable servers ----------------------------------------------------------


def test_reconnects_after_sessions_are_killed_and_keeps_committed_spans(
    postgres_server: PostgresServer, postgres_dsn: str, make_span: MakeSpan, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresLightningStore(postgres_dsn)
    store.enqueue_rollout("x")
    rollout = store.dequeue_rollout("runner-1")
    assert rollout is not None and rollout.attempt is not None
    first = [make_span(rollout, i) for i in range(3)]
    assert store.add_spans(first) == 3
    assert postgres_server.terminate_connections(_dbname(postgres_dsn)) >= 1
    second = [make_span(rollout, i) for i in range(3, 5)]
    with caplog.at_level(logging.WARNING, logger="agl.store.postgres.store"):
        assert store.add_spans(second) == 2
    assert "retrying" in caplog.text, "the killed session was noticed and replaced"
    assert store.query_spans(rollout.rollout_id) == first + second
    done = store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
    assert done.status == "succeeded"
    store.close()


def test_a_statement_on_a_session_the_server_ended_is_retried_whatever_the_libpq(
    postgres_server: PostgresServer, postgres_dsn: str
) -> None:
    """The race the reconnect test above can lose: a statement sent before the server's goodbye reached the
    pool's check. The server aborted it, so it may be retried. libpq 17+ says so with AdminShutdown; older
    libpq (psycopg-binary < 3.2.4: the `lowest` session runs one) with a plain OperationalError whose text
    is the server's. Before, the latter counted as a commit that may have happened (2 in 40 reconnect tests
    failed under load). A connection lost for another reason while committing stays unknown."""
    import psycopg

    from agl.store.postgres import failures as pg

    conn = psycopg.connect(postgres_dsn, autocommit=True)
    conn.execute("SELECT 1")
    assert postgres_server.terminate_connections(_dbname(postgres_dsn)) >= 1
    deadline = time.monotonic() + 10
    while postgres_server.sessions(_dbname(postgres_dsn)) and time.monotonic() < deadline:  # the backend is gone
        time.sleep(0.01)
    with pytest.raises(psycopg.OperationalError) as ended:
        conn.execute("SELECT 1")
    assert conn.broken or conn.closed
    with pytest.raises(type(ended.value)):
        pg._raise_failure(ended.value, conn, committing=True)  # retried: raised as itself
    with pytest.raises(pg._CommitUnknown):
        pg._raise_failure(psycopg.OperationalError("server closed the connection unexpectedly"), conn, committing=True)
    conn.close()


def test_server_restart_loses_nothing_committed(make_span: MakeSpan) -> None:
    with TemporaryPostgres() as server:
        dsn = server.create_database()
        store = PostgresLightningStore(dsn, reconnect_timeout=0.3)
        store.enqueue_many([EnqueueRequest(input=i) for i in range(3)])
        rollout = store.dequeue_rollout("runner-1")
        assert rollout is not None and rollout.attempt is not None
        spans = [make_span(rollout, i) for i in range(4)]
        store.add_spans(spans)
        server.kill()
        with pytest.raises(StoreUnavailableError, match="cannot reach PostgreSQL.*check that the server is running"):
            store.stats()
        server.restart()
        assert store.query_spans(rollout.rollout_id) == spans
        assert store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded").is_terminal
        assert store.stats().rollouts == {"queued": 2, "running": 0, "succeeded": 1, "failed": 0, "cancelled": 0}
        store.close()


def test_a_database_down_for_longer_than_the_heartbeat_timeout_does_not_end_the_running_attempts() -> None:
    """No runner can send a heartbeat while the database is down: the first reap after a restart ended every
    running attempt as unresponsive (failing rollouts with no attempt left), though their runners were alive
    and riding the outage out. Heartbeats older than the server's start now count from its start."""
    with TemporaryPostgres() as server:
        store = PostgresLightningStore(server.create_database(), reconnect_timeout=30)
        config = RolloutConfig(heartbeat_timeout_seconds=1.5)
        rollout_id = store.enqueue_rollout("x", config=config).rollout_id
        claimed = store.dequeue_rollout("runner-1")
        assert claimed is not None and claimed.attempt is not None
        server.kill()
        time.sleep(2.0)  # longer than the heartbeat timeout
        server.restart()
        assert store.reap_expired() == [] and store.get_rollout(rollout_id).status == "running"
        store.heartbeat(rollout_id, claimed.attempt.attempt_id)  # the runner is back: its attempt goes on
        assert store.complete_attempt(rollout_id, claimed.attempt.attempt_id, "succeeded").status == "succeeded"
        silent = store.enqueue_rollout("y", config=config).rollout_id
        assert store.dequeue_rollout("runner-2") is not None
        time.sleep(1.7)  # a silent runner after the restart is still ended
        store.reap_expired()
        assert [a.status for a in store.query_attempts(silent)] == ["unresponsive"]
        store.close()


def test_a_trainer_sets_how_long_calls_ride_out_a_database_outage_unless_the_store_has_its_own() -> None:
    """A Trainer on postgresql:// rode out only 10 s of database downtime (a restart), then ended the run."""
    import agl

    with TemporaryPostgres() as server:
        default = PostgresLightningStore(server.create_database())
        own = PostgresLightningStore(server.create_database(), reconnect_timeout=0.3)
        trainer = agl.Trainer(store=default, progress=False, store_outage_timeout=0.4)
        agl.Trainer(store=own, progress=False, store_outage_timeout=600)
        assert trainer.store is default and default.reconnect_timeout == 0.4 and own.reconnect_timeout == 0.3
        server.kill()
        for store, seconds in ((default, "0.4"), (own, "0.3")):  # the timeout the call gave up after, not 10 s
            with pytest.raises(StoreUnavailableError, match=f"cannot reach PostgreSQL .* for {seconds} s"):
                store.stats()
        server.restart()
        assert default.stats().rollouts["queued"] == 0
        default.close()
        own.close()


def _wait_in_a_thread(store: PostgresLightningStore, rollout_id: str, timeout: float) -> Dict[str, Any]:
    """``Trainer._wait``: ``wait_for_rollouts(timeout=timeout)`` in a loop, in a thread, until the rollout is done
    or a call raises; the returned dict gets "done" or "error", and "thread"."""
    got: Dict[str, Any] = {}

    def wait() -> None:
        try:
            while not got.get("done"):
                got["done"] = store.wait_for_rollouts([rollout_id], timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            got["error"] = exc

    got["thread"] = threading.Thread(target=wait, daemon=True)
    got["thread"].start()
    return got


def test_waiting_rides_out_a_database_restart_while_notifications_are_down() -> None:
    """A Trainer on postgresql:// died in a database restart though store_outage_timeout should keep it waiting:
    a wait begun while the listening connection was still reconnecting raised "could not LISTEN". Now it polls
    until the listener is back. Here the listener stays down past the restart, so the completion can only be
    seen by polling."""
    with TemporaryPostgres() as server:
        dsn = server.create_database()
        trainer = PostgresLightningStore(dsn, reconnect_timeout=30)
        rollout_id = trainer.enqueue_rollout("x").rollout_id
        listener = trainer._state()[1]
        connect, deaf = listener._connect, threading.Event()

        def listener_connect() -> Any:
            if deaf.is_set():
                raise psycopg.OperationalError("the listener is still reconnecting (this test)")
            return connect()

        listener._connect = listener_connect  # type: ignore[method-assign]
        got = _wait_in_a_thread(trainer, rollout_id, timeout=0.2)
        _until(lambda: listener._listening, "the trainer listens")
        deaf.set()
        server.kill()
        time.sleep(1.0)
        server.restart()
        time.sleep(1.5)  # the trainer is back to waiting (its retries back off by 1 s at most), listener still down
        assert "error" not in got, got.get("error")
        with PostgresLightningStore(dsn) as runner:
            claimed = runner.dequeue_rollout("runner-1")
            assert claimed is not None and claimed.attempt is not None
            runner.complete_attempt(rollout_id, claimed.attempt.attempt_id, "succeeded", reward=1.0)
        got["thread"].join(30)
        assert "error" not in got, got.get("error")
        assert [r.status for r in got["done"]] == ["succeeded"] and not listener._listening
        deaf.clear()
        _until(lambda: listener._listening, "the listener is back")
        trainer.close()


def test_a_wait_gives_up_once_the_database_is_down_for_longer_than_the_reconnect_timeout() -> None:
    """...and not before (the restart test above), nor only at the end of the wait's own timeout: a waiter
    slept through the lost listening connection until its timeout (60 s here)."""
    with TemporaryPostgres() as server:
        store = PostgresLightningStore(server.create_database(), reconnect_timeout=1.0)
        rollout_id = store.enqueue_rollout("x").rollout_id
        got: Dict[str, Any] = {}

        def wait() -> None:
            try:
                store.wait_for_rollouts([rollout_id], timeout=60)
            except StoreUnavailableError as exc:
                got["error"] = exc

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        _until(lambda: store._state()[1]._listening, "the waiter listens")
        started = time.monotonic()
        server.kill()
        thread.join(20)
        assert not thread.is_alive() and time.monotonic() - started < 15, "the wait did not give up"
        assert "cannot reach PostgreSQL" in str(got["error"]) and "for 1 s" in str(got["error"])
        server.restart()
        store.close()


def test_a_database_or_role_that_does_not_exist_is_refused_at_once_not_waited_for(postgres_dsn: str) -> None:
    """`agl runner --wait-for-store` waited its whole 120 s for a mistyped database, retried as an outage."""
    from agl.cli.remote import first_contact

    parts = urlsplit(postgres_dsn)
    no_database = parts._replace(path="/no_such_db").geturl()
    no_role = parts._replace(netloc=parts.netloc.replace(f"{parts.username}@", "no_such_role@")).geturl()
    for url, words in ((no_database, 'database "no_such_db" does not exist'), (no_role, 'role "no_such_role"')):
        with pytest.raises(AglError, match=words) as refused:
            PostgresLightningStore(url)
        assert not isinstance(refused.value, StoreUnavailableError), "retried as an outage"
        assert "check the database, user and password" in str(refused.value)
        started = time.monotonic()
        with pytest.raises(AglError, match=words):
            first_contact(url, None, 30.0)
        assert time.monotonic() - started < 5


def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"postgresql://agl@127.0.0.1:{probe.getsockname()[1]}/nowhere"  # nobody listens there
    with pytest.raises(StoreUnavailableError, match="cannot connect to PostgreSQL.*check that the server is running"):
        PostgresLightningStore(url)


# -- schema ------------------------------------------------------------------------------------------------


@pytest.fixture
def empty_database(postgres_server: PostgresServer) -> Iterator[str]:
    """A database without the store's schema (created and dropped here)."""
    dsn = postgres_server.create_database()
    yield dsn
    postgres_server.drop_database(_dbname(dsn))


def test_machines_opening_a_new_database_at_once_create_the_schema_once(empty_database: str) -> None:
    stores: List[PostgresLightningStore] = []
    errors: List[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(PostgresLightningStore(empty_database))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and len(stores) == 4
    rollout = stores[0].enqueue_rollout("x")
    assert stores[3].get_rollout(rollout.rollout_id) == rollout
    for store in stores:
        store.close()


def test_newer_schema_is_refused(empty_database: str) -> None:
    PostgresLightningStore(empty_database).close()
    with psycopg.connect(empty_database, autocommit=True) as conn:
        conn.execute("UPDATE agl_schema SET version = 99")
    with pytest.raises(AglError, match="newer agl.*store schema 99"):
        PostgresLightningStore(empty_database)


@pytest.mark.parametrize(
    "foreign",
    ["CREATE TABLE agl_rollouts (x integer)", "CREATE SEQUENCE agl_queue_pos", "CREATE TABLE agl_spans (x int)"],
)
def test_foreign_tables_are_refused(empty_database: str, foreign: str) -> None:
    """A leftover sequence gave psycopg's DuplicateTable traceback; only an agl_rollouts table was checked."""
    with psycopg.connect(empty_database, autocommit=True) as conn:
        conn.execute(foreign)
    name = foreign.split()[2]
    with pytest.raises(AglError, match=f'"{name}" already exists.*not made by agl.*empty database'):
        PostgresLightningStore(empty_database)


# -- input PostgreSQL cannot store (NUL characters: the contract suite has the rule) ------------------------


def test_an_agent_error_with_a_nul_character_fails_its_rollout_at_once(
    postgres_dsn: str, dev_an_agent_that_fails: Any
) -> None:
    """The runner died on complete_attempt's ValueError (PostgreSQL text cannot hold NUL) and the rollout waited
    for its heartbeat timeout, losing the agent's error; SQLite failed it at once."""
    with PostgresLightningStore(postgres_dsn) as store:
        row = dev_an_agent_that_fails(store, "tool output: \x00binary", "tool returned b'\x00\x01' garbage")
        assert "tool returned b'\ufffd\x01' garbage" in (row.error or "")


def test_an_agent_error_with_a_lone_surrogate_fails_its_rollout_at_once(
    postgres_dsn: str, dev_an_agent_that_fails: Any
) -> None:
    """complete_attempt raised UnicodeEncodeError ("\\ud83d", half an emoji from a cut-off model reply), the
    runner died and the rollout waited for its heartbeat timeout; the root span was refused too."""
    with PostgresLightningStore(postgres_dsn) as store:
        row = dev_an_agent_that_fails(store, "model said \ud83d", "could not parse answer: \ud83d")
        assert "could not parse answer: \ufffd" in (row.error or "")
        names = [span.name for span in store.query_spans(row.rollout_id)]
        assert "agl.rollout" in names and "agl.message" in names, names


# -- the test server helper --------------------------------------------------------------------------------


def test_without_postgresql_the_helper_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(agl.testing.postgres, "_BIN_GLOBS", ())
    with pytest.raises(PostgresUnavailableError, match="apt-get install postgresql.*AGL_TEST_POSTGRES_DSN"):
        TemporaryPostgres().start()


# -- open_store --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["postgresql", "postgres", "key=value"])
def test_open_store_opens_postgresql_urls_and_libpq_key_value_strings(postgres_dsn: str, form: str) -> None:
    """The docs promise "any libpq URL or key=value string"; open_store (so --store and $AGL_STORE) refused
    the key=value form as an unknown store."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    if form == "key=value":
        url = make_conninfo(**conninfo_to_dict(postgres_dsn))
        assert "://" not in url and "dbname=" in url
    else:
        url = form + postgres_dsn[postgres_dsn.index("://") :]
    with open_store(url) as store:
        assert isinstance(store, PostgresLightningStore)
        rollout = store.enqueue_rollout("x")
    with PostgresLightningStore(postgres_dsn) as again:
        assert again.get_rollout(rollout.rollout_id) == rollout


def test_folders_of_killed_temporary_servers_are_removed_by_the_next_start(tmp_path: Path) -> None:
    # a folder per TemporaryPostgres names its owner; a folder whose owner died before stop() is ~40 MB of junk
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = {}
    for name, owner in (("dead", str(dead.pid)), ("alive", str(os.getpid())), ("unowned", None), ("garbled", "x")):
        folder = tmp_path / f"agl-pg-{name}"
        (folder / "data").mkdir(parents=True)
        if owner is not None:
            (folder / "owner.pid").write_text(owner)
        folders[name] = folder
    assert remove_abandoned_folders(str(tmp_path)) == [str(folders["dead"])]
    assert not folders["dead"].exists()
    assert all(folders[name].exists() for name in ("alive", "unowned", "garbled"))


# -- the async calls of the store server's event loop (AsyncRolloutCalls) ------------------------------------


def test_async_calls_give_what_the_sync_calls_give(postgres_dsn: str, make_span: MakeSpan) -> None:
    store = PostgresLightningStore(postgres_dsn)
    resources = store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:1/v1", model="m")})
    store.enqueue_many([EnqueueRequest(input=i, resources_id=resources.resources_id) for i in range(3)])

    async def cycle() -> None:
        claimed = await store.aclaim("runner-1", 2)
        assert [r.input for r in claimed] == [0, 1] and all(r.status == "running" for r in claimed)
        assert claimed == [await store.get_rollout(r.rollout_id) for r in claimed]  # awaitable in a coroutine
        first = claimed[0]
        assert first.attempt is not None
        spans = [make_span(first, i) for i in range(3)]
        assert await store.aadd_spans(spans) == 3
        assert await store.aadd_spans(spans[1:]) == 0  # already stored: ignored, as add_spans does
        assert await store.aadd_spans([]) == 0
        assert await store.query_spans(first.rollout_id) == spans
        assert await store.aget_resources(resources.resources_id) == resources
        assert await store.aget_resources() == resources
        with pytest.raises(UnknownResourcesError):
            await store.aget_resources("res-missing")
        done = await store.acomplete_attempt(first.rollout_id, first.attempt.attempt_id, "succeeded", reward=0.5)
        assert done == await store.get_rollout(first.rollout_id) and done.final_reward == 0.5
        with pytest.raises(StaleAttemptError):
            await store.acomplete_attempt(first.rollout_id, first.attempt.attempt_id, "failed")
        with pytest.raises(UnknownAttemptError):
            await store.acomplete_attempt(first.rollout_id, "at-missing", "failed")
        with pytest.raises(UnknownRolloutError):
            await store.acomplete_attempt("ro-missing", "at-missing", "failed")
        with pytest.raises(UnknownRolloutError):
            await store.aadd_spans([make_span(first, 9).model_copy(update={"rollout_id": "ro-missing"})])
        assert len(await store.aclaim("runner-1", 5)) == 1 and await store.aclaim("runner-1") == []

    asyncio.run(cycle())
    store.close()


def test_async_calls_reconnect_after_sessions_are_killed_and_on_a_new_event_loop(
    postgres_server: PostgresServer, postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresLightningStore(postgres_dsn)
    store.enqueue_many([EnqueueRequest(input=i) for i in range(2)])

    async def claim() -> List[Rollout]:
        return await store.aclaim("runner-1")

    assert len(asyncio.run(claim())) == 1  # its own event loop, as every asyncio.run
    assert postgres_server.terminate_connections(_dbname(postgres_dsn)) >= 1
    with caplog.at_level(logging.WARNING, logger="agl.store.postgres.store"):
        assert len(asyncio.run(claim())) == 1  # a new loop, and the killed sessions are replaced
    assert store.stats().rollouts["running"] == 2
    store.close()
    with pytest.raises(StoreClosedError):
        asyncio.run(claim())


def test_async_calls_of_a_stopped_server_are_a_clear_error_and_resume_after_restart(make_span: MakeSpan) -> None:
    with TemporaryPostgres() as server:
        store = PostgresLightningStore(server.create_database(), reconnect_timeout=0.3)
        store.enqueue_rollout("x")

        async def claim_and_add() -> int:
            rollout = (await store.aclaim("runner-1"))[0]
            server.kill()
            with pytest.raises(
                StoreUnavailableError, match="cannot reach PostgreSQL.*check that the server is running"
            ):
                await store.aget_resources()
            server.restart()
            return await store.aadd_spans([make_span(rollout, 0)])

        assert asyncio.run(claim_and_add()) == 1
        store.close()


def test_closing_the_store_under_a_running_server_closes_its_async_connections(
    postgres_server: PostgresServer, postgres_dsn: str
) -> None:
    from agl.store.http.client import RemoteLightningStore
    from agl.store.http.server import ServerThread, TokenSet, create_app

    store = PostgresLightningStore(postgres_dsn)
    server = ServerThread(create_app(store, tokens=TokenSet({"t": "token"}))).start()
    client = RemoteLightningStore(server.url, token="token", retries=0)
    try:
        client.enqueue_rollout("x")
        assert client.dequeue_rollout("runner-1") is not None  # claimed on the server's loop: an async connection
        sessions = (
            f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{_dbname(postgres_dsn)}' "
            "AND pid <> pg_backend_pid()"
        )
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            assert admin.execute(sessions).fetchone()[0] >= 1
            store.close()  # from this thread, while the server's loop runs
            _until(lambda: admin.execute(sessions).fetchone()[0] == 0, "the store's sessions are gone")
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("limit", [1, 3])
def test_the_claim_statement_runs_on_a_reused_generic_plan(postgres_dsn: str, limit: int) -> None:
    """The claim is planned once per connection, not on every call: with ``LIMIT $n`` PostgreSQL's generic plan
    was a table scan once the queue held thousands, so it re-planned each claim (half its server CPU; see
    ``claim_statement``)."""
    store = PostgresLightningStore(postgres_dsn)
    store.enqueue_many([EnqueueRequest(input=i) for i in range(3000)])
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("ANALYZE agl_rollouts")  # what autovacuum does to a table that has grown
        for _ in range(12):
            claimed = conn.execute(claim_statement(limit), store._claim_params("r", limit), prepare=True).fetchall()
            assert len(claimed) == limit
        generic, custom = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%SKIP LOCKED%'"
        ).fetchone()
    store.close()
    assert generic >= 6 and custom <= 6, (generic, custom)
