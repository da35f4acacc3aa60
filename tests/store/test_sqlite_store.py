"""What only the SQLite store promises: several processes, persistence, pickling, the doorbell; and open_store."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, List

import pytest
from claim_race import drain_in_forked_processes

from agl.errors import AglError, StoreAddressError, StoreNotFoundError
from agl.store import EnqueueRequest, InMemoryLightningStore, SqliteLightningStore, _rules, open_store
from agl.store.doorbell import Doorbell
from agl.types import LLM, RolloutConfig

fork = multiprocessing.get_context("fork")


def test_processes_never_claim_the_same_rollout(sqlite_store: SqliteLightningStore, tmp_path: Path) -> None:
    ids = {r.rollout_id for r in sqlite_store.enqueue_many([EnqueueRequest(input=i) for i in range(200)])}
    sqlite_store.get_rollout(next(iter(ids)))  # the parent holds an open connection across the fork
    claimed = drain_in_forked_processes(sqlite_store, tmp_path)
    assert len(claimed) == len(set(claimed)) == 200 and set(claimed) == ids
    stats = sqlite_store.stats()
    assert stats.rollouts["succeeded"] == 200 and stats.attempts == 200


def _dequeue_and_report(store: SqliteLightningStore, out: Path) -> None:
    rollout = store.dequeue_rollout("child", timeout=60)
    out.write_text(rollout.rollout_id if rollout else "none")


def _wait_for_bell(bell: Doorbell, count: int = 1) -> None:
    deadline = time.monotonic() + 30
    while not (os.path.isdir(bell.directory) and len(os.listdir(bell.directory)) >= count):
        assert time.monotonic() < deadline, "the child never started waiting"
        time.sleep(0.01)


def _one_call_then_exit(store: SqliteLightningStore) -> None:
    store.query_rollouts()
    os._exit(0)


def test_forks_while_other_threads_use_the_store_leave_no_child_blocked(tmp_path: Path) -> None:
    """A fork while another thread is inside SQLite copies SQLite's process-wide mutexes locked; the
    child's first call then blocks for good (7 of 100 forks before agl._util.fork_safety's hold, 0 of 300 after).
    Runner processes are forked from a trainer whose store, tracer writer and server threads are busy."""
    store = SqliteLightningStore(tmp_path / "busy.db")
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            store.enqueue_rollout({"text": "x" * 2000})
            store.query_rollouts()

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for thread in threads:
        thread.start()
    blocked = 0
    try:
        for _ in range(60):
            child = fork.Process(target=_one_call_then_exit, args=(store,))
            child.start()
            child.join(5)
            if child.is_alive():
                blocked += 1
                child.kill()
                child.join()
            else:
                assert child.exitcode == 0
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        store.close()
    assert blocked == 0


def test_a_fork_waits_for_the_store_operations_in_flight_and_holds_new_ones(tmp_path: Path) -> None:
    store = SqliteLightningStore(tmp_path / "gate.db")
    inside, leave, started_late = threading.Event(), threading.Event(), threading.Event()
    ended_at: List[float] = []

    def long_operation() -> None:
        with store._session:  # one operation, as every store call makes
            inside.set()
            leave.wait(10)
            ended_at.append(time.monotonic())

    def late_call() -> None:
        started_late.set()
        store.query_rollouts()
        ended_at.append(time.monotonic())

    holder = threading.Thread(target=long_operation)
    holder.start()
    assert inside.wait(10)
    threading.Timer(0.4, leave.set).start()
    child = fork.Process(target=_one_call_then_exit, args=(store,))
    child.start()  # returns once forked: after the operation in flight ended
    forked_at = time.monotonic()
    child.join(10)
    holder.join()
    assert child.exitcode == 0
    assert ended_at and ended_at[0] <= forked_at
    late = threading.Thread(target=late_call)
    late.start()
    late.join(10)
    assert started_late.is_set() and len(ended_at) == 2  # operations go on after the fork
    store.close()


def test_a_fork_does_not_wait_forever_for_a_stuck_operation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from agl.store.sqlite import database as sqlite_module

    monkeypatch.setattr(sqlite_module, "FORK_WAIT_S", 0.2)
    store = SqliteLightningStore(tmp_path / "stuck.db")
    inside, leave = threading.Event(), threading.Event()

    def stuck() -> None:
        with store._session:
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=stuck)
    holder.start()
    assert inside.wait(10)
    started = time.monotonic()
    child = fork.Process(target=os._exit, args=(0,))
    child.start()
    waited = time.monotonic() - started
    child.join(10)
    leave.set()
    holder.join()
    assert child.exitcode == 0 and 0.2 <= waited < 5
    assert "forking while 1 store operation(s) still run" in caplog.text
    store.query_rollouts()  # the store still works in the parent
    store.close()


def test_enqueue_wakes_a_waiter_in_another_process(sqlite_store: SqliteLightningStore, tmp_path: Path) -> None:
    out = tmp_path / "woken.txt"
    child = fork.Process(target=_dequeue_and_report, args=(sqlite_store, out))
    child.start()
    _wait_for_bell(Doorbell(sqlite_store.path, "queue"))
    rollout = sqlite_store.enqueue_rollout("wake up")
    child.join(60)
    assert child.exitcode == 0 and out.read_text() == rollout.rollout_id
    assert os.listdir(Doorbell(sqlite_store.path, "queue").directory) == [], "the waiter removed its socket"


def _complete_later(store: SqliteLightningStore) -> None:
    rollout = store.dequeue_rollout("child")
    assert rollout is not None and rollout.attempt is not None
    time.sleep(0.2)
    store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=0.5)


def test_completion_in_another_process_wakes_wait_for_rollouts(sqlite_store: SqliteLightningStore) -> None:
    rollout = sqlite_store.enqueue_rollout("x")
    child = fork.Process(target=_complete_later, args=(sqlite_store,))
    child.start()
    (done,) = sqlite_store.wait_for_rollouts([rollout.rollout_id], timeout=60)
    child.join(60)
    assert child.exitcode == 0 and (done.status, done.final_reward) == ("succeeded", 0.5)


def test_waiter_killed_with_sigkill_leaves_nothing_behind(sqlite_store: SqliteLightningStore, tmp_path: Path) -> None:
    bell = Doorbell(sqlite_store.path, "queue")
    child = fork.Process(target=_dequeue_and_report, args=(sqlite_store, tmp_path / "never.txt"))
    child.start()
    _wait_for_bell(bell)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert len(os.listdir(bell.directory)) == 1, "a killed waiter cannot clean up its socket"
    sqlite_store.enqueue_rollout("x")  # the writer's ring finds the dead socket and removes it
    assert os.listdir(bell.directory) == []
    assert sqlite_store.dequeue_rollout("runner-1") is not None


def test_doorbell_rings_listeners_and_skips_stale_sockets(tmp_path: Path) -> None:
    bell = Doorbell(str(tmp_path / "x.db"), "test")
    bell.ring()  # nobody ever listened: a no-op
    with bell.listen() as listener:
        stale = os.path.join(bell.directory, "999999999-0")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dead.bind(stale)
        dead.close()  # the file stays, as after kill -9
        ringer = threading.Timer(0.1, bell.ring)
        ringer.start()
        assert listener.wait(30)
        ringer.join()
        assert not os.path.exists(stale)
        bell.ring()
        bell.ring()
        assert listener.wait(30)
        assert not listener.wait(0.01), "both rings were drained by the first wait"
    assert os.listdir(bell.directory) == []


def test_doorbell_wait_of_zero_seconds_only_checks(tmp_path: Path) -> None:
    """A waiter whose deadline has just passed waits 0 s (or less): a check, never an exception."""
    bell = Doorbell(str(tmp_path / "x.db"), "test")
    with bell.listen() as listener:
        assert not listener.wait(0)
        assert not listener.wait(-0.5)
        bell.ring()
        assert listener.wait(0)
        assert not listener.wait(0.01), "the wait of 0 s drained the ring"


def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "store.db"
    with SqliteLightningStore(path) as store:
        update = store.add_resources({"llm": LLM(endpoint="http://x/v1", model="m")})
        store.enqueue_many([EnqueueRequest(input={"i": i}, config=RolloutConfig(max_attempts=2)) for i in range(3)])
        rollout = store.dequeue_rollout("runner-1")
        assert rollout is not None and rollout.attempt is not None
        store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "failed", error="boom")
        before = (store.query_rollouts(), store.query_attempts(rollout.rollout_id), store.stats())
    with SqliteLightningStore(path) as store:
        assert (store.query_rollouts(), store.query_attempts(rollout.rollout_id), store.stats()) == before
        assert store.get_resources() == update
        assert [r.input for r in store.dequeue_many("runner-2", 3)] == [{"i": 1}, {"i": 2}, {"i": 0}]


def test_store_pickles_as_its_path(sqlite_store: SqliteLightningStore) -> None:
    rollout = sqlite_store.enqueue_rollout("x")
    data = pickle.dumps(sqlite_store)
    assert len(data) < 500
    clone = pickle.loads(data)
    assert clone.path == sqlite_store.path and clone.get_rollout(rollout.rollout_id) == rollout
    clone.close()


def test_threads_that_end_do_not_leak_connections(sqlite_store: SqliteLightningStore) -> None:
    rollout = sqlite_store.enqueue_rollout("x")
    for _ in range(20):
        thread = threading.Thread(target=sqlite_store.get_rollout, args=(rollout.rollout_id,))
        thread.start()
        thread.join()
    sqlite_store.get_rollout(rollout.rollout_id)
    assert len(sqlite_store._conns) <= 2  # this thread's, and at most the last thread's


_CLOSE_WHILE_WRITING = """
import sys, threading, time
from agl.errors import StoreClosedError
from agl.store import SqliteLightningStore
from agl.types import Span

