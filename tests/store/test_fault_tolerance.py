"""Fault tolerance with real processes: runners and the store server are killed with SIGKILL mid-work.

`agl runner` (a RunnerPool of forked runner processes) talks to `agl store serve` over HTTP on 127.0.0.1,
exactly as on two machines. Nothing is mocked: the kills are real, and so are the heartbeat timeouts,
the server's reaper, the pool's respawn and the client's retries.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from agl.store import EnqueueRequest, SqliteLightningStore
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.testing.waiting import eventually
from agl.types import RolloutConfig

TOKEN = "ft-token"

AGENT = '''
import os
import time
from pathlib import Path

import agl

MARKS = Path(os.environ["AGL_FT_MARKS"])


def agent(task, rollout):
    """Three message spans; the first attempt of a "hang" task stops after one span (to be killed there)."""
    attempt = rollout.attempt.sequence
    agl.emit_message(f"attempt {attempt} started")
    (MARKS / f"{rollout.rollout_id}-{attempt}.pid").write_text(str(os.getpid()))
    if task.get("hang") and attempt == 1:
        time.sleep(600)
    for step in range(2):
        time.sleep(task.get("pause", 0.0))
        agl.emit_message(f"step {step}")
    return 1.0
'''
#: What a finished attempt of the agent above stores: its three messages, the rollout's root span and the
#: reward span the runner writes for the returned reward.
FULL_ATTEMPT = Counter({"agl.message": 3, "agl.rollout": 1, "agl.reward": 1})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def agent_file(tmp_path: Path) -> Path:
    path = tmp_path / "ft_agent.py"
    path.write_text(AGENT)
    (tmp_path / "marks").mkdir()
    return path


def agl_command(*args: str) -> List[str]:
    """The ``agl`` command line ``agl ARGS...`` of this interpreter."""
    return [sys.executable, "-m", "agl.cli", *args]


def runner_command(agent_file: Path, url: str, *options: str) -> Tuple[List[str], Dict[str, str]]:
    """``agl runner`` of the test agent against the store at ``url`` with the test's token, and its environment."""
    env = {**os.environ, "AGL_FT_MARKS": str(agent_file.parent / "marks")}
    return agl_command("runner", "--store", url, "--agent", f"{agent_file}:agent", "--token", TOKEN, *options), env


def start_runners(agent_file: Path, url: str, n: int, log: Path, *options: str) -> subprocess.Popen[bytes]:
    cmd, env = runner_command(agent_file, url, "--n-runners", str(n), "--heartbeat-interval", "0.2", *options)
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM, as a process manager would; the runner command must leave cleanly and soon."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"agl runner ignored SIGTERM:\n{log.read_text()}") from None
    assert code == 0, log.read_text()


def span_names(store: RemoteLightningStore, rollout_id: str, attempt_id: Optional[str] = "latest") -> Counter:
    return Counter(s.name for s in store.query_spans(rollout_id, attempt_id))


