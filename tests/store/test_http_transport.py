"""The store client's HTTP transport (agl.store.http.transport) against a real HTTP/1.1 server on 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from agl.store.http.transport import ConnectionPool, TransportError


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
        payload = json.dumps(
            {"path": self.path, "body": body.decode(), "auth": self.headers.get("Authorization")}
        ).encode()
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
    return ConnectionPool(
        url, {"Authorization": "Bearer t"}, max_connections=kw.pop("max_connections", 4), connect_timeout=2.0
    )  # type: ignore[arg-type]


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


class _Scripted:
    """A raw TCP server on 127.0.0.1 that answers each request with the next scripted bytes, then closes
    the connection if the script says so: answer framings http.server does not produce."""

    def __init__(self, answers: List[Tuple[bytes, bool]]) -> None:
        self.answers = list(answers)
        self.requests: List[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while self.answers:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    if b"\r\n\r\n" not in data:
                        break
                    head, _, data = data.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    while len(data) < length:
                        data += conn.recv(65536)
                    self.requests.append(head + b"\r\n\r\n" + data[:length])
                    data = data[length:]
                    answer, close = self.answers.pop(0)
                    conn.sendall(answer)
                    if close:
                        break

    def pool(self) -> ConnectionPool:
        return ConnectionPool(
            f"http://127.0.0.1:{self.port}", {"Authorization": "Bearer t"}, max_connections=1, connect_timeout=2.0
        )


def test_chunked_answers_with_extensions_and_trailers_are_read_whole() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    server = _Scripted([(chunked, False), (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", False)])
    pool = server.pool()
    assert pool.request("POST", "/a", body=b"{}", timeout=5).content == b"hello, world"
    assert pool.request("GET", "/b", timeout=5).content == b"ok"
    assert server.connections == 1, "a chunked answer keeps the connection usable"
    assert server.requests[0].startswith(b"POST /a HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 2\r\n\r\n{}" in server.requests[0]
    assert b"\r\nAuthorization: Bearer t\r\n" in server.requests[1]
    pool.close()


def test_informational_answers_are_skipped_and_unframed_answers_end_with_the_connection() -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    unframed = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"n": 1}' * 3000
    server = _Scripted(
        [
            (early + unframed, True),
            (b"HTTP/1.0 201 Created\r\nContent-Length: 0\r\n\r\n", False),
            (b"HTTP/1.1 204 No Content\r\n\r\n", False),
        ]
    )
    pool = server.pool()
    answer = pool.request("GET", "/a", timeout=5)
    assert answer.status == 200 and answer.content == b'{"n": 1}' * 3000
    assert pool.request("GET", "/b", timeout=5).status == 201  # a new connection: the first ended its answer
    assert pool.request("GET", "/c", timeout=5).status == 204  # and another: HTTP/1.0 without keep-alive closes
    assert server.connections == 3
    pool.close()


@pytest.mark.parametrize(
    "answer, message",
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "Content-Length 'many' is not a number"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000, "headers are over"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed the connection 5 bytes before"),
    ],
)
def test_answers_that_cannot_be_read_raise_transport_errors(answer: bytes, message: str) -> None:
    server = _Scripted([(answer, True)])
    pool = server.pool()
    with pytest.raises(TransportError, match=message):
        pool.request("GET", "/", timeout=5)
    pool.close()


def test_line_breaks_in_paths_and_headers_are_refused_before_sending() -> None:
    server = _Scripted([(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True)])
    pool = server.pool()
    with pytest.raises(ValueError, match="may not contain spaces or line breaks"):
        pool.request("GET", "/rollouts/x HTTP/1.1\r\nX-Evil: 1", timeout=5)
    with pytest.raises(ValueError, match="line break"):
        pool.request("GET", "/", headers={"Idempotency-Key": "k\r\nX-Evil: 1"}, timeout=5)
    with pytest.raises(ValueError, match="line break"):
        ConnectionPool(
            f"http://127.0.0.1:{server.port}",
            {"Authorization": "Bearer t\r\nX: y"},
            max_connections=1,
            connect_timeout=1,
        )
    assert server.requests == []
    pool.close()


def test_https_verifies_the_server_against_ssl_cert_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # tests/data/tls: a self-signed certificate for 127.0.0.1 and its key (test-only, valid until 2126), made with
    # openssl req -x509 -newkey rsa:2048 -nodes -days 36500 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1
    tls = Path(__file__).parent.parent / "data" / "tls"
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.seen, httpd.daemon_threads = [], True  # type: ignore[attr-defined]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls / "cert.pem", tls / "key.pem")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{httpd.server_address[1]}"
    try:
        untrusted = ConnectionPool(url, {}, max_connections=1, connect_timeout=2.0)
        with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusted.request("GET", "/", timeout=5)
        monkeypatch.setenv("SSL_CERT_FILE", str(tls / "cert.pem"))
        trusted = ConnectionPool(url, {"Authorization": "Bearer t"}, max_connections=1, connect_timeout=2.0)
        assert trusted.request("POST", "/x", body=b"{}", timeout=5).json()["auth"] == "Bearer t"
        assert trusted.request("GET", "/y", timeout=5).status == 201
        assert len({port for port, _, _ in httpd.seen}) == 1  # type: ignore[attr-defined]  # kept alive over TLS
        trusted.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_trainer_sets_the_outage_timeout_of_a_store_server_client_unless_it_has_its_own() -> None:
    import agl
    from agl.store.http.client import RemoteLightningStore

    default = RemoteLightningStore("http://127.0.0.1:9")  # nothing is sent until a call
    own = RemoteLightningStore("http://127.0.0.1:9", outage_timeout=5.0)
    agl.Trainer(store=default, progress=False, store_outage_timeout=42)
    agl.Trainer(store=own, progress=False)
    assert (default.outage_timeout, own.outage_timeout) == (42, 5.0)
    assert RemoteLightningStore("http://127.0.0.1:9").outage_timeout is None, "interactive use fails fast"


def test_an_upload_slower_than_the_timeout_goes_through_while_it_makes_progress() -> None:
    """The timeout bounded the whole ``sendall``: a span batch that took longer to upload than ``timeout`` on a
    slow link failed on every try (and was sent again until the outage timeout). It bounds a stall now."""
    body = b"x" * (12 * 1024 * 1024)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    received: List[int] = []

    def slow_reader() -> None:  # reads 64 KiB at a time with pauses: about 1.5 s for the whole body
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            got = len(data.split(b"\r\n\r\n", 1)[1])
            while got < len(body):
                got += len(conn.recv(65536))
                time.sleep(0.008)
            received.append(got)
            conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")

    thread = threading.Thread(target=slow_reader, daemon=True)
    thread.start()
    pool = ConnectionPool(f"http://127.0.0.1:{listener.getsockname()[1]}", {}, max_connections=1, connect_timeout=2.0)
    started = time.monotonic()
    answer = pool.request("POST", "/v1/spans", body=body, timeout=0.5)
    assert answer.status == 201 and received == [len(body)]
    assert time.monotonic() - started > 0.5  # slower than the timeout, as the test means it to be
    pool.close()
    listener.close()
