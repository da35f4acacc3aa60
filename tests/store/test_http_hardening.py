"""The store server on an open network: read timeouts and a connection cap (half-sent requests cannot pile up),
a retry cache bounded by bytes whose keys are bound to their request bodies, and a loud warning when a server
without tokens listens beyond this machine.

Real servers on 127.0.0.1, raw TCP sockets for the half-sent requests, the real `agl store serve` for the warning.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from agl._util.http_thread import _ReadTimeouts
from agl.store import SqliteLightningStore
from agl.store.http.server import ServerLimits, ServerThread, TokenSet, create_app
from agl.store.http.server.context import ServerContext

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GUARD_S = 30.0  # a socket read that waits longer than this means the server kept the connection: the test fails


class Server:
    """A store server over a SQLite file, started with ``limits``, and a raw httpx client."""

    def __init__(self, path: Path, limits: ServerLimits, protocol: Optional[type] = None) -> None:
        self.backing = SqliteLightningStore(path)
        app = create_app(self.backing, tokens=TokenSet({"shared": TOKEN, "other": "other-token"}), limits=limits)
        self.context: ServerContext = app.state.store_server
        self.thread = ServerThread(app)
        if protocol is not None:
            self.thread.hardening["http"] = protocol
        self.thread.start()
        self.http = httpx.Client(base_url=self.thread.url, timeout=GUARD_S, headers=AUTH)

    def connect(self, data: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", int(self.thread.port or 0)), timeout=GUARD_S)
        if data:
            sock.sendall(data)
        return sock

    def close(self) -> None:
        self.http.close()
        self.thread.stop()
        self.backing.close()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return received


H11_WITH_TIMEOUTS = type("H11WithTimeouts", (_ReadTimeouts, H11Protocol), {"header_timeout": 0.5, "body_timeout": 0.5})


@pytest.mark.parametrize("protocol", [None, H11_WITH_TIMEOUTS], ids=["httptools", "h11"])
def test_half_sent_requests_are_closed_after_the_read_timeouts_and_long_polls_are_not(
    tmp_path: Path, protocol: Optional[type]
) -> None:
    """Issue 36: 1,200 half-sent unauthenticated requests were all held after 60 s, and an authenticated request
    whose body is shorter than its Content-Length was held for ever. Now each is closed after its read timeout,
    with a 408 saying which part did not come; a long poll (its body is in) runs past both timeouts."""
    server = Server(tmp_path / "store.db", ServerLimits(header_timeout=0.5, body_timeout=0.5), protocol)
    try:
        idle = [server.connect() for _ in range(20)]
        half_headers = [server.connect(b"POST /v1/rollouts HTTP/1.1\r\nHost: store\r\nContent-") for _ in range(20)]
        short_body = [
            server.connect(
                b"POST /v1/rollouts HTTP/1.1\r\nHost: store\r\nAuthorization: Bearer "
                + TOKEN.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                + b'{"requests": ['
            )
            for _ in range(20)
        ]
        assert [read_until_closed(sock) for sock in idle] == [b""] * 20  # no request at all: closed without a word
        for sock in half_headers:
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408 ") and answer.endswith(b"request headers not received within 0.5 s")
        for sock in short_body:
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"request body stalled: nothing received for 0.5 s" in answer
        assert not any(server.backing.stats().rollouts.values()), "nothing of a half-sent request reached the store"
        poll = server.http.post("/v1/rollouts/dequeue", json={"runner_id": "r", "limit": 1, "timeout": 1.5})
        assert poll.status_code == 200 and poll.json() == {"rollouts": []}
        assert server.http.post("/v1/rollouts", json={"requests": [{"input": 1}]}).status_code == 200
    finally:
        server.close()


def test_connections_over_the_cap_get_503_until_some_close(tmp_path: Path) -> None:
    server = Server(tmp_path / "store.db", ServerLimits(max_connections=4))
    try:
        held: List[socket.socket] = [server.connect() for _ in range(4)]
        assert server.http.get("/healthz").status_code == 503
        for sock in held:
            sock.close()
        for _ in range(200):  # the server sees the closes on its own loop: the first answers may still be 503
            if server.http.get("/healthz").status_code == 200:
                break
        assert server.http.get("/v1/stats").status_code == 200
    finally:
        server.close()


def enqueue(server: Server, key: str, body: dict, token: str = TOKEN) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    return server.http.post("/v1/rollouts", content=json.dumps(body), headers=headers)


def test_the_retry_cache_is_bounded_by_bytes_and_recent_answers_stay(tmp_path: Path) -> None:
    """Issue 36: every keyed POST kept its whole answer for 10 minutes, up to 100,000 entries: 300 enqueues of
    1 MB grew the server from 56 to 455 MB. Now the answers kept add up to at most the byte bound; the oldest
    go first, and a retry of a recent request still gets its first answer (not a second rollout)."""
    bound = 2 * 1024 * 1024
    server = Server(tmp_path / "store.db", ServerLimits(idempotency_bytes=bound))
    cache = server.context.cache
    big = base64.b64encode(os.urandom(192 * 1024)).decode()  # 256 KB that compression cannot shrink much
    try:
        for i in range(30):
            assert enqueue(server, f"big-{i}", {"requests": [{"input": big}]}).status_code == 200
            assert cache.kept_bytes <= bound
        assert cache.kept_bytes > bound - 2 * len(big), "the bound is used, not an entry count"
        small = {"requests": [{"input": "small"}]}
        first = enqueue(server, "small", small)
        for i in range(3):  # later large answers, within the bound with the small one
            assert enqueue(server, f"late-{i}", {"requests": [{"input": big}]}).status_code == 200
        retry = enqueue(server, "small", small)
        assert retry.status_code == 200 and retry.json() == first.json()
        assert server.backing.stats().rollouts["queued"] == 34, "the retry was not applied again"
        assert cache.kept_bytes <= bound
    finally:
        server.close()


def test_long_answers_are_kept_compressed_so_more_retries_find_theirs(tmp_path: Path) -> None:
    """An enqueue answer echoes each task's input: 30 answers of 256 KB of text fill 7.5 MB raw, far over a
    2 MiB bound, so the first ones were gone when retried. Kept compressed, all 30 stay, and each retry gets
    its first answer byte for byte (not a second rollout)."""
    bound = 2 * 1024 * 1024
    server = Server(tmp_path / "store.db", ServerLimits(idempotency_bytes=bound))
    text = " ".join(f"step {i}: add the numbers and say the total." for i in range(6000))[: 256 * 1024]
    try:
        firsts = [enqueue(server, f"text-{i}", {"requests": [{"input": f"{i} {text}"}]}) for i in range(30)]
        assert server.context.cache.kept_bytes < bound
        for i, first in enumerate(firsts):
            retry = enqueue(server, f"text-{i}", {"requests": [{"input": f"{i} {text}"}]})
            assert retry.status_code == 200 and retry.content == first.content
        assert server.backing.stats().rollouts["queued"] == 30, "no retry was applied again"
    finally:
        server.close()


def test_a_reused_key_with_another_body_gets_422_never_the_first_answer(tmp_path: Path) -> None:
    server = Server(tmp_path / "store.db", ServerLimits())
    try:
        first = enqueue(server, "k1", {"requests": [{"input": "a"}]})
        reused = enqueue(server, "k1", {"requests": [{"input": "b"}]})
        assert first.status_code == 200 and reused.status_code == 422
        assert reused.json()["error"] == "StoreRequestError"
        assert (
            "Idempotency-Key 'k1' was already used for a request to /v1/rollouts with another body"
            in (reused.json()["message"])
        )
        assert enqueue(server, "k1", {"requests": [{"input": "a"}]}).json() == first.json()  # the true retry
        other = enqueue(server, "k1", {"requests": [{"input": "a"}]}, token="other-token")
        assert other.status_code == 200 and other.json() != first.json(), "another token's key is its own"
        assert [r.input for r in server.backing.query_rollouts()] == ["a", "a"]
        dequeue = {"Idempotency-Key": "d1"}
        claimed = server.http.post("/v1/rollouts/dequeue", json={"runner_id": "r1", "limit": 1}, headers=dequeue)
        again = server.http.post("/v1/rollouts/dequeue", json={"runner_id": "r2", "limit": 1}, headers=dequeue)
        assert len(claimed.json()["rollouts"]) == 1 and again.status_code == 422
        assert server.backing.stats().rollouts["running"] == 1 and server.backing.stats().rollouts["queued"] == 1
    finally:
        server.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def serve_output(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """Runs `agl store serve --insecure-no-auth --host HOST` until uvicorn says it runs; returns its stderr."""
    started: List[subprocess.Popen[str]] = []

    def run(host: str) -> str:
        command = [sys.executable, "-m", "agl.cli", "store", "serve", "--store", str(tmp_path / "s.db")]
        command += ["--insecure-no-auth", "--host", host, "--port", str(free_port())]
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        started.append(proc)
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        return "".join(lines)

    yield run
    for proc in started:
        proc.terminate()
        proc.wait(timeout=GUARD_S)


def test_serving_without_tokens_beyond_this_machine_warns_loudly(serve_output: Callable[[str], str]) -> None:
    """Issue 36: `agl store serve --insecure-no-auth --host 0.0.0.0` started without a word."""
    exposed = serve_output("0.0.0.0")
    warning = [line for line in exposed.splitlines() if "WARNING" in line]
    assert warning == [
        "agl: WARNING: the store server on 0.0.0.0 accepts requests WITHOUT A TOKEN (--insecure-no-auth) from any "
        "machine that reaches it: anyone can read and change the store; pass --token or bind 127.0.0.1"
    ]
    assert "WITHOUT A TOKEN" not in serve_output("127.0.0.1")


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--body-timeout", "0"], "--body-timeout must be a finite number of seconds > 0, got 0.0"),
        (["--header-timeout", "nan"], "--header-timeout must be a finite number of seconds > 0, got nan"),
        (["--retry-cache-mb", "-1"], "--retry-cache-mb must be a positive number, got -1.0"),
        (["--max-connections", "0"], "--max-connections must be a positive number, got 0"),
    ],
)
def test_bad_limits_get_one_clear_line(tmp_path: Path, option: List[str], said: str) -> None:
    from agl.cli import main

    with pytest.raises(SystemExit, match=f"^agl: {re.escape(said)}$"):
        main(["store", "serve", "--store", str(tmp_path / "s.db"), "--token", TOKEN, *option])