path = sys.argv[1]
for round in range(15):
    store = SqliteLightningStore(f"{path}-{round}.db")
    store.enqueue_rollout("x")
    rollout = store.dequeue_rollout("r")
    spans = [Span(rollout_id=rollout.rollout_id, attempt_id=rollout.attempt.attempt_id, sequence_id=i,
                  trace_id="ab" * 16, span_id=f"{round:08x}{i:08x}", name="s", kind="llm", start_time=1, end_time=2,
                  attributes={"blob": "x" * 4000}) for i in range(300)]
    outcomes = []

    def write():
        try:
            while True:
                store.add_spans(spans)
                store.query_spans(rollout.rollout_id)
        except StoreClosedError:
            outcomes.append("closed")

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.02 + 0.01 * round)
    store.close()
    for thread in threads:
        thread.join(30)
    assert outcomes == ["closed", "closed"], outcomes
print("ok")
"""


def test_closing_while_other_threads_write_raises_there_instead_of_crashing(tmp_path: Path) -> None:
    # closing a connection under another thread's running statement crashes CPython's sqlite3 module
    # (a segfault, seen when a test closed its store while the tracer's writer still wrote to it)
    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_WHILE_WRITING, str(tmp_path / "closing")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_a_new_store_file_has_8k_pages_and_an_old_one_keeps_its_own(tmp_path: Path) -> None:
    fresh = SqliteLightningStore(tmp_path / "fresh.db")
    with fresh._session as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 8192  # heavy LLM spans fit without overflow
    fresh.close()
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute("CREATE TABLE unrelated (x)")  # a file made with SQLite's default 4 KiB pages
    old.close()
    reopened = SqliteLightningStore(tmp_path / "old.db")
    with reopened._session as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 4096
    reopened.enqueue_rollout("still works")
    reopened.close()


def test_span_batches_rewrite_the_heartbeat_once_per_resolution(
    sqlite_store: SqliteLightningStore, make_span: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a page write per span batch saved: the heartbeat is a liveness signal, not a clock (span_heartbeat_due)
    monkeypatch.setattr(_rules, "SPAN_HEARTBEAT_RESOLUTION", 0.2)
    sqlite_store.enqueue_rollout("x")
    rollout = sqlite_store.dequeue_rollout("r")
    assert rollout is not None and rollout.attempt is not None
    claimed = rollout.attempt.last_heartbeat
    sqlite_store.add_spans([make_span(rollout, 0)])
    (attempt,) = sqlite_store.query_attempts(rollout.rollout_id)
    assert attempt.last_heartbeat == claimed  # within the resolution: left as it was
    time.sleep(0.25)
    sqlite_store.add_spans([make_span(rollout, 1)])
    (attempt,) = sqlite_store.query_attempts(rollout.rollout_id)
    assert attempt.last_heartbeat >= claimed + 0.2
    assert len(sqlite_store.query_spans(rollout.rollout_id)) == 2


def test_rollouts_built_from_rows_without_validation_equal_validated_ones(sqlite_store: SqliteLightningStore) -> None:
    # rollout_from_row skips pydantic's validation (agl.types.trusted): every state it builds must be what
    # validation would have made, down to the JSON (5 is not 5.0)
    config = RolloutConfig(max_attempts=2, timeout_seconds=5, heartbeat_timeout_seconds=60)
    queued = sqlite_store.enqueue_rollout({"q": [1, 2]}, mode="val", config=config, metadata={"k": "v"})
    assert queued.model_dump_json() == sqlite_store.get_rollout(queued.rollout_id).model_dump_json()
    claimed = sqlite_store.dequeue_rollout("r")
    assert claimed is not None and claimed.attempt is not None
    assert claimed.model_dump_json() == sqlite_store.get_rollout(claimed.rollout_id).model_dump_json()
    requeued = sqlite_store.complete_attempt(claimed.rollout_id, claimed.attempt.attempt_id, "failed", error="boom")
    again = sqlite_store.dequeue_rollout("r")
    assert again is not None and again.attempt is not None
    done = sqlite_store.complete_attempt(again.rollout_id, again.attempt.attempt_id, "succeeded", reward=0.5)
    listed = sqlite_store.query_rollouts()
    attempts = sqlite_store.query_attempts(done.rollout_id)
    for model in [queued, claimed, requeued, again, done, *listed, *attempts]:
        validated = type(model).model_validate(model.model_dump())
        assert model == validated and model.model_dump_json() == validated.model_dump_json()
        assert model.model_fields_set == validated.model_fields_set
    assert [requeued.status, done.status, done.final_reward] == ["queued", "succeeded", 0.5]
    for reward, stored in ((1, 1.0), (True, 1.0)):  # the answer is what the file holds
        sqlite_store.enqueue_rollout("r")
        claimed = sqlite_store.dequeue_rollout("r")
        assert claimed is not None and claimed.attempt is not None
        attempt_id = claimed.attempt.attempt_id
        answer = sqlite_store.complete_attempt(claimed.rollout_id, attempt_id, "succeeded", reward=reward)
        read = sqlite_store.get_rollout(claimed.rollout_id)
        assert answer == read and answer.model_dump_json() == read.model_dump_json() and read.final_reward == stored


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    SqliteLightningStore(path).close()
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(AglError, match="newer agl"):
        SqliteLightningStore(path)


# -- open_store --------------------------------------------------------------------------------------------


def test_open_store_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AGL_STORE", raising=False)
    assert isinstance(open_store("memory"), InMemoryLightningStore)
    assert isinstance(open_store("memory://"), InMemoryLightningStore)
    default = open_store(None)
    assert isinstance(default, SqliteLightningStore) and default.path == str(tmp_path / ".agl" / "store.db")
    assert open_store("runs/a.db").path == str(tmp_path / "runs" / "a.db")  # type: ignore[attr-defined]
    assert open_store("sqlite:///b.sqlite").path == str(tmp_path / "b.sqlite")  # type: ignore[attr-defined]
    assert open_store(f"sqlite:///{tmp_path}/c.db").path == str(tmp_path / "c.db")  # type: ignore[attr-defined]
    monkeypatch.setenv("AGL_STORE", str(tmp_path / "env.db"))
    assert open_store().path == str(tmp_path / "env.db")  # type: ignore[attr-defined]
    monkeypatch.setenv("AGL_STORE", "memory")
    assert isinstance(open_store(), InMemoryLightningStore)


@pytest.mark.parametrize("url", ["memroy", "store.json", "sqlite://", "sqlite:///:memory:", "redis://x"])
def test_open_store_refuses_what_it_cannot_tell(url: str) -> None:
    with pytest.raises(ValueError, match="memory") as error:
        open_store(url)
    if "://" not in url or url == "redis://x":  # the message names every form it knows
        assert "http://host:port" in str(error.value) and "postgresql://" in str(error.value)


def test_an_agent_error_with_a_lone_surrogate_fails_its_rollout_at_once(
    tmp_path: Path, dev_an_agent_that_fails: Any
) -> None:
    """complete_attempt raised UnicodeEncodeError ("\\ud83d", half an emoji from a cut-off model reply): the runner
    died and the rollout waited for its heartbeat timeout, its error lost; the root span was refused too."""
    with SqliteLightningStore(tmp_path / "store.db") as store:
        row = dev_an_agent_that_fails(store, "model said \ud83d", "could not parse answer: \ud83d")
        assert "could not parse answer: \ufffd" in (row.error or "")
        names = [span.name for span in store.query_spans(row.rollout_id)]
        assert "agl.rollout" in names and "agl.message" in names, names


READER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN")
conn.execute("SELECT count(*) FROM spans").fetchone()  # holds this snapshot until killed
print("reading", flush=True)
time.sleep(120)
"""


