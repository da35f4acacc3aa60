"""Agent Lightning's store API on agl's stores: its code awaits every call (``await store.query_spans(rid)``), agl's
calls them as plain functions, and both work on every store (in memory, a SQLite file, a store server on 127.0.0.1
over SQLite, PostgreSQL). Also its store classes: LightningStoreServer / LightningStoreClient and the rest."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from agl.errors import DuplicateResourcesError, StoreUnavailableError, UnsupportedStoreError
from agl.store import (
    CollectionBasedLightningStore,
    InMemoryLightningStore,
    LightningStore,
    LightningStoreClient,
    LightningStoreServer,
    LightningStoreThreaded,
    MongoLightningStore,
    SqliteLightningStore,
)
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.testing.postgres import PostgresServer, PostgresUnavailableError, postgres_for_tests
from agl.types import LLM, PromptTemplate, Rollout, Span

_span_ids = itertools.count(1)


def span_of(rollout: Rollout, sequence_id: int, name: str = "llm-call") -> Span:
    """A span of ``rollout``'s running attempt, as a tracer would send it."""
    assert rollout.attempt is not None
    now = time.time_ns()
    return Span(
        rollout_id=rollout.rollout_id,
        attempt_id=rollout.attempt.attempt_id,
        sequence_id=sequence_id,
        trace_id="cd" * 16,
        span_id=f"{next(_span_ids):016x}",
        name=name,
        kind="llm",
        start_time=now,
        end_time=now + 1_000,
        attributes={"n": sequence_id},
    )


class Served(RemoteLightningStore):
    """A store server (agl store serve's app) on 127.0.0.1 over a SQLite file, and its client; closing the client
    stops the server and closes the file."""

    def __init__(self, path: Path) -> None:
        self.backing = SqliteLightningStore(path)
        self.server = ServerThread(create_app(self.backing, tokens=TokenSet({"test": "peer-token"}))).start()
        super().__init__(self.server.url, token="peer-token", retries=2)

    def close(self) -> None:
        super().close()
        self.server.stop()
        self.backing.close()


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for this module ($AGL_TEST_POSTGRES_DSN's, else a throwaway one); none: the test fails."""
    try:
        with postgres_for_tests() as server:
            yield server
    except PostgresUnavailableError as exc:
        pytest.fail(f"these tests need a PostgreSQL server: {exc}", pytrace=False)


@pytest.fixture(params=["memory", "sqlite", "http", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LightningStore]:
    if request.param == "postgres":
        made: LightningStore = request.getfixturevalue("postgres_server").open_store()
    else:
        made = {
            "memory": InMemoryLightningStore,
            "sqlite": lambda: SqliteLightningStore(tmp_path / "store.db"),
            "http": lambda: Served(tmp_path / "served.db"),
        }[request.param]()
    yield made
    made.close()


# -- Agent Lightning's way: every call awaited in a coroutine ---------------------------------------------------------


async def test_start_rollout_then_spans_then_query_then_complete(store: LightningStore) -> None:
    queued = await store.enqueue_rollout(input="waits in the queue")
    rollout = await store.start_rollout(input={"origin": "write_traces"})
    assert rollout.status == "running" and rollout.attempt is not None and rollout.attempt.sequence == 1
    spans = [span_of(rollout, i) for i in range(3)]
    assert await store.add_span(spans[0]) == spans[0]
    assert await store.add_many_spans(spans[1:]) == spans[1:]
    assert await store.add_span(spans[0]) is None  # already stored
    assert await store.query_spans(rollout_id=rollout.rollout_id) == spans
    assert await store.query_spans(rollout.rollout_id, rollout.attempt.attempt_id) == spans
    done = await store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
    assert done.status == "succeeded" and done.final_reward == 1.0
    assert await store.get_rollout_by_id(rollout.rollout_id) == done
    assert await store.get_rollout_by_id("ro-unknown") is None
    assert await store.get_latest_attempt(rollout.rollout_id) == done.attempt
    assert await store.get_latest_attempt(queued.rollout_id) is None
    # the started rollout skipped the queue: what waits there is still the one enqueued before it
    claimed = await store.dequeue_rollout(worker_id="runner-1")
    assert claimed is not None and claimed.rollout_id == queued.rollout_id
    assert (await store.statistics())["total_rollouts"] == 2


def run_one_rollout(store: LightningStore, reward: float) -> None:
    """A runner's side, in ordinary code: the same store calls give values."""
    rollout = store.dequeue_rollout("runner-1", timeout=30)
    assert isinstance(rollout, Rollout) and rollout.attempt is not None
    resources = store.get_resources(rollout.resources_id)
    assert resources is not None and isinstance(resources.resources["main_prompt"], PromptTemplate)
    assert store.add_spans([span_of(rollout, 0, "agent")]) == 1
    store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=reward)


async def test_enqueue_a_runner_dequeues_and_wait_for_rollouts(store: LightningStore) -> None:
    resources = await store.add_resources({"main_prompt": PromptTemplate(template="{q}", engine="f-string")})
    rollout = await store.enqueue_rollout(input="Why is the sky?", mode="test", resources_id=resources.resources_id)
    assert rollout.mode == "val"  # Agent Lightning's "test" rollouts are agl's "val"
    assert [r.rollout_id for r in await store.query_rollouts(status_in=["queuing"])] == [rollout.rollout_id]
    assert await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=0.0) == []
    runner = threading.Thread(target=run_one_rollout, args=(store, 0.75))
    runner.start()
    finished = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=30)
    runner.join()
    assert [(r.status, r.final_reward) for r in finished] == [("succeeded", 0.75)]
    assert [s.name for s in await store.query_spans(rollout.rollout_id)] == ["agent"]
    assert await store.query_rollouts(status_in=["queuing", "preparing", "running"]) == []


