"""What only the HTTP store promises: tokens, limits, clear 4xx that change nothing, long polls, safe retries.

The contract itself runs over HTTP in test_store_contract.py (the "http" backend). Here a real uvicorn
server on 127.0.0.1 serves a SQLite file; requests go through httpx (raw) or RemoteLightningStore.
"""

from __future__ import annotations

import gzip
import http.server
import json
import multiprocessing
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import httpx
import pytest
from local_tcp_listener import LocalListener

from agl.errors import (
    StaleAttemptError,
    StoreAuthError,
    StoreRequestError,
    StoreUnavailableError,
    UnknownAttemptError,
    UnknownRolloutError,
)
from agl.store import EnqueueRequest, LightningStore, SqliteLightningStore, open_store
from agl.store.http.client import RemoteLightningStore
from agl.store.http.server import ServerLimits, ServerThread, TokenSet, create_app
from agl.store.memory import InMemoryLightningStore
from agl.store.postgres.store import PostgresLightningStore
from agl.testing.spans import incompressible_text
from agl.types import LLM, RolloutConfig

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Served:
    """A server thread over a SQLite file, with a raw httpx client and an agl client."""

    def __init__(
        self,
        backing: Union[Path, LightningStore],
        limits: Optional[ServerLimits] = None,
        tokens: Optional[Dict[str, str]] = None,
    ) -> None:
        """``backing``: a SQLite file, or a store (closed with the server)."""
        self.backing = SqliteLightningStore(backing) if isinstance(backing, Path) else backing
        app = create_app(self.backing, tokens=TokenSet(tokens or {"shared": TOKEN}), limits=limits)
        self.thread = ServerThread(app).start()
        self.url = self.thread.url
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.client = RemoteLightningStore(self.url, token=TOKEN, retries=2, backoff=0.01)

    def close(self) -> None:
        self.client.close()
        self.http.close()
        self.thread.stop()
        self.backing.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "store.db")
    yield s
    s.close()


def snapshot(store: SqliteLightningStore) -> Any:
    """Everything a refused request must leave as it was."""
    rollouts = store.query_rollouts()
    return store.stats(), rollouts, [store.query_spans(r.rollout_id, None) for r in rollouts]


def running_rollout(served: Served, **config: Any) -> Any:
    served.client.enqueue_rollout("x", config=RolloutConfig(**config))
    rollout = served.client.dequeue_rollout("runner-1")
    assert rollout is not None and rollout.attempt is not None
    return rollout


def span_json(rollout: Any, span_id: str = "00000000000000aa", **fields: Any) -> Dict[str, Any]:
    span = {
        "rollout_id": rollout.rollout_id,
        "attempt_id": rollout.attempt.attempt_id,
        "sequence_id": 0,
        "trace_id": "ab" * 16,
        "span_id": span_id,
        "name": "step",
        "start_time": 1,
        "end_time": 2,
    }
    span.update(fields)
    return span


# -- tokens -------------------------------------------------------------------------------------------------


