"""Runners as Ray actors (``agl.runtime.ray_runners``) on a real local Ray cluster, against a real store
server (``agl store serve``'s app with a token, over SQLite and over PostgreSQL): rollouts run in the
actors' processes with their spans and rewards stored; an actor killed mid-rollout is restarted by Ray and
its rollout retried at once, nothing lost and nothing recorded twice."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import ray
from ray_agents import counting_agent

import agl
from agl.runtime import ray_runners
from agl.runtime.ray_runners import RayRunnerPool
from agl.store.base import LightningStore
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.store.postgres.store import PostgresLightningStore
from agl.store.sqlite.store import SqliteLightningStore
from agl.testing.postgres import PostgresServer, postgres_for_tests
from agl.types import Rollout, RolloutConfig

TOKEN = "ray-test-token"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_for_tests() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """``agl store serve``'s app with a token, over a SQLite file or a PostgreSQL database."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            backing: LightningStore = SqliteLightningStore(tmp_path / "store.db")
        else:
            dsn = stack.enter_context(request.getfixturevalue("postgres").store_database())
            backing = PostgresLightningStore(dsn)
        stack.callback(backing.close)
        thread = ServerThread(create_app(backing, tokens=TokenSet({"runners": TOKEN}))).start()
        stack.callback(thread.stop)
        yield thread.url


def wait_until_all_end(
    store: RemoteLightningStore, pool: RayRunnerPool, n: int, within: float = 120.0
) -> List[Rollout]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pool.check()
        rollouts = store.query_rollouts()
        if len(rollouts) == n and all(r.status in ("succeeded", "failed") for r in rollouts):
            return rollouts
        time.sleep(0.2)
    raise AssertionError(f"rollouts still open after {within} s: {[r.status for r in store.query_rollouts()]}")


def test_rollouts_run_in_ray_actors_with_spans_and_rewards(server: str) -> None:
    store = RemoteLightningStore(server, token=TOKEN)
    for n in range(6):
        store.enqueue_rollout({"n": n})
    pool = RayRunnerPool(counting_agent, server, n_runners=2, token=TOKEN, resources={"num_cpus": 0.5})
    with pool:
        rollouts = wait_until_all_end(store, pool, 6)
    assert sorted(r.final_reward for r in rollouts) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(r.status == "succeeded" for r in rollouts)
    pids = set()
    for rollout in rollouts:
        messages = [s for s in store.query_spans(rollout.rollout_id) if "in process" in str(s.attributes)]
        assert len(messages) == 1, rollout
        pids.add(str(messages[0].attributes).split("in process ")[1].split("'")[0].split('"')[0])
    assert str(os.getpid()) not in pids  # run by the actors, not here
    store.close()


def test_an_actor_killed_mid_rollout_is_restarted_and_its_rollout_retried_once(server: str) -> None:
    store = RemoteLightningStore(server, token=TOKEN)
    config = RolloutConfig(max_attempts=3)
    ids = [store.enqueue_rollout({"n": n, "sleep": 2.0}, config=config).rollout_id for n in range(3)]
    pool = RayRunnerPool(counting_agent, server, n_runners=1, token=TOKEN, resources={"num_cpus": 0.5})
    with pool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the pool knows what the actor works on
            pool.check()
            busy = pool._known[0][1]
            if busy is not None:
                break
            time.sleep(0.1)
        assert busy is not None, "the actor never started a rollout"
        ray.kill(pool._actors[0], no_restart=False)  # its process dies; Ray starts it again
        rollouts = wait_until_all_end(store, pool, 3)
        assert pool.respawned == 1
    assert sorted(r.rollout_id for r in rollouts) == sorted(ids)
    assert all(r.status == "succeeded" for r in rollouts), [r.status for r in rollouts]
    killed = busy[0]
    for rollout in rollouts:
        attempts = store.query_attempts(rollout.rollout_id)
        succeeded = [a for a in attempts if a.status == "succeeded"]
        assert len(succeeded) == 1  # nothing recorded twice
        if rollout.rollout_id == killed:
            assert [a.status for a in attempts] == ["failed", "succeeded"]
            assert "Ray runner actor 0 died" in (attempts[0].error or "")
        else:
            assert len(attempts) == 1
    store.close()