async def test_resources_the_agent_lightning_way(store: LightningStore) -> None:
    assert await store.get_latest_resources() is None
    first = await store.add_resources({"main_llm": LLM(endpoint="http://127.0.0.1:1/v1", model="m1")})
    second = await store.update_resources("res-chosen", {"main_llm": LLM(endpoint="http://127.0.0.1:1/v1", model="m2")})
    assert second.resources_id == "res-chosen" and await store.get_latest_resources() == second
    assert await store.get_resources_by_id(first.resources_id) == first
    assert await store.get_resources_by_id("res-unknown") is None
    assert await store.query_resources(resources_id=first.resources_id) == [first]
    with pytest.raises(DuplicateResourcesError, match="never overwritten"):
        await store.update_resources("res-chosen", {})  # agl's versions are immutable


async def test_calls_agl_has_no_counterpart_for_say_what_to_use() -> None:
    store = InMemoryLightningStore()
    rollout = await store.start_rollout("task")
    with pytest.raises(UnsupportedStoreError, match=r"update_rollout\(\) is Agent Lightning's; .*cancel_rollout"):
        await store.update_rollout(rollout.rollout_id, status="failed")
    with pytest.raises(UnsupportedStoreError, match="get_latest_resources"):
        await store.query_resources()
    with pytest.raises(UnsupportedStoreError, match=r"update_attempt\(metadata=...\).*complete_attempt"):
        await store.update_attempt(rollout.rollout_id, "latest", metadata={})
    ended = await store.update_attempt(rollout.rollout_id, "latest", status="failed")
    assert ended.status == "failed" and (await store.get_rollout(rollout.rollout_id)).status == "failed"


# -- agl's way: values, from ordinary code and from agl's own coroutines ---------------------------------------------


def test_ordinary_code_gets_values(store: LightningStore) -> None:
    rollout = store.start_rollout(input="sync", mode="train")
    assert isinstance(rollout, Rollout) and rollout.attempt is not None
    assert store.add_span(span_of(rollout, 0)) is not None
    assert [s.sequence_id for s in store.query_spans(rollout.rollout_id)] == [0]
    found = store.get_rollout_by_id(rollout.rollout_id)
    assert isinstance(found, Rollout) and found.status == "running"
    assert store.statistics()["total_spans"] == 1


async def test_a_comprehension_in_a_coroutine_awaits_like_its_coroutine() -> None:
    store = InMemoryLightningStore()
    rollouts = [await store.enqueue_rollout(input=i) for i in range(2)]
    assert [r.input for r in [await store.get_rollout(r.rollout_id) for r in rollouts]] == [0, 1]