def test_no_token_no_access_and_nothing_changes(served: Served) -> None:
    rollout = running_rollout(served)
    before = snapshot(served.backing)
    body = {"requests": [{"input": 1}]}
    missing = served.http.post("/v1/rollouts", json=body)
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert "needs a token" in missing.json()["message"] and "AGL_STORE_TOKEN" in missing.json()["message"]
    wrong = served.http.post("/v1/rollouts", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and "not accepted" in wrong.json()["message"]
    basic = served.http.post("/v1/rollouts", json=body, headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401 and "Bearer <token>" in basic.json()["message"]
    for method, path in [
        ("GET", "/v1/stats"),
        ("GET", f"/v1/rollouts/{rollout.rollout_id}"),
        ("POST", f"/v1/rollouts/{rollout.rollout_id}/cancel"),
        ("POST", "/v1/spans"),
        ("POST", "/v1/spans/delete"),
        ("POST", "/v1/traces"),
        ("GET", "/v1/no-such-endpoint"),  # which paths exist is not told without a token either
    ]:
        assert served.http.request(method, path).status_code == 401, path
    assert served.http.get("/v1/no-such-endpoint", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    assert snapshot(served.backing) == before
    with pytest.raises(StoreAuthError, match="not accepted"):
        RemoteLightningStore(served.url, token="nope").stats()
    assert served.http.get("/healthz").json() == {"status": "ok"}, "liveness needs no token"


def test_per_runner_tokens_from_a_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("# one per runner\nrunner-a tok-a\nrunner-b tok-b  # spare\n\ntok-c\n")
    loaded = TokenSet.load(token=None, tokens_file=str(tokens))
    assert len(loaded) == 3 and loaded.check("tok-b") == "runner-b" and loaded.check("tok-c") == "line-5"
    assert loaded.check("tok-") is None
    served = Served(tmp_path / "store.db", tokens={"runner-a": "tok-a", "runner-b": "tok-b"})
    try:
        for token in ("tok-a", "tok-b"):
            assert RemoteLightningStore(served.url, token=token).stats().spans == 0
        with pytest.raises(StoreAuthError):
            RemoteLightningStore(served.url, token=TOKEN).stats()
    finally:
        served.close()
    (tmp_path / "bad.txt").write_text("name token extra\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        TokenSet.load(tokens_file=str(tmp_path / "bad.txt"))


def test_a_tokens_file_never_cuts_a_secret_at_a_hash_nor_keeps_one_of_two_tokens_of_a_name(tmp_path: Path) -> None:
    """`alice s3cr#t-long` made the server accept `s3cr` (and refuse the real secret); a name written twice
    kept the last token without a word."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("alice s3cr#t-long  # alice's laptop\n#bob old\nbob tok-bob\n")
    loaded = TokenSet.load(token="shared-tok", tokens_file=str(tokens))
    assert loaded.check("s3cr#t-long") == "alice" and loaded.check("s3cr") is None and loaded.check("old") is None
    assert len(loaded) == 3
    tokens.write_text("bob tok-bob-1\nbob tok-bob-2\n")
    with pytest.raises(ValueError, match=r"tokens.txt:2: the name 'bob' is given twice \(also line 1\)"):
        TokenSet.load(token=None, tokens_file=str(tokens))
    tokens.write_text("shared other\n")
    with pytest.raises(ValueError, match="given twice .also the shared token"):
        TokenSet.load(token="shared-tok", tokens_file=str(tokens))


def test_a_token_from_a_secret_file_with_a_trailing_newline_works_on_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Kubernetes secret made with --from-file ends with a newline: the client failed with a raw traceback
    ("HTTP header 'Authorization' has a name with ':'..."), and a server that kept the newline refused every
    client, since no HTTP client can send one. Surrounding whitespace is stripped; what still cannot travel in
    a header is refused, naming the characters and where the token came from."""
    from agl.cli import main

    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN + "\n")
    backing = SqliteLightningStore(tmp_path / "store.db")
    server = ServerThread(create_app(backing, tokens=TokenSet.load())).start()
    try:
        assert RemoteLightningStore(server.url).stats().spans == 0  # $AGL_STORE_TOKEN, newline and all
        assert RemoteLightningStore(server.url, token=f"  {TOKEN}\r\n").stats().spans == 0
        with pytest.raises(StoreAuthError, match=r"the token from token= holds '\\x01', which an HTTP Authorization"):
            RemoteLightningStore(server.url, token="tok\x01en")
        monkeypatch.setenv("AGL_STORE_TOKEN", "two words")
        assert main(["store", "stats", "--store", server.url]) == 2
        err = capsys.readouterr().err
        assert "the token from $AGL_STORE_TOKEN holds ' ', which an HTTP Authorization header cannot carry" in err
    finally:
        server.stop()
        backing.close()
    with pytest.raises(SystemExit, match=r"cannot read the tokens: the token from --token holds '\\n', which an HTTP"):
        main(["store", "serve", "--store", str(tmp_path / "s.db"), "--token", "tok\nen"])


def test_a_server_without_tokens_must_be_asked_for(tmp_path: Path) -> None:
    store = SqliteLightningStore(tmp_path / "s.db")
    with pytest.raises(ValueError, match="needs at least one token"):
        create_app(store, tokens=TokenSet({}))
    create_app(store, allow_anonymous=True)  # explicit opt-out
    store.close()


def test_open_store_opens_the_http_client_with_the_env_token(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)
    store = open_store(served.url)
    assert isinstance(store, RemoteLightningStore)
    assert store.enqueue_rollout("via url").input == "via url"
    assert served.backing.stats().rollouts["queued"] == 1


# -- malformed, oversize and unknown ------------------------------------------------------------------------


def test_malformed_requests_get_422_naming_the_field_and_change_nothing(served: Served) -> None:
    rollout = running_rollout(served)
    before = snapshot(served.backing)
    path = f"/v1/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt.attempt_id}/complete"
    cases = [
        ("/v1/rollouts", {"requests": [{"config": {"max_attempts": 0}}]}, "max_attempts"),
        ("/v1/rollouts", {"requests": [{"mode": "test"}]}, "mode"),
        ("/v1/rollouts", {"requests": [{"rollout_id": "has/slash"}]}, "rollout_id"),
        ("/v1/rollouts", {"requests": "not a list"}, "requests"),
        ("/v1/rollouts/dequeue", {"runner_id": "r", "limit": 0}, "limit"),
        ("/v1/rollouts/dequeue", {"limit": 1}, "runner_id"),
        ("/v1/rollouts/wait", {"rollout_ids": [1, 2], "timeout": -1}, "timeout"),
        ("/v1/rollouts/query", {"status": ["done"]}, "status"),
        (path, {"status": "finished"}, "status"),
        (path, {"status": "succeeded", "reward": "lots"}, "reward"),
        (path + "-and-dequeue", {"status": "succeeded"}, "runner_id"),
        (path + "-and-dequeue", {"status": "succeeded", "runner_id": "r", "limit": 0}, "limit"),
        ("/v1/spans", {"spans": [span_json(rollout, start_time="soon")]}, "start_time"),
        ("/v1/spans", {"spans": [span_json(rollout, surprise=1)]}, "surprise"),
        ("/v1/spans", {"spans": [{"span_id": "x"}]}, "rollout_id"),
        ("/v1/resources", {"resources": {"llm": {"resource_type": "gpu"}}}, "gpu"),
    ]
    for url, body, field in cases:
        response = served.http.post(url, json=body, headers=AUTH)
        assert response.status_code == 422, (url, body, response.text)
        assert field in response.json()["message"], (field, response.json())
    for url in ("/v1/spans", "/v1/rollouts/dequeue", path, path + "-and-dequeue"):  # bodies the endpoints parse
        for raw in (b"{not json", b"", b"[]", b"\xff\xfe"):
            response = served.http.post(url, content=raw, headers={**AUTH, "Content-Type": "application/json"})
            assert 400 <= response.status_code < 500, (url, raw, response.text)
            assert response.json()["message"]
    deep = b"[" * 100_000 + b"]" * 100_000
    assert (
        served.http.post("/v1/rollouts", content=deep, headers={**AUTH, "Content-Type": "application/json"}).status_code
        < 500
    )
    nowhere = served.http.get("/v1/nowhere", headers=AUTH)
    assert nowhere.status_code == 404 and "no endpoint GET /v1/nowhere" in nowhere.json()["message"]
    assert served.http.delete("/v1/stats", headers=AUTH).status_code == 405
    for url in ("/v1/spans", path, path + "-and-dequeue"):  # hot routes: other methods answered by FastAPI
        wrong = served.http.get(url, headers=AUTH)
        assert wrong.status_code == 405 and "GET is not allowed" in wrong.json()["message"], (url, wrong.text)
    assert snapshot(served.backing) == before


def test_unknown_ids_get_404_naming_the_id_and_change_nothing(served: Served) -> None:
    rollout = running_rollout(served)
    before = snapshot(served.backing)
    rid = rollout.rollout_id
    cases = [
        ("GET", "/v1/rollouts/ro-ghost", None, "ro-ghost"),
        ("POST", "/v1/rollouts/ro-ghost/cancel", None, "ro-ghost"),
        ("GET", "/v1/rollouts/ro-ghost/attempts", None, "ro-ghost"),
        ("GET", "/v1/rollouts/ro-ghost/spans", None, "ro-ghost"),
        ("POST", f"/v1/rollouts/{rid}/attempts/at-ghost/heartbeat", None, "at-ghost"),
        ("POST", f"/v1/rollouts/{rid}/attempts/at-ghost/complete", {"status": "succeeded"}, "at-ghost"),
        (
            "POST",
            "/v1/rollouts/ro-ghost/attempts/at-1/complete-and-dequeue",
            {"status": "succeeded", "runner_id": "r"},
            "ro-ghost",
        ),
        ("POST", "/v1/rollouts/wait", {"rollout_ids": [rid, "ro-ghost"]}, "ro-ghost"),
        (
            "POST",
            "/v1/spans",
            {"spans": [span_json(rollout), span_json(rollout, "bb" * 8, attempt_id="at-ghost")]},
            "at-ghost",
        ),
        ("GET", "/v1/resources?resources_id=res-ghost", None, "res-ghost"),
        ("POST", "/v1/rollouts", {"requests": [{"resources_id": "res-ghost"}]}, "res-ghost"),
    ]
    for method, url, body, ghost in cases:
        response = served.http.request(method, url, json=body, headers=AUTH)
        assert response.status_code == 404, (url, response.text)
        assert f"'{ghost}'" in response.json()["message"], response.json()
    assert snapshot(served.backing) == before
    with pytest.raises(UnknownRolloutError, match="'ro-ghost'") as info:
        served.client.get_rollout("ro-ghost")
    assert info.value.rollout_id == "ro-ghost" and isinstance(info.value, KeyError)
    with pytest.raises(UnknownAttemptError) as attempt_info:
        served.client.heartbeat(rid, "at-ghost")
    assert (attempt_info.value.rollout_id, attempt_info.value.attempt_id) == (rid, "at-ghost")
    with pytest.raises(UnknownRolloutError, match="'a/b'"):
        served.client.get_rollout("a/b")  # cannot be a path segment, so it cannot exist either


def test_stale_updates_get_409(served: Served) -> None:
    rollout = running_rollout(served)
    served.client.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
    before = snapshot(served.backing)
    url = f"/v1/rollouts/{rollout.rollout_id}/attempts/{rollout.attempt.attempt_id}/complete"
    response = served.http.post(url, json={"status": "failed"}, headers=AUTH)
    assert response.status_code == 409 and response.json()["error"] == "StaleAttemptError"
    assert snapshot(served.backing) == before


def test_oversize_bodies_get_413_and_change_nothing(tmp_path: Path) -> None:
    served = Served(tmp_path / "store.db", limits=ServerLimits(max_body_bytes=4096))
    try:
        rollout = running_rollout(served)
        before = snapshot(served.backing)
        big = {"spans": [span_json(rollout, f"{i:016x}", attributes={"pad": "x" * 100}) for i in range(60)]}
        response = served.http.post("/v1/spans", json=big, headers=AUTH)
        assert response.status_code == 413 and "4096 bytes" in response.json()["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts while reading
            yield b'{"requests": ['
            for _ in range(500):
                yield b'{"input": "0123456789"},'
            yield b'{"input": 1}]}'

        chunked = served.http.post(
            "/v1/rollouts", content=chunks(), headers={**AUTH, "Content-Type": "application/json"}
        )
        assert chunked.status_code == 413
        host, port = served.url.rsplit("/", 1)[-1].split(":")
        with socket.create_connection((host, int(port))) as raw:  # declares more than it sends: answered first
            raw.sendall(
                f"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 999999\r\n\r\n{}"
            )
            assert raw.recv(4096).startswith(b"HTTP/1.1 413")
        assert snapshot(served.backing) == before
        # the client splits a batch the server finds too large, so the tracer never has to
        spans = [span_json(rollout, f"{i:016x}", attributes={"pad": "x" * 100}) for i in range(60)]
        from agl.types import Span

        assert served.client.add_spans([Span.model_validate(s) for s in spans]) == 60
        assert len(served.backing.query_spans(rollout.rollout_id)) == 60
        huge = Span.model_validate(span_json(rollout, "f" * 16, attributes={"pad": incompressible_text(10_000)}))
        with pytest.raises(StoreRequestError, match="limit of 4096 bytes"):
            served.client.add_spans([huge])
    finally:
        served.close()


def test_an_enqueue_batch_over_the_body_limit_is_sent_in_parts_in_order(tmp_path: Path) -> None:
    """Trainer.dev enqueues a whole data set in one call: 200 tasks of 1 KB against a 64 KB limit."""
    served = Served(tmp_path / "store.db", limits=ServerLimits(max_body_bytes=64 * 1024))
    try:
        requests = [EnqueueRequest(input={"i": i, "doc": "x" * 1000}, task_id=f"t{i}") for i in range(200)]
        rollouts = served.client.enqueue_many(requests)
        assert [r.task_id for r in rollouts] == [f"t{i}" for i in range(200)]
        stored = served.backing.query_rollouts()
        assert [r.rollout_id for r in stored] == [r.rollout_id for r in rollouts]
        assert [r.input["i"] for r in stored] == list(range(200))
        again = served.client.enqueue_many(requests[:150])  # the limit is known now: no 413 first
        assert len(again) == 150 and served.backing.stats().rollouts["queued"] == 350
        with pytest.raises(StoreRequestError, match="limit of 65536 bytes"):
            served.client.enqueue_many([EnqueueRequest(input="y" * 70_000)])  # one task cannot be split
        assert served.backing.stats().rollouts["queued"] == 350
    finally:
        served.close()


def test_gzip_is_not_a_way_around_the_limit(tmp_path: Path) -> None:
    served = Served(tmp_path / "store.db", limits=ServerLimits(max_body_bytes=4096))
    try:
        bomb = gzip.compress(b'{"resourceSpans": [' + b" " * 1_000_000 + b"]}")
        assert len(bomb) < 4096
        headers = {**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"}
        response = served.http.post("/v1/traces", content=bomb, headers=headers)
        assert response.status_code == 413 and "inflates to more than" in response.json()["message"]  # as a large body
    finally:
        served.close()


def test_openapi_documents_every_endpoint(served: Served) -> None:
    schema = served.http.get("/openapi.json").json()  # the description needs no token (docs/store-server.md)
    assert served.http.get("/docs").status_code == 200 and served.http.get("/v1/stats").status_code == 401
    paths = set(schema["paths"])
    for path in [
        "/v1/rollouts",
        "/v1/rollouts/dequeue",
        "/v1/rollouts/wait",
        "/v1/rollouts/query",
        "/v1/rollouts/reap",
        "/v1/rollouts/{rollout_id}",
        "/v1/rollouts/{rollout_id}/cancel",
        "/v1/rollouts/{rollout_id}/attempts",
        "/v1/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat",
        "/v1/rollouts/{rollout_id}/attempts/{attempt_id}/complete",
        "/v1/rollouts/{rollout_id}/attempts/{attempt_id}/complete-and-dequeue",
        "/v1/rollouts/{rollout_id}/spans",
        "/v1/spans",
        "/v1/spans/delete",
        "/v1/traces",
        "/v1/resources",
        "/v1/stats",
    ]:
        assert path in paths, path
    dequeue = schema["paths"]["/v1/rollouts/dequeue"]["post"]
    assert {"401", "404", "413", "422"} <= set(dequeue["responses"])
    assert "Rollout" in schema["components"]["schemas"] and "Span" in schema["components"]["schemas"]
    refs = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            refs.update(v for k, v in node.items() if k == "$ref")
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(schema)
    assert "#/components/schemas/ExportTraceServiceRequest" in refs and "#/components/schemas/Span" in refs
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(schema["components"]["schemas"]), "every $ref resolves"


# -- long polls ---------------------------------------------------------------------------------------------


def test_long_poll_outlasts_the_servers_poll_limit(tmp_path: Path) -> None:
    served = Served(tmp_path / "store.db", limits=ServerLimits(max_poll_seconds=0.2, poll_slice_seconds=0.05))
    try:
        threading.Timer(0.7, lambda: served.backing.enqueue_rollout("late")).start()
        started = time.monotonic()
        rollout = served.client.dequeue_rollout("runner-1", timeout=10)
        assert rollout is not None and rollout.input == "late"
        assert 0.6 < time.monotonic() - started < 5
        threading.Timer(
            0.5, lambda: served.backing.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded")
        ).start()
        (done,) = served.client.wait_for_rollouts([rollout.rollout_id], timeout=None)
        assert done.status == "succeeded"
    finally:
        served.close()


def test_a_runner_that_left_mid_poll_claims_nothing(tmp_path: Path) -> None:
    """A poll whose client gave up (killed runner, timeout) ends within one slice instead of claiming work."""
    served = Served(tmp_path / "store.db", limits=ServerLimits(poll_slice_seconds=0.05))
    try:
        with pytest.raises(httpx.ReadTimeout):
            served.http.post(
                "/v1/rollouts/dequeue", json={"runner_id": "ghost", "timeout": 10}, headers=AUTH, timeout=0.3
            )
        time.sleep(0.3)
        queued = served.backing.enqueue_rollout("for a live runner")
        time.sleep(0.3)
        assert served.backing.get_rollout(queued.rollout_id).status == "queued"
    finally:
        served.close()


def _poll_and_leave(url: str, runner_id: str) -> None:
    """A runner that asks for work and is gone (killed) while the server waits for some: a raw socket that sends
    a long-poll dequeue, sees that it is waiting, and closes."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    body = json.dumps({"runner_id": runner_id, "timeout": 60}).encode()
    head = (
        f"POST /v1/rollouts/dequeue HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            sock.recv(1)  # no answer: the poll waits inside the store


@pytest.mark.parametrize("backend", ["sqlite", "memory", "postgres"])
def test_work_that_arrives_after_a_polling_runner_left_goes_to_a_live_runner(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The server's poll for a runner that has gone still waits inside the store (for up to a slice: a second
    by default, long enough for a scaled-down pool's runners to be handed the next batch; longer here). Work
    enqueued after the server saw the disconnect is not claimed for that runner or, by a store whose wait
    cannot give up (in memory), is handed back at once instead of running until the heartbeat timeout."""
    backing: LightningStore
    if backend == "sqlite":
        backing = SqliteLightningStore(tmp_path / "store.db")
    elif backend == "memory":
        backing = InMemoryLightningStore()
    else:
        backing = PostgresLightningStore(request.getfixturevalue("postgres_dsn"))
    served = Served(backing, limits=ServerLimits(poll_slice_seconds=30))
    try:
        _poll_and_leave(served.url, "ghost")
        time.sleep(1.0)  # the server reads the closed connection (on loopback, within milliseconds)
        queued = served.backing.enqueue_rollout("for a live runner", config=RolloutConfig(max_attempts=2))
        time.sleep(0.5)  # the poll of the runner that left would claim it now (before the live runner asks)
        rollout = served.client.dequeue_rollout("live", timeout=5)
        assert rollout is not None and rollout.rollout_id == queued.rollout_id, "claimed for the runner that left"
        attempts = served.backing.query_attempts(queued.rollout_id)
        assert [(a.runner_id, a.status) for a in attempts if a.status == "running"] == [("live", "running")]
        if backend == "memory":
            assert [(a.runner_id, a.status) for a in attempts] == [("ghost", "unresponsive"), ("live", "running")]
        else:  # SQLite and PostgreSQL give up the wait: no attempt at all for the runner that left
            assert [a.runner_id for a in attempts] == ["live"]
    finally:
        served.close()


# -- retries ------------------------------------------------------------------------------------------------


class LossyProxy(LocalListener):
    """A real TCP proxy in front of the server that loses the answers to the next ``drop`` requests
    (the request reaches the server and is applied; the client sees the connection close), then sends
    later requests to ``then_upstream`` if set (a restarted server, with no memory of the lost request).
    The next ``time_out`` requests get the 408 a server sends when a body stalls, and never reach it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.then_upstream: Optional[str] = None
        self.drop = 0
        self.time_out = 0
        self.seen: List[bytes] = []
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            while True:
                request = _read_http_message(reader)
                if request is None:
                    return
                self.seen.append(request.split(b"\r\n", 1)[0])
                if self.time_out:
                    self.time_out -= 1
                    conn.sendall(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                host, port = self.upstream.rsplit("/", 1)[-1].split(":")
                with socket.create_connection((host, int(port))) as up:
                    up.sendall(request)
                    response = _read_http_message(up.makefile("rb"))
                if self.drop:
                    self.drop -= 1
                    if self.then_upstream:
                        self.upstream = self.then_upstream
                    return  # the answer is lost
                conn.sendall(response or b"")


def _read_http_message(reader: Any) -> Optional[bytes]:
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = reader.readline()
        if not line:
            return None
        head += line
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + reader.read(length)


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """Two servers over one SQLite file (the second plays the first after a restart) behind a lossy proxy."""
    first, second = Served(tmp_path / "store.db"), Served(tmp_path / "store.db")
    proxy = LossyProxy(first.url)
    client = RemoteLightningStore(proxy.url, token=TOKEN, retries=3, backoff=0.01)

    def lose_next_answer(restart: bool) -> None:
        proxy.drop = 1
        proxy.then_upstream = second.url if restart else None

    yield lambda: (client, proxy, lose_next_answer, first.backing)
    client.close()
    proxy.close()
    first.close()
    second.close()


def test_a_request_the_server_timed_out_is_sent_again(restarted: Callable[[], Any]) -> None:
    """A 408 (the server's read timeout: the body stalled on the way) is an outage of the network, retried."""
    client, proxy, _, backing = restarted()
    proxy.time_out = 2
    assert [r.input for r in client.enqueue_many([EnqueueRequest(input="once")])] == ["once"]
    assert proxy.seen.count(b"POST /v1/rollouts HTTP/1.1") == 3 and sum(backing.stats().rollouts.values()) == 1


@pytest.mark.parametrize("restart", [False, True], ids=["same-server", "after-restart"])
def test_retries_after_a_lost_answer_apply_once(restarted: Callable[[], Any], restart: bool) -> None:
    """Same server: its Idempotency-Key cache answers the retry. After a restart (no cache) the client's
    own checks do: its rollout and resources ids are found stored, its attempt found ended as asked."""
    client, proxy, lose_next_answer, backing = restarted()
    lose_next_answer(restart)
    rollouts = client.enqueue_many([EnqueueRequest(input=i) for i in range(3)])
    assert [r.input for r in rollouts] == [0, 1, 2]
    assert sum(backing.stats().rollouts.values()) == 3, "a retried enqueue must not enqueue twice"
    assert proxy.seen.count(b"POST /v1/rollouts HTTP/1.1") == 2, "the request was sent twice"

    if not restart:  # (a claim lost in a restart is reaped after its heartbeat timeout: see the docs)
        lose_next_answer(False)
    rollout = client.dequeue_rollout("runner-1")
    assert rollout is not None and rollout.attempt is not None
    assert backing.stats().attempts == 1, "a retried dequeue gets the first claim, not a second one"

    lose_next_answer(restart)
    done = client.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
    assert done.status == "succeeded" and done.final_reward == 1.0
    with pytest.raises(StaleAttemptError):  # a genuine second completion is still refused
        client.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "failed")

    lose_next_answer(restart)
    update = client.add_resources({"llm": LLM(endpoint="http://x/v1", model="m")})
    assert backing.stats().resources_versions == 1 and backing.get_resources() == update


def test_a_server_down_for_longer_than_the_heartbeat_timeout_does_not_end_the_running_attempts(tmp_path: Path) -> None:
    """Runners cannot send heartbeats while the server is down: a restarted server's reaper ended every
    running attempt at once as unresponsive, though the runners were alive and riding the outage out (a
    Trainer's default heartbeat timeout is 120 s, its outage timeout 600 s). The server renews them as it
    starts; a runner that stays silent is ended one heartbeat timeout later."""
    first = Served(tmp_path / "store.db")
    config = RolloutConfig(heartbeat_timeout_seconds=1.0)
    first.client.enqueue_many([EnqueueRequest(input=i, config=config) for i in range(2)])
    alive, silent = first.client.dequeue_many("runner-1", 2)
    first.close()
    time.sleep(1.3)  # longer than the heartbeat timeout
    second = Served(tmp_path / "store.db", limits=ServerLimits(reap_interval=0.05))
    try:
        time.sleep(0.3)  # the reaper's timer has run
        assert second.client.get_rollout(alive.rollout_id).status == "running"
        assert alive.attempt is not None
        second.client.heartbeat(alive.rollout_id, alive.attempt.attempt_id)
        done = second.client.complete_attempt(alive.rollout_id, alive.attempt.attempt_id, "succeeded", reward=1.0)
        assert done.status == "succeeded"
        time.sleep(1.0)
        assert [a.status for a in second.client.query_attempts(silent.rollout_id)] == ["unresponsive"]
    finally:
        second.close()


def test_retried_calls_apply_once_when_postgresql_calls_run_on_the_event_loop(
    postgres_dsn: str, make_span: Any
) -> None:
    """The server makes PostgreSQL's claim, span insert and completion as coroutines (AsyncRolloutCalls):
    a retry after a lost answer still gets the first answer, from the Idempotency-Key cache."""
    served = Served(PostgresLightningStore(postgres_dsn))
    proxy = LossyProxy(served.url)
    client = RemoteLightningStore(proxy.url, token=TOKEN, retries=3, backoff=0.01)
    try:
        client.enqueue_many([EnqueueRequest(input=i) for i in range(2)])
        proxy.drop = 1
        rollout = client.dequeue_rollout("runner-1", timeout=5)
        assert rollout is not None and rollout.attempt is not None
        assert served.backing.stats().attempts == 1, "a retried dequeue gets the first claim, not a second one"
        proxy.drop = 1
        assert client.add_spans([make_span(rollout, 0), make_span(rollout, 1)]) == 2  # a second insert says 0
        proxy.drop = 1
        done = client.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0)
        assert done.status == "succeeded" and done.final_reward == 1.0
        assert [line.split(b" ")[1] for line in proxy.seen].count(b"/v1/rollouts/dequeue") == 2
        assert len(served.backing.query_spans(rollout.rollout_id)) == 2
    finally:
        client.close()
        proxy.close()
        served.close()


def test_an_unreachable_server_raises_store_unavailable_after_the_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    client = RemoteLightningStore(f"http://127.0.0.1:{port}", token=TOKEN, retries=2, backoff=0.01)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}.*3 tries.*agl store serve") as info:
        client.stats()
    assert isinstance(info.value, ConnectionError) and time.monotonic() - started < 5


# -- processes ----------------------------------------------------------------------------------------------


def _use_in_child(store: RemoteLightningStore, conn: Any) -> None:
    rollout = store.dequeue_rollout("child", timeout=10)
    conn.send(rollout.rollout_id if rollout else None)


def test_the_client_works_across_fork_and_pickle(served: Served) -> None:
    queued = served.client.enqueue_rollout("for the child")  # the parent has a pooled connection open
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_use_in_child, args=(served.client, child_end))
    child.start()
    assert parent_end.recv() == queued.rollout_id
    child.join(10)
    assert child.exitcode == 0
    assert served.client.get_rollout(queued.rollout_id).status == "running", "the parent's client still works"
    copy = pickle.loads(pickle.dumps(served.client))
    assert isinstance(copy, RemoteLightningStore) and copy.stats() == served.client.stats()
    assert RemoteLightningStore.multiprocess_safe


# -- command line -------------------------------------------------------------------------------------------


def test_serve_refuses_to_start_without_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agl.cli import main

    monkeypatch.delenv("AGL_STORE_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="needs a token: pass --token"):
        main(["store", "serve", "--store", str(tmp_path / "s.db")])
    with pytest.raises(SystemExit, match="not another server"):
        main(["store", "serve", "--store", "http://elsewhere:4747", "--token", "t"])


def test_runner_fails_fast_on_a_wrong_token(served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agl.cli import main

    agent = tmp_path / "agent.py"
    agent.write_text("def agent(task):\n    return 1.0\n")
    code = main(["runner", "--store", served.url, "--agent", f"{agent}:agent", "--token", "wrong"])
    assert code == 2 and "token not accepted" in capsys.readouterr().err


def _bad_store_cases(tmp_path: Path, url: str) -> List[Any]:
    (tmp_path / "text.db").write_text("hello")
    (tmp_path / "folder.db").mkdir()
    host_port = url.split("//", 1)[1]
    return [
        (host_port, f"has no scheme: for a store server write {url}"),
        ("http://127.0.0.1:notaport", "needs a host and a port from 1 to 65535: pass http://HOST:PORT"),
        (f"ftp://{host_port}", "agl has no ftp:// stores; use 'memory'"),
        (str(tmp_path), f"is a folder, not a store file: pass a file in it, e.g. {tmp_path}/store.db"),
        (str(tmp_path / "folder.db"), "is a folder, not a store file"),
        (str(tmp_path / "notes.txt"), "a SQLite store's file name ends in .db): use 'memory'"),
        (str(tmp_path / "text.db"), "is not a SQLite store (file is not a database): pass a store file agl made"),
        (f"https://{host_port}", f"speaks plain HTTP, so pass {url}"),
        (f"{url}/v1/stats", "pass the store as http://HOST:PORT, without a path"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_bad_store_address_gets_one_line_saying_what_to_pass(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, case: int
) -> None:
    """Raw tracebacks (or 12 s of TLS retries) instead of one line saying what was wrong and what to pass."""
    from agl.cli import main

    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)
    store, expected = _bad_store_cases(tmp_path, served.url)[case]
    started = time.monotonic()
    assert main(["store", "stats", "--store", store]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agl: ") and err.count("\n") == 1 and expected in err, err
    assert time.monotonic() - started < 5, "refused at once, not retried"


def test_a_store_server_url_may_end_in_v1(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agl.cli import main

    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)
    assert main(["store", "stats", "--store", served.url + "/v1/"]) == 0
    assert '"attempts": 0' in capsys.readouterr().out
    assert RemoteLightningStore(served.url + "/v1").url == served.url


def test_agl_runner_help_names_every_store_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    from agl.cli import main

    with pytest.raises(SystemExit):
        main(["runner", "--help"])
    assert "postgresql://" in capsys.readouterr().out


def test_a_runner_on_a_sqlite_file_that_does_not_exist_makes_it_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Runner and trainer may start in either order, so the file is made; but a mistyped path would leave
    the runners waiting for nothing without a word."""
    from agl.cli.remote import open_runner_store

    path = tmp_path / "typo.db"
    with caplog.at_level("WARNING", logger="agl.cli.remote"):
        store = open_runner_store(str(path), None)
        store.close()
        open_runner_store(str(path), None).close()  # it exists now: nothing to say
    assert path.exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"no store at {path} yet: made a new, empty one; the runners wait for a trainer to enqueue rollouts into "
        "this file (check the path if the trainer already runs)"
    ]


class _ClaimsFail:
    """A store whose claims fail (its database went away just then); everything else works."""

    def dequeue_many(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("the database went away")

    async def aclaim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("the database went away")


class _SqliteClaimsFail(_ClaimsFail, SqliteLightningStore):
    pass


class _PostgresClaimsFail(_ClaimsFail, PostgresLightningStore):
    pass


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_failed_claim_after_a_recorded_completion_answers_the_completion(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """complete-and-dequeue: the completion stands and is answered; the failed claim gives no rollouts."""
    if backend == "sqlite":
        plain: LightningStore = SqliteLightningStore(tmp_path / "store.db")
        backing: LightningStore = _SqliteClaimsFail(tmp_path / "store.db")
    else:
        dsn = request.getfixturevalue("postgres_dsn")
        plain, backing = PostgresLightningStore(dsn), _PostgresClaimsFail(dsn)
    plain.enqueue_many([EnqueueRequest(input=i) for i in range(2)])
    rollout = plain.dequeue_rollout("r")
    assert rollout is not None and rollout.attempt is not None
    served = Served(backing)
    try:
        completed, claimed = served.client.complete_and_dequeue(
            rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", reward=1.0, runner_id="r"
        )
        assert completed.status == "succeeded" and claimed == []
        assert [r.status for r in plain.query_rollouts()] == ["succeeded", "queued"]
    finally:
        served.close()
        plain.close()


def test_an_address_where_another_http_service_answers_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy server's port given as the store's (or any other web service): the CLI said only 'the store
    server answered HTTP 404', or FastAPI's bare 'Not Found'."""
    from agl.cli import main

    class NotAStore(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            body = b'{"detail":"Not Found"}'  # what any FastAPI app answers on a route it lacks
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotAStore)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    monkeypatch.setenv("AGL_STORE_TOKEN", TOKEN)
    try:
        assert main(["store", "stats", "--store", f"http://127.0.0.1:{other.server_address[1]}"]) == 2
    finally:
        other.shutdown()
    err = capsys.readouterr().err
    assert err.startswith("agl: ") and err.count("\n") == 1, err
    assert "answered HTTP 404 (Not Found) without an agl store error" in err and "agl store serve" in err, err
