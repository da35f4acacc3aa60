"""A small pooled HTTP/1.1 client on plain sockets: the transport of the store client.

Why its own: a store call is a small JSON request on a kept-alive connection, made for every dequeue, span
batch and completion of every runner, so its CPU is paid per rollout on every runner and, when runners
share a host with the server, taken from the server. Measured on the development VM against
``agl store serve``, client CPU per request: httpx 400-575 µs (URL merging, cookies, auth and redirect
flows), ``http.client`` 150-170 µs (most of it parsing the answer's headers with the ``email`` package),
this client 35-60 µs: one ``sendall`` of the whole request, the answer's head split by hand.

What it speaks: HTTP/1.1 requests with a ``Content-Length`` body; answers framed by ``Content-Length``,
``Transfer-Encoding: chunked`` or the end of the connection, informational (1xx) answers skipped,
keep-alive as HTTP/1.1 and 1.0 define it. What it leaves out on purpose: proxies (a store server is an
internal service reached directly), redirects, cookies and compression.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import struct
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlencode, urlsplit

from agl.errors import StoreAddressError

_READ_SIZE = 65536
#: what OpenSSL says when the server answers a TLS handshake with plain text (an HTTP 400)
_PLAIN_TEXT_ANSWER = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}
)
_MAX_HEAD = 65536  # bytes of status line and headers an answer may have


class TransportError(Exception):
    """The request got no complete answer (refused, reset, timed out, bad framing); safe to send again."""


@dataclass(frozen=True)
class Answer:
    """A complete HTTP answer."""

    status: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _transport_error(exc: BaseException) -> TransportError:
    return TransportError(f"{type(exc).__name__}: {exc}")


_TOKEN = re.compile(r"[\x21-\x7e]+")  # what a bearer token may hold: visible ASCII, no spaces


def bearer_token(token: Optional[str], source: str) -> Optional[str]:
    """``token`` without surrounding whitespace, checked; ``source`` names where it came from, for the error.

    Secret files end with a newline (a Kubernetes secret made with ``--from-file``, ``$(< file)`` in some
    shells), and no HTTP client can send a line break in a header: a client failed with a traceback, and a
    server that kept the newline refused every client. What is still not visible ASCII cannot travel in an
    ``Authorization`` header (or would arrive changed), so it is refused here, naming the characters (never
    the token)."""
    if token is None:
        return None
    token = token.strip()
    if token and not _TOKEN.fullmatch(token):
        bad = ", ".join(sorted({ascii(c) for c in token if not _TOKEN.fullmatch(c)}))
        raise ValueError(
            f"the token from {source} holds {bad}, which an HTTP Authorization header cannot carry: a token is "
            "visible ASCII without spaces (e.g. from `python -c 'import secrets; print(secrets.token_urlsafe())'`); "
            "check the secret or file it comes from"
        )
    return token


def _header_lines(headers: Dict[str, str]) -> str:
    for name, value in headers.items():
        if any(c in name for c in ":\r\n") or "\r" in value or "\n" in value:
            raise ValueError(f"HTTP header {name!r}: its name holds ':' or a line break, or its value a line break")
    return "\r\n".join(f"{name}: {value}" for name, value in headers.items())


def _host_port(host: str, port: int, default: int) -> str:
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return host if port == default else f"{host}:{port}"


class ConnectionPool:
    """Kept-alive connections to one server, shared by threads; at most ``max_connections`` in use at once."""

    def __init__(self, url: str, headers: Dict[str, str], *, max_connections: int, connect_timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"store server URL {url!r} must look like http://host:port")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._host_line = f"Host: {_host_port(self._host, self._port, 443 if self._https else 80)}"
        self._fixed_lines = _header_lines(headers)
        self._connect_timeout = connect_timeout
        self._ssl = ssl.create_default_context() if self._https else None
        self._idle: List[_Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Optional[bytes] = None,
        params: Optional[Dict[str, str]] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: float,
    ) -> Answer:
        """Send one request and read the whole answer; raises TransportError if none came back.

        A kept-alive connection the server closed meanwhile (it restarted, or dropped an idle socket) fails
        on first use; that one failure is repeated at once on a new connection rather than reported.
        """
        head = self._head(method, self._prefix + path + (f"?{urlencode(params)}" if params else ""), body, headers)
        with self._slots:
            try:
                conn, reused = self._take()
            except OSError as exc:
                raise _transport_error(exc) from exc
            while True:
                try:
                    answer, keep = conn.exchange(method, head, body, timeout)
                    break
                except (OSError, _BadAnswer) as exc:
                    conn.close()
                    if not reused or isinstance(exc, (TimeoutError, _BadAnswer)):
                        raise _transport_error(exc) from exc
                try:  # the one repeat: a pooled connection turned out to be closed
                    conn, reused = self._connect(), False
                except OSError as exc:
                    raise _transport_error(exc) from exc
            self._give_back(conn, keep)
            return answer

    def _head(self, method: str, target: str, body: Optional[bytes], extra: Optional[Dict[str, str]]) -> bytes:
        """Request line and headers, ending with the blank line. CR, LF or a space in the target, or CR/LF in
        a header, would let a value (an id, a token) inject a request or header: refused."""
        if any(c in target for c in " \r\n\t"):
            raise ValueError(f"a store request path may not contain spaces or line breaks: {target[:80]!r}")
        lines = [f"{method} {target} HTTP/1.1", self._host_line, self._fixed_lines]
        if extra:
            lines.append(_header_lines(extra))
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(line for line in lines if line) + "\r\n\r\n").encode("latin-1")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> Tuple[_Connection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _connect(self) -> _Connection:
        """A new connection, opened within ``connect_timeout``."""
        sock = socket.create_connection((self._host, self._port), timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._tls(sock)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

    def _tls(self, sock: socket.socket) -> socket.socket:
        """``sock`` wrapped in TLS. A server that speaks plain HTTP (``agl store serve`` does) raises
        StoreAddressError at once: retrying the handshake for the client's whole retry time cannot help."""
        assert self._ssl is not None
        try:
            return self._ssl.wrap_socket(sock, server_hostname=self._host)
        except ssl.SSLError as exc:
            if exc.reason not in _PLAIN_TEXT_ANSWER:
                raise
            where = _host_port(self._host, self._port, 0)
            raise StoreAddressError(
                f"https://{where} answered without TLS: `agl store serve` speaks plain HTTP, so pass "
                f"http://{where} (or put a TLS proxy in front of the server) ({exc})"
            ) from None

    def _give_back(self, conn: _Connection, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed:
                self._idle.append(conn)
                return
        conn.close()


_SEND_SIZE = 256 * 1024  # larger requests go out in sends of at most this, each within the timeout


def _send_queue(sock: socket.socket) -> Optional[int]:
    """Bytes written to ``sock`` that the peer has not taken yet (Linux's SIOCOUTQ); None where unknown."""
    try:
        import fcntl
        import termios

        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (ImportError, OSError, AttributeError):
        return None


class _BadAnswer(Exception):
    """The server's bytes are not an HTTP/1.x answer this client can read."""


class _Connection:
    """One kept-alive connection: its socket, and the bytes read past the end of the last answer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self._unsent: Optional[int] = None  # bytes of the request still in the socket's send queue, last seen

    def close(self) -> None:
        self.sock.close()

    def exchange(self, method: str, head: bytes, body: Optional[bytes], timeout: float) -> Tuple[Answer, bool]:
        """Send one request (``head`` ends with the blank line) and read its answer; (answer, keep-alive)."""
        self.sock.settimeout(timeout)  # each read and write within ``timeout``
        self._send(head + body if body else head)
        while True:
            version, status, fields = self._read_head()
            if not 100 <= status < 200:
                break  # 1xx answers (e.g. 103 Early Hints) precede the real one
        connection = fields.get("connection", "").lower()
        keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        if method == "HEAD" or status in (204, 304):
            return Answer(status, b""), keep
        if "chunked" in fields.get("transfer-encoding", "").lower():
            return Answer(status, self._read_chunked()), keep
        length = fields.get("content-length")
        if length is None:
            return Answer(status, self._read_to_end()), False
        if not length.strip().isdigit():
            raise _BadAnswer(f"Content-Length {length!r} is not a number")
        return Answer(status, self._read_exact(int(length))), keep

    def _send(self, data: bytes) -> None:
        """All of ``data``, each ``send`` within the socket's timeout. ``sendall`` applies the timeout to the
        whole request since Python 3.5, so a span batch that takes longer to upload than ``timeout`` (32 MB on a
        1 MB/s link) failed on every try however steadily it went, and was sent again until the outage
        timeout: the timeout now bounds a stalled upload, not a slow one."""
        self._unsent = None
        if len(data) <= _SEND_SIZE:
            self.sock.sendall(data)
            return
        view = memoryview(data)
        while view:
            view = view[self.sock.send(view[:_SEND_SIZE]) :]
        self._unsent = _send_queue(self.sock)

    def _fill(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(_READ_SIZE)
                break
            except TimeoutError:
                if not self._still_uploading():
                    raise
        if not chunk:
            raise ConnectionResetError("the server closed the connection before its answer was complete")
        self._buffer += chunk

    def _still_uploading(self) -> bool:
        """Whether the request's last bytes, queued in the kernel after the last ``send``, left the send queue
        since the last look: a slow link still taking them, not a server that does not answer."""
        before, self._unsent = self._unsent, _send_queue(self.sock)
        return before is not None and self._unsent is not None and self._unsent < before

    def _read_head(self) -> Tuple[str, int, Dict[str, str]]:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise _BadAnswer(f"the answer's headers are over {_MAX_HEAD} bytes")
            self._fill()
        lines = self._buffer[:end].decode("latin-1").split("\r\n")
        self._buffer = self._buffer[end + 4 :]
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise _BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        return version, int(code), fields

    def _read_exact(self, n: int) -> bytes:
        if len(self._buffer) >= n:
            data, self._buffer = self._buffer[:n], self._buffer[n:]
            return data
        data = bytearray(n)  # type: ignore[assignment]  # filled in place, returned as bytes-like
        view = memoryview(data)
        have = len(self._buffer)
        view[:have] = self._buffer
        self._buffer = b""
        while have < n:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionResetError(f"the server closed the connection {n - have} bytes before the answer's end")
            have += got
        return bytes(data)

    def _read_line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise _BadAnswer("a chunk header or trailer line is too long")
            self._fill()
        line, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
        return line

    def _read_chunked(self) -> bytes:
        parts: List[bytes] = []
        while True:
            size_text = self._read_line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadAnswer(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while self._read_line():  # trailer fields, up to the blank line
                    pass
                return b"".join(parts)
            parts.append(self._read_exact(size))
            if self._read_exact(2) != b"\r\n":
                raise _BadAnswer("a chunk does not end with CRLF")

    def _read_to_end(self) -> bytes:
        parts = [self._buffer]
        self._buffer = b""
        while chunk := self.sock.recv(_READ_SIZE):
            parts.append(chunk)
        return b"".join(parts)