def test_vacuum_says_when_a_reader_keeps_the_space_from_returning(tmp_path: Path, make_span: Any) -> None:
    """With another process reading, VACUUM's copy stayed in the WAL and `agl store prune --vacuum` reported a
    bigger file as if vacuum had worked: the checkpoint's busy result was ignored."""
    path = tmp_path / "s.db"
    store = SqliteLightningStore(path, busy_timeout=1.0)
    store.enqueue_rollout({"q": 1})
    rollout = store.dequeue_rollout("runner")
    store.add_spans([make_span(rollout, i, attributes={"blob": "x" * 10_000}) for i in range(50)])
    store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
    store.delete_spans([rollout.rollout_id])
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
        assert store.vacuum() is False
    finally:
        reader.kill()
        reader.wait()
    # The reader is gone: the next vacuum folds the log back. (Tried a few times: once, in a loaded CI run, a
    # checkpoint right after the kill still found a read lock held.)
    assert _vacuumed_within(store, 5.0)
    store.close()


def _vacuumed_within(store: SqliteLightningStore, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not store.vacuum():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _foreign_file(path: Path, sql: str) -> bytes:
    with sqlite3.connect(path) as conn:
        conn.executescript(sql)
    conn.close()
    return path.read_bytes()


@pytest.mark.parametrize("create", [False, True])
def test_a_foreign_spans_table_is_refused_before_anything_is_written(tmp_path: Path, create: bool) -> None:
    """A database of another application with a table named `spans` was stamped as an agl store (schema 1,
    WAL), agl's other tables created beside it: its rows read as agl spans, and every span write failed."""
    path = tmp_path / "app.db"
    before = _foreign_file(path, "CREATE TABLE spans (x TEXT); INSERT INTO spans VALUES ('mine');")
    with pytest.raises(
        StoreAddressError,
        match=r"app.db is a SQLite database \(tables: spans\) but not an agl store "
        r"\(its table 'spans' has other columns \(x\)\); agl left it untouched",
    ):
        open_store(str(path), create=create)
    assert path.read_bytes() == before and not Path(f"{path}-wal").exists()


def test_open_only_refuses_any_file_that_is_not_an_agl_store(tmp_path: Path) -> None:
    """``create=False`` (the reading commands) turned another application's database, or an empty file, into a
    store; a store agl wrote still opens."""
    app = tmp_path / "app.db"
    before = _foreign_file(app, "CREATE TABLE users (name TEXT); PRAGMA user_version = 1;")
    with pytest.raises(StoreAddressError, match=r"\(tables: users\) but not an agl store; agl left it untouched"):
        SqliteLightningStore(app, create=False)
    assert app.read_bytes() == before
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(StoreAddressError, match="is an empty SQLite file, not an agl store"):
        open_store(str(empty), create=False)
    assert empty.stat().st_size == 0
    with pytest.raises(StoreNotFoundError):
        SqliteLightningStore(tmp_path / "missing.db", create=False)
    assert not (tmp_path / "missing.db").exists()
    SqliteLightningStore(tmp_path / "s.db").close()
    with SqliteLightningStore(tmp_path / "s.db", create=False) as store:
        assert store.stats().rollouts["queued"] == 0