async def test_agl_coroutines_get_values(monkeypatch: pytest.MonkeyPatch) -> None:
    # the store server's endpoints are coroutines of agl's: they call an in-process store on the event loop
    # (inline) and must get values, while this test's own coroutine gets awaitables from the same store
    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    backing = InMemoryLightningStore()
    server = LightningStoreServer(backing, "127.0.0.1", 0)
    await server.start()
    client = LightningStoreClient(server.url)
    try:
        rollout = await backing.enqueue_rollout(input="through the server")
        claimed = await client.dequeue_rollout(worker_id="remote-runner")
        assert claimed is not None and claimed.rollout_id == rollout.rollout_id
        assert (await backing.get_rollout(rollout.rollout_id)).status == "running"
    finally:
        await client.close()
        await server.stop()


# -- Agent Lightning's store classes ------------------------------------------------------------------------------


async def test_lightning_store_server_and_client_round_trip(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    caplog.set_level(logging.INFO, logger="agl.store")
    server = LightningStoreServer(store=InMemoryLightningStore(), host="127.0.0.1", port=0, launch_mode="asyncio")
    await server.start()
    client = LightningStoreClient(server.url, retry_delays=[0.1, 0.2], connection_timeout=1.0)
    try:
        await server.add_resources({"main_prompt": PromptTemplate(template="{q}", engine="f-string")})
        started = await client.start_rollout(input={"origin": "client"})
        assert started.attempt is not None
        await client.add_span(span_of(started, 0))
        await client.complete_attempt(started.rollout_id, started.attempt.attempt_id, "succeeded", reward=0.5)
        assert [r.final_reward for r in await server.wait_for_rollouts(rollout_ids=[started.rollout_id])] == [0.5]
        assert await server.query_spans(started.rollout_id) == await client.query_spans(started.rollout_id)
        assert (await client.get_latest_resources()) == await server.get_latest_resources()
    finally:
        await client.close()
        await server.stop()
    with pytest.raises(StoreUnavailableError):  # stopped: nothing listens there any more
        await LightningStoreClient(server.url, retry_delays=[]).get_latest_resources()
    assert (await server.get_rollout_by_id(started.rollout_id)) is not None  # still a store after stop()
    unused = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(unused) == 2 and "launch_mode" in unused[0] and "connection_timeout" in unused[1]


def test_a_server_used_from_ordinary_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    server = LightningStoreServer(InMemoryLightningStore(), "127.0.0.1", 0)
    server.start()
    try:
        client = LightningStoreClient(server.url)
        rollout = client.enqueue_rollout(input="sync")
        assert server.get_rollout(rollout.rollout_id).status == "queued"
        client.close()
    finally:
        server.close()


def test_threaded_hands_the_store_back_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agl.store")
    stores = [InMemoryLightningStore(), InMemoryLightningStore()]
    assert [LightningStoreThreaded(s) for s in stores] == stores
    assert [r.getMessage() for r in caplog.records if "LightningStoreThreaded" in r.getMessage()] in (
        [],  # said already by an earlier test of this process
        ["LightningStoreThreaded: agl's stores are thread-safe already; the store is used as it is"],
    )


@pytest.mark.parametrize(
    ("peer", "instead"),
    [(CollectionBasedLightningStore, "SqliteLightningStore"), (MongoLightningStore, "postgresql://")],
)
def test_stores_agl_does_not_have_name_the_one_to_use(peer: Any, instead: str) -> None:
    with pytest.raises(UnsupportedStoreError, match=instead):
        peer(collections=None)


def test_a_client_survives_pickling_with_its_settings() -> None:
    import pickle

    client = LightningStoreClient("http://127.0.0.1:4747", retry_delays=[0.5, 1.0, 2.0])
    copy: LightningStoreClient = pickle.loads(pickle.dumps(client))
    assert (type(copy), copy.url, copy.retries, copy.backoff, copy.max_backoff) == (
        LightningStoreClient,
        client.url,
        3,
        0.5,
        2.0,
    )


async def test_the_awaited_call_runs_off_the_event_loop(tmp_path: Path) -> None:
    # a long wait for rollouts, awaited: the loop goes on (here, enqueueing and finishing the rollout meanwhile)
    store = SqliteLightningStore(tmp_path / "store.db")
    rollout = await store.start_rollout(input="slow")
    assert rollout.attempt is not None
    waiting = asyncio.ensure_future(store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=30))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "failed", error="stopped")
    finished: List[Rollout] = await waiting
    assert [r.status for r in finished] == ["failed"]
    await store.close()