def test_a_runner_killed_mid_rollout_is_replaced_and_its_rollout_retried(tmp_path: Path, agent_file: Path) -> None:
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"t": TOKEN}))).start()
    client = RemoteLightningStore(server.url, token=TOKEN)
    log = tmp_path / "runner.log"
    config = RolloutConfig(max_attempts=2, heartbeat_timeout_seconds=1.5)
    hang, *others = client.enqueue_many(
        [EnqueueRequest(input={"hang": True}, config=config)]
        + [EnqueueRequest(input={}, config=config) for _ in range(3)]
    )
    runners = start_runners(agent_file, server.url, 2, log)
    try:
        first_pid = tmp_path / "marks" / f"{hang.rollout_id}-1.pid"
        eventually(first_pid.exists, 60, f"the first attempt to start\n{log.read_text()}")
        first_attempt = client.query_attempts(hang.rollout_id)[0]
        eventually(lambda: span_names(client, hang.rollout_id)["agl.message"] == 1, 10, "its first span")
        os.kill(int(first_pid.read_text()), signal.SIGKILL)

        done = client.wait_for_rollouts([hang.rollout_id] + [r.rollout_id for r in others], timeout=60)
        assert [r.status for r in done] == ["succeeded"] * 4, log.read_text()
        attempts = client.query_attempts(hang.rollout_id)
        # its pool saw the death and ended the attempt at once, saying how (before: its heartbeat timeout did)
        assert [a.status for a in attempts] == ["failed", "succeeded"]
        assert "died (killed by signal 9: out of memory or kill -9?) while running this rollout" in (
            attempts[0].error or ""
        )
        assert attempts[0].attempt_id == first_attempt.attempt_id and attempts[0].runner_id != attempts[1].runner_id
        second_pid = (tmp_path / "marks" / f"{hang.rollout_id}-2.pid").read_text()
        assert second_pid != first_pid.read_text(), "the retry ran in another (respawned or other) runner process"
        # the killed attempt's span is kept under its own attempt; the retry starts clean and is complete
        killed = client.query_spans(hang.rollout_id, first_attempt.attempt_id)
        assert [s.name for s in killed] == ["agl.message"] and killed[0].attributes.get(
            "agl.message.body"
        ) == "attempt 1 started"
        assert span_names(client, hang.rollout_id) == FULL_ATTEMPT
        assert all(s.attempt_id == attempts[1].attempt_id for s in client.query_spans(hang.rollout_id))
        assert client.stats().rollouts["succeeded"] == 4 and client.stats().attempts == 5
    finally:
        stop(runners, log)
        client.close()
        server.stop()
        backing.close()
    assert "replaced" in log.read_text()


class ServerProcess:
    """`agl store serve` in a subprocess, on a fixed port so that it can be killed and started again."""

    def __init__(self, db: Path, log: Path) -> None:
        self.db, self.log, self.port = db, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> None:
        cmd = agl_command("store", "serve", "--store", str(self.db), "--port", str(self.port), "--token", TOKEN)
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        probe = RemoteLightningStore(self.url, token=TOKEN, retries=0)
        eventually(lambda: _answers(probe), 60, f"the store server to start\n{self.log.read_text()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no graceful shutdown, requests in flight are cut
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _answers(store: RemoteLightningStore) -> bool:
    try:
        store.stats()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path / "store.db", tmp_path / "server.log")
    server.start()
    yield server
    server.stop()


def test_store_server_killed_and_restarted_mid_batch_loses_nothing(
    tmp_path: Path, agent_file: Path, server_process: ServerProcess
) -> None:
    n = 60
    trainer = RemoteLightningStore(server_process.url, token=TOKEN)
    config = RolloutConfig(max_attempts=3, heartbeat_timeout_seconds=4.0)
    ids = [
        r.rollout_id
        for r in trainer.enqueue_many([EnqueueRequest(input={"pause": 0.03}, config=config) for _ in range(n)])
    ]
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server_process.url, 3, log)
    try:
        eventually(
            lambda: trainer.stats().rollouts["succeeded"] >= n // 4, 60, f"a quarter of the batch\n{log.read_text()}"
        )
        server_process.kill()
        time.sleep(0.5)
        server_process.start()  # same file, same port: runners and trainer retry through the gap
        done = trainer.wait_for_rollouts(ids, timeout=120)
        assert len(done) == n and all(r.status == "succeeded" for r in done), Counter(r.status for r in done)
        stats = trainer.stats()
        assert sum(stats.rollouts.values()) == n, "nothing enqueued twice"
        for rollout_id in ids:
            attempts = trainer.query_attempts(rollout_id)
            assert attempts[-1].status == "succeeded"
            assert all(a.status == "unresponsive" for a in attempts[:-1]), attempts
            assert span_names(trainer, rollout_id) == FULL_ATTEMPT, f"spans of {rollout_id} were lost"
        everything = sum(len(trainer.query_spans(i, None)) for i in ids)
        assert stats.spans == everything >= n * sum(FULL_ATTEMPT.values())
    finally:
        stop(runners, log)
        trainer.close()


