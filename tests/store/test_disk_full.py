"""A full disk under a SQLite store is an outage, not a crash (issue 36).

The disk fills for real: SQLite's own ``max_page_count`` limit makes SQLite fail writes with SQLITE_FULL, its
error for a full disk (see disk_full.py). Before, that raw sqlite3 error crashed `agl runner`'s processes
(three in ~2 s tripped the crash-loop guard: the runner exited and queued rollouts never ran), and the store
server answered it with 500 and a traceback per request.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import pytest
from disk_full import CONTROL_ENV, limited

from agl.errors import StoreStorageError, StoreUnavailableError
from agl.store import EnqueueRequest, SqliteLightningStore
from agl.store.http.server import ServerThread, create_app
from agl.store.http.server.app import _reap_forever
from agl.store.sqlite.database import SqliteDatabase
from agl.testing.waiting import eventually

BIG = "x" * 30_000  # a rollout input over several pages: claiming or ending its rollout rewrites them

AGENT = """
import time


def agent(task, rollout):
    time.sleep(0.5)
    return 1.0
"""


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The control file of a disk that is full while it exists (stores opened in this test, and in the children
    started with ``$AGL_TEST_DISK_FULL``, live on that disk)."""
    control = tmp_path / "disk-is-full"
    monkeypatch.setattr(SqliteDatabase, "_begin_operation", limited(control))
    yield control
    control.unlink(missing_ok=True)


def test_a_full_disk_raises_a_store_storage_error_and_stores_nothing(tmp_path: Path, disk: Path) -> None:
    store = SqliteLightningStore(tmp_path / "store.db")
    try:
        store.enqueue_rollout({"text": BIG})
        disk.touch()
        with pytest.raises(StoreStorageError) as raised:
            store.enqueue_rollout({"text": BIG})
        assert isinstance(raised.value, StoreUnavailableError)  # an outage to every caller that rides them out
        message = str(raised.value)
        assert f"the disk holding the SQLite store {tmp_path / 'store.db'} is full" in message
        assert "free space on it" in message and "Nothing of this call was stored" in message
        assert store.stats().rollouts["queued"] == 1
        disk.unlink()  # room again: the same calls go through
        assert store.enqueue_rollout({"text": BIG}).status == "queued"
    finally:
        store.close()


def test_a_full_disk_fails_a_claim_with_a_store_storage_error(tmp_path: Path, disk: Path) -> None:
    store = SqliteLightningStore(tmp_path / "store.db")
    try:
        store.enqueue_many([EnqueueRequest(input={"text": BIG}) for _ in range(2)])
        disk.touch()
        with pytest.raises(StoreStorageError, match="is full"):
            store.dequeue_rollout("r")
        assert store.stats().rollouts["queued"] == 2
        disk.unlink()
        assert store.dequeue_rollout("r") is not None
    finally:
        store.close()


def _agl_runner(tmp_path: Path, disk: Path, log: Path, *options: str) -> subprocess.Popen[bytes]:
    """``agl runner`` of the agent above, in a child process whose stores live on ``disk``."""
    agent = tmp_path / "slow_agent.py"
    agent.write_text(AGENT)
    script = Path(__file__).with_name("disk_full.py")
    store = str(tmp_path / "store.db")
    command = [sys.executable, str(script), "runner", "--store", store, "--agent", f"{agent}:agent", *options]
    env = {**os.environ, CONTROL_ENV: str(disk)}
    return subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def test_agl_runner_rides_out_a_full_disk_and_runs_every_queued_rollout(tmp_path: Path, disk: Path) -> None:
    """The disk is full as `agl runner` starts (its runners cannot claim), then again for a few seconds while
    rollouts run (they cannot be ended): runners wait for room instead of crashing, and every queued rollout
    succeeds once there is room again, with `agl runner` still running."""
    store = SqliteLightningStore(tmp_path / "store.db")
    ids = [r.rollout_id for r in store.enqueue_many([EnqueueRequest(input={"text": BIG}) for _ in range(8)])]
    log = tmp_path / "runner.log"
    disk.touch()
    runners = _agl_runner(tmp_path, disk, log, "--n-runners", "2", "--heartbeat-interval", "0.2")

    def succeeded() -> int:
        return sum(r.status == "succeeded" for r in store.query_rollouts(rollout_ids=ids))

    try:
        eventually(lambda: "store unavailable for" in log.read_text(), 60, f"a failed claim\n{log.read_text()}")
        time.sleep(3.0)  # three quick crashes of runner processes ended `agl runner` before
        assert succeeded() == 0 and runners.poll() is None, log.read_text()
        disk.unlink()
        eventually(lambda: succeeded() >= 1, 60, f"a first rollout to succeed\n{log.read_text()}")
        disk.touch()
        eventually(lambda: "the store did not confirm it" in log.read_text(), 60, f"a failed end\n{log.read_text()}")
        time.sleep(2.0)
        assert succeeded() < len(ids)  # the disk was full while work was left
        disk.unlink()
        eventually(lambda: succeeded() == len(ids), 60, f"every rollout to succeed\n{log.read_text()}")
        text = log.read_text()
        assert runners.poll() is None, text  # the runner did not exit
        assert f"the disk holding the SQLite store {tmp_path / 'store.db'} is full" in text
        assert "Traceback" not in text and "died" not in text, text
        assert all(len(store.query_attempts(i)) == 1 for i in ids)  # no attempt was lost or retried
    finally:
        disk.unlink(missing_ok=True)
        runners.send_signal(signal.SIGTERM)
        code = runners.wait(30)
        store.close()
    assert code == 0, log.read_text()


