"""The store client's HTTP transport (agl.store._http) against a real HTTP/1.1 server on 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Iterator, List, Tuple

import pytest

from agl.store._http import ConnectionPool, TransportError


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.client_address[1], self.command, self.path))  # type: ignore[attr-defined]
        if self.path.startswith("/slow"):
            with self.server.lock:  # type: ignore[attr-defined]
                self.server.busy += 1  # type: ignore[attr-defined]
                self.server.peak = max(self.server.peak, self.server.busy)  # type: ignore[attr-defined]
            time.sleep(0.5)
            with self.server.lock:  # type: ignore[attr-defined]
                self.server.busy -= 1  # type: ignore[attr-defined]
        payload = json.dumps({"path": self.path, "body": body.decode(), "auth": self.headers.get("Authorization")}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if self.path.startswith("/close"):
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        if self.path.startswith("/vanish"):
            self.close_connection = True  # without saying so in the headers

    do_GET = do_POST = _answer


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.seen: List[Tuple[int, str, str]] = []  # type: ignore[attr-defined]
    httpd.lock, httpd.busy, httpd.peak = threading.Lock(), 0, 0  # type: ignore[attr-defined]
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _pool(httpd: http.server.ThreadingHTTPServer, prefix: str = "", **kw: object) -> ConnectionPool:
    url = f"http://127.0.0.1:{httpd.server_address[1]}{prefix}"
    return ConnectionPool(url, {"Authorization": "Bearer t"}, max_connections=kw.pop("max_connections", 4), connect_timeout=2.0)  # type: ignore[arg-type]


def test_requests_reuse_one_kept_alive_connection(server: http.server.ThreadingHTTPServer) -> None:
    pool = _pool(server, "/base")
    first = pool.request("POST", "/v1/x", body=b'{"a": 1}', params={"q": "a b"}, headers={"X-Extra": "1"}, timeout=5)
    second = pool.request("GET", "/v1/y", timeout=5)
    assert first.status == 201
    assert first.json() == {"path": "/base/v1/x?q=a+b", "body": '{"a": 1}', "auth": "Bearer t"}
    assert second.json()["path"] == "/base/v1/y"
    ports = {port for port, _, _ in server.seen}  # type: ignore[attr-defined]
    assert len(ports) == 1, "the second request should have reused the first one's connection"
    pool.close()


def test_a_connection_the_server_closes_is_not_reused(server: http.server.ThreadingHTTPServer) -> None:
    pool = _pool(server)
    pool.request("GET", "/close", timeout=5)
    pool.request("GET", "/after", timeout=5)
    ports = [port for port, _, _ in server.seen]  # type: ignore[attr-defined]
    assert len(set(ports)) == 2
    pool.close()


def test_a_stale_kept_alive_connection_is_replaced_without_an_error(server: http.server.ThreadingHTTPServer) -> None:
    # /vanish answers as if keeping the connection alive, then closes it (as a restarting server or an idle
    # timeout does): the next request fails on that pooled connection and is sent again on a new one
    pool = _pool(server)
    pool.request("GET", "/vanish", timeout=5)
    time.sleep(0.1)
    assert pool.request("GET", "/next", timeout=5).json()["path"] == "/next"
    ports = [port for port, _, path in server.seen]  # type: ignore[attr-defined]
    assert len(ports) == 2 and ports[0] != ports[1]
    pool.close()


def test_no_server_and_a_timeout_raise_transport_errors(server: http.server.ThreadingHTTPServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    nobody = ConnectionPool(f"http://127.0.0.1:{dead_port}", {}, max_connections=1, connect_timeout=1.0)
    with pytest.raises(TransportError, match="ConnectionRefused"):
        nobody.request("GET", "/", timeout=1)
    pool = _pool(server)
    with pytest.raises(TransportError, match="timed out"):
        pool.request("GET", "/slow", timeout=0.2)
    assert pool.request("GET", "/fine", timeout=5).status == 201  # the timed-out connection was dropped
    pool.close()


def test_at_most_max_connections_are_open_at_once(server: http.server.ThreadingHTTPServer) -> None:
    pool = _pool(server, max_connections=2)
    threads = [threading.Thread(target=pool.request, args=("GET", "/slow"), kwargs={"timeout": 5}) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(server.seen) == 4  # type: ignore[attr-defined]
    assert server.peak == 2  # type: ignore[attr-defined]  # never more than two at once, and both were used
    assert len({port for port, _, _ in server.seen}) == 2  # type: ignore[attr-defined]
    pool.close()
    assert pool._idle == []


def test_urls_that_are_not_http_are_refused() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        ConnectionPool("ftp://example.org", {}, max_connections=1, connect_timeout=1.0)