def test_a_trainer_without_local_runners_uses_runners_started_elsewhere(tmp_path: Path, agent_file: Path) -> None:
    """Disaggregation: the trainer only enqueues and waits; `agl runner` processes do every rollout."""
    import agl

    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"t": TOKEN}))).start()
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server.url, 2, log)
    try:
        trainer = agl.Trainer(n_runners=0, store=RemoteLightningStore(server.url, token=TOKEN), progress=False)
        summaries = trainer.dev(
            agl.rollout(lambda task: 0.0), dev_dataset=[{"n": i} for i in range(4)], print_table=False
        )
    finally:
        stop(runners, log)
        server.stop()
    assert [s.status for s in summaries] == ["succeeded"] * 4
    assert [s.reward for s in summaries] == [1.0] * 4  # the remote agent's reward, not the local stand-in's
    assert all(s.spans == sum(FULL_ATTEMPT.values()) for s in summaries)
    with pytest.raises(ValueError, match="n_runners must be >= 0"):
        agl.Trainer(n_runners=-1, store=backing)
    backing.close()


def test_a_training_run_rides_out_a_store_server_outage_longer_than_the_clients_retries(
    tmp_path: Path, server_process: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer and its runners on a store server that is down for a while (a restart, a network blip):
    a call that ran out of retries ended the run (the trainer's wait) or crashed the runner and threw away a
    finished rollout's result (its completion). Trainer(store_outage_timeout=) keeps them trying."""
    import threading

    import agl

    @agl.rollout
    def slow(task):
        time.sleep(0.4)
        agl.emit_message(f"task {task['n']}")
        return 1.0

    # retries=1: the client alone gives up after ~0.1 s, so the 3 s outage is far beyond it
    store = RemoteLightningStore(server_process.url, token=TOKEN, retries=1)
    trainer = agl.Trainer(store=store, n_runners=2, runner_mode="thread", progress=False, store_outage_timeout=60)
    assert store.outage_timeout == 60
    result: List[object] = []
    run = threading.Thread(
        target=lambda: result.append(trainer.dev(slow, [{"n": i} for i in range(8)], print_table=False))
    )
    run.start()
    probe = RemoteLightningStore(server_process.url, token=TOKEN, retries=0)
    eventually(lambda: probe.stats().rollouts.get("succeeded", 0) >= 1, 60, "a first rollout")
    server_process.kill()
    time.sleep(3.0)
    server_process.start()
    run.join(120)
    assert not run.is_alive() and result, "the run ended with an error (see the log)"
    (summaries,) = result
    assert [s.status for s in summaries] == ["succeeded"] * 8  # type: ignore[attr-defined]
    assert probe.stats().rollouts == {"queued": 0, "running": 0, "succeeded": 8, "failed": 0, "cancelled": 0}
    assert all(s.spans >= 2 for s in summaries), "every rollout's spans are stored"  # type: ignore[attr-defined]
    assert "has not answered" in caplog.text and "still trying, up to 60 s" in caplog.text
    store.close()
    probe.close()


def test_agl_runner_started_before_its_store_server_waits_for_it(tmp_path: Path, agent_file: Path) -> None:
    """docker compose or a Job starts the runners and the store server together: `agl runner` gave up when
    the server took longer than its client's retries (8-16 s) to come up. It now waits (--wait-for-store)."""
    server = ServerProcess(tmp_path / "store.db", tmp_path / "server.log")  # not started yet
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server.url, 1, log)
    try:
        eventually(
            lambda: "does not answer yet" in log.read_text(), 60, f"the runner to say it waits\n{log.read_text()}"
        )
        assert runners.poll() is None, log.read_text()
        server.start()
        trainer = RemoteLightningStore(server.url, token=TOKEN)
        ids = [r.rollout_id for r in trainer.enqueue_many([EnqueueRequest(input={}) for _ in range(2)])]
        done = trainer.wait_for_rollouts(ids, timeout=60)
        assert [r.status for r in done] == ["succeeded", "succeeded"], log.read_text()
        trainer.close()
    finally:
        stop(runners, log)
        server.stop()


def test_agl_runner_gives_up_on_a_store_that_never_answers_after_wait_for_store(agent_file: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    cmd, env = runner_command(agent_file, url, "--wait-for-store", "2")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert f"the store at {url} did not answer within 2 s (--wait-for-store)" in result.stderr


def test_a_rollout_killed_after_stop_timeout_is_retried_at_once(tmp_path: Path, agent_file: Path) -> None:
    """SIGTERM (a Kubernetes scale-down) with a rollout running past --stop-timeout: its runner is killed, and
    its attempt stayed running until the heartbeat timeout (120 s by default), then failed as unresponsive.
    The pool knows which attempt it killed: it ends it as failed, saying why, and the retry is queued now."""
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"t": TOKEN}))).start()
    trainer = RemoteLightningStore(server.url, token=TOKEN)
    config = RolloutConfig(max_attempts=2, heartbeat_timeout_seconds=300)
    (rollout,) = trainer.enqueue_many([EnqueueRequest(input={"hang": True}, config=config)])
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server.url, 1, log, "--stop-timeout", "1")
    try:
        marks = agent_file.parent / "marks"
        eventually(
            lambda: (marks / f"{rollout.rollout_id}-1.pid").exists(), 60, f"the rollout to start\n{log.read_text()}"
        )
        stop(runners, log)
        (first,) = trainer.query_attempts(rollout.rollout_id)[:1]
        assert first.status == "failed", log.read_text()
        assert first.error and "stopped by SIGTERM; busy runners get --stop-timeout 1 s" in first.error
        assert trainer.get_rollout(rollout.rollout_id).status == "queued", "the retry waits for a runner now"
    finally:
        if runners.poll() is None:
            runners.kill()
        trainer.close()
        server.stop()
        backing.close()