def _post(url: str, body: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_store_server_answers_503_on_a_full_disk_and_logs_it_once(
    tmp_path: Path, disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each request during the full period gets 503 with agl's JSON error (clients retry it), and the log
    holds one line for that failure, not a line or a traceback per request."""
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, allow_anonymous=True))
    server.start()
    enqueue = {"requests": [{"input": {"text": BIG}}]}
    try:
        assert _post(f"{server.url}/v1/rollouts", enqueue)[0] == 200
        caplog.set_level(logging.WARNING, logger="agl.store.http.server")
        disk.touch()
        answers = [_post(f"{server.url}/v1/rollouts", enqueue) for _ in range(5)]
        for status, body in answers:
            assert status == 503
            assert body["error"] == "StoreUnavailableError"  # the class every client raises for an outage
            assert "is full" in body["message"] and "free space" in body["message"]
        lines = [r for r in caplog.records if r.name == "agl.store.http.server"]
        assert len(lines) == 1, caplog.text
        assert "store unavailable, answered 503 (clients retry)" in lines[0].getMessage()
        assert "is full" in lines[0].getMessage() and lines[0].exc_info is None
        disk.unlink()
        status, body = _post(f"{server.url}/v1/rollouts", enqueue)
        assert status == 200 and body["rollouts"][0]["status"] == "queued"
    finally:
        server.stop()
        backing.close()


class UnavailableStore(SqliteLightningStore):
    """A real store whose disk is gone: every reap raises the outage error; counts the reaps."""

    reaps = 0

    def reap_expired(self) -> Any:
        self.reaps += 1
        raise StoreStorageError("the disk under store.db is full: free space on it")


def test_the_store_servers_reaper_logs_an_outage_once_not_every_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = UnavailableStore(tmp_path / "store.db")
    stop = threading.Event()
    caplog.set_level(logging.WARNING, logger="agl.store.http.server")
    reaper = threading.Thread(target=_reap_forever, args=(store, stop, 0.001), daemon=True)
    reaper.start()
    try:
        while store.reaps < 20:
            time.sleep(0.01)
    finally:
        stop.set()
        reaper.join()
        store.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "agl.store.http.server"]
    assert len(lines) == 1 and "could not end expired attempts" in lines[0] and "is full" in lines[0], lines


def test_a_full_disk_under_postgresql_is_the_same_outage(postgres_dsn: str) -> None:
    """PostgreSQL says its disk is full with SQLSTATE 53100 (disk_full), which the store raised as "PostgreSQL
    refused the operation", an AglError that ended runners. Here the real server sends that SQLSTATE, from a
    trigger (a database's disk cannot be filled without root), exactly as a full disk makes it answer."""
    import psycopg

    from agl.store.postgres.store import PostgresLightningStore

    store = PostgresLightningStore(postgres_dsn)
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        admin.execute(
            "CREATE FUNCTION agl_test_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION "
            "'could not extend file \"base/1/2\": No space left on device' USING ERRCODE = 'disk_full'; END $$"
        )
        admin.execute(
            "CREATE TRIGGER disk_full BEFORE INSERT ON agl_rollouts FOR EACH ROW EXECUTE FUNCTION agl_test_disk_full()"
        )
        try:
            with pytest.raises(StoreStorageError) as raised:
                store.enqueue_rollout({"text": "x"})
            assert isinstance(raised.value, StoreUnavailableError)
            assert "its disk is full or failing (could not extend file" in str(raised.value)
            assert "Nothing of this call was stored" in str(raised.value)
            assert store.stats().rollouts["queued"] == 0
            admin.execute("DROP TRIGGER disk_full ON agl_rollouts")  # room again
            assert store.enqueue_rollout({"text": "x"}).status == "queued"
        finally:
            store.close()