def test_a_trainer_runs_its_rollouts_on_ray_actors(server: str) -> None:
    store = RemoteLightningStore(server, token=TOKEN)
    trainer = agl.Trainer(
        n_runners=2, runner_mode="ray", runner_resources={"num_cpus": 0.5}, store=store, progress=False
    )
    summaries = trainer.dev(counting_agent, [{"n": n} for n in range(4)], print_table=False)
    assert sorted(s.reward for s in summaries) == [0.0, 1.0, 2.0, 3.0]
    assert all(s.status == "succeeded" for s in summaries)


def test_ray_settings_are_checked_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="InMemoryLightningStore lives in this one: use a store server"):
        agl.Trainer(n_runners=1, runner_mode="ray", store=agl.InMemoryLightningStore())
    with pytest.raises(ValueError, match="runner_resources places Ray actors: it needs runner_mode='ray'"):
        agl.Trainer(n_runners=1, runner_mode="thread", runner_resources={"num_cpus": 1}, store="memory")
    with pytest.raises(ValueError, match=r"runner_resources has \['cpus'\]"):
        RayRunnerPool(counting_agent, "http://127.0.0.1:1", resources={"cpus": 1})


def test_agl_runner_with_ray_runs_the_rollouts_and_stops_on_sigterm(server: str) -> None:
    store = RemoteLightningStore(server, token=TOKEN)
    for n in range(3):
        store.enqueue_rollout({"n": n})
    agent = f"{Path(__file__).parent / 'ray_agents.py'}:counting_agent"
    command = [sys.executable, "-m", "agl.cli", "runner", "--store", server, "--agent", agent, "--ray", "local"]
    command += ["--n-runners", "2", "--ray-resources", '{"num_cpus": 0.5}']
    process = subprocess.Popen(
        command,
        env={**os.environ, "AGL_STORE_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(r.status != "succeeded" for r in store.query_rollouts()):
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, out
    assert "2 runner(s) as Ray actors on local" in out and TOKEN not in out
    assert sorted(r.final_reward for r in store.query_rollouts()) == [0.0, 1.0, 2.0]
    store.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ray-resources", '{"num_cpus": 1}'], "--ray-resources places Ray actors: add --ray ADDRESS"),
        (["--ray", "local", "--ray-resources", "{num_cpus"], "--ray-resources is not JSON"),
        (["--ray", "local", "--ray-resources", '{"cpus": 1}'], "--ray-resources must be a JSON object of num_cpus"),
    ],
)
def test_agl_runner_ray_options_are_checked(extra: List[str], message: str) -> None:
    command = [sys.executable, "-m", "agl.cli", "runner", "--store", "http://127.0.0.1:9", "--agent", "x:y", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_actor_ray_cannot_place_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_runners, "ASK_TIMEOUT_S", 1.0)
    pool = RayRunnerPool(counting_agent, "http://127.0.0.1:9", resources={"resources": {"tpu": 1}}).start()
    pool.check()
    pool.check()
    pool.stop(timeout=0.5)
    said = [r for r in caplog.records if "has not started yet" in r.getMessage()]
    assert len(said) == 1 and "'tpu': 1" in said[0].getMessage()


def test_an_algorithm_starts_its_ray_before_the_runners_join_it(server: str) -> None:
    calls: List[str] = []

    class StartsRay(agl.Algorithm):
        def start_ray(self) -> None:
            calls.append("start_ray")

        def run(self, train_dataset: Any, val_dataset: Any) -> None:
            calls.append("run")
            rollouts = self.trainer.run_tasks(train_dataset)
            calls.extend(r.status for r in rollouts)

    store = RemoteLightningStore(server, token=TOKEN)
    trainer = agl.Trainer(
        algorithm=StartsRay(), n_runners=1, runner_mode="ray", runner_resources={"num_cpus": 0.5}, store=store
    )
    trainer.fit(counting_agent, train_dataset=[{"n": 1}])
    assert calls == ["start_ray", "run", "succeeded"]