def test_agl_runner_exits_when_its_store_server_is_gone_past_the_outage_timeout(
    tmp_path: Path, agent_file: Path
) -> None:
    """A store server gone for good: past --outage-timeout the runners went on "asking again" for ever, so a
    Kubernetes Job of them never ended. `agl runner` now exits non-zero, saying so."""
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"t": TOKEN}))).start()
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server.url, 2, log, "--outage-timeout", "1")
    try:
        eventually(lambda: "runner(s) on" in log.read_text(), 60, f"the runners to start\n{log.read_text()}")
        server.stop()
        code = runners.wait(90)
        text = log.read_text()
        assert code == 2, text
        assert "past the outage timeout of 1 s (--outage-timeout); giving up" in text
        assert "agl: runner agl-runner-" in text and "did not answer for its whole outage timeout" in text
        assert "Traceback" not in text
    finally:
        if runners.poll() is None:
            runners.kill()
        server.stop()
        backing.close()


def test_agl_store_serve_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """uvicorn re-raised SIGTERM after its graceful shutdown: the process died of it (exit 143, a failure
    to systemd and Kubernetes) before the store was closed."""
    server = ServerProcess(tmp_path / "store.db", tmp_path / "server.log")
    server.start()
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.log.read_text()
    assert "agl: store server stopped; SqliteLightningStore(" in server.log.read_text()


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's zombie waits for a reaper that a container may not have)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _runner_processes(pid: int) -> List[int]:
    """The runner processes of the pool process ``pid``: its children, less spawn's resource tracker."""
    children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [child for child in children if b"resource_tracker" not in _cmdline(child)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child pids from Linux's /proc")
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_runner_processes_leave_when_agl_runner_is_killed(
    tmp_path: Path, agent_file: Path, start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of `agl runner` left its runner processes running as orphans, claiming work nobody watched;
    a restarted `agl runner` then doubled the runners. Killed as its runner processes start (here: at once),
    before they had read their parent's pid, they took their reaper for it and stayed (a CI failure; spawn's
    slow start makes that window wide)."""
    monkeypatch.setenv("AGL_START_METHOD", start_method)
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet({"t": TOKEN}))).start()
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server.url, 2, log)
    try:
        eventually(lambda: len(_runner_processes(runners.pid)) == 2, 60, f"two runner processes\n{log.read_text()}")
        children = _runner_processes(runners.pid)
        runners.kill()
        runners.wait(10)
        eventually(lambda: not any(_alive(pid) for pid in children), 15, "the orphaned runner processes to leave")
        assert "its pool process" in log.read_text() and "is gone; leaving" in log.read_text()
    finally:
        if runners.poll() is None:
            runners.kill()
        server.stop()
        backing.close()


def test_agl_runner_reports_a_rollout_that_ended_while_the_store_server_was_down(
    tmp_path: Path, agent_file: Path, server_process: ServerProcess
) -> None:
    """The rollout finishes during an outage longer than the client's retries (8-16 s): the runner crashed on
    its completion, the pool respawned it, and the finished result was thrown away (the attempt then ran out
    its heartbeat timeout and failed). `agl runner --outage-timeout` keeps the completion trying."""
    trainer = RemoteLightningStore(server_process.url, token=TOKEN)
    (rollout,) = trainer.enqueue_many([EnqueueRequest(input={"pause": 1.0})])
    log = tmp_path / "runner.log"
    runners = start_runners(agent_file, server_process.url, 1, log)
    try:
        eventually(
            lambda: span_names(trainer, rollout.rollout_id)["agl.message"] >= 1,
            60,
            f"the rollout to start\n{log.read_text()}",
        )
        server_process.kill()
        time.sleep(18.0)  # the rollout ends (2 s) and its completion outlasts the client's own retries
        server_process.start()
        (done,) = trainer.wait_for_rollouts([rollout.rollout_id], timeout=60)
        assert done.status == "succeeded" and done.n_attempts == 1, log.read_text()
        assert span_names(trainer, rollout.rollout_id) == FULL_ATTEMPT, "spans queued during the outage were stored"
        assert "still trying" in log.read_text() and "Traceback" not in log.read_text()
    finally:
        stop(runners, log)
        trainer.close()


def test_an_agent_error_larger_than_the_servers_body_limit_is_reported_cut(tmp_path: Path) -> None:
    """An exception carrying megabytes (a whole document in a ValueError): the completion was over the store
    server's body limit, the runner crashed on it, and the rollout ended as "runner presumed dead", its real
    error lost. The runner keeps the head and tail of a long error."""
    import agl
    from agl.store.http.server import ServerLimits

    @agl.rollout
    def parser(task):
        raise ValueError("cannot parse: " + "x" * 2_000_000 + " (end of document)")

    backing = SqliteLightningStore(tmp_path / "store.db")
    limits = ServerLimits(max_body_bytes=1024 * 1024)
    server = ServerThread(create_app(backing, tokens=TokenSet({"t": TOKEN}), limits=limits)).start()
    try:
        trainer = agl.Trainer(
            store=RemoteLightningStore(server.url, token=TOKEN),
            runner_mode="thread",
            progress=False,
            heartbeat_timeout=15.0,
        )
        (row,) = trainer.dev(parser, [{"doc": 1}], print_table=False)
    finally:
        server.stop()
    assert row.status == "failed" and row.error is not None
    assert row.error.startswith("ValueError: cannot parse: xxx") and row.error.endswith("x (end of document)")
    assert "characters cut" in row.error and len(row.error) < 20_000
    backing.close()
