"""A small pooled HTTP/1.1 client on the standard library: the transport of the store client.

Why not httpx here: a store call is a small JSON request on a kept-alive connection, made for every
dequeue, span batch and completion of every runner, so its CPU is paid per rollout on every runner and,
when runners share a host with the server, taken from the server. httpx spends 400-575 µs of CPU per such
request (URL merging, cookies, auth and redirect flows), ``http.client`` 120-180 µs (measured on the
development VM against ``agl store serve``). What this client leaves out on purpose: proxies (a store
server is an internal service reached directly), redirects, cookies and compression.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlencode, urlsplit


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
        self._headers = dict(headers)
        self._connect_timeout = connect_timeout
        self._ssl = ssl.create_default_context() if self._https else None
        self._idle: List[http.client.HTTPConnection] = []
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
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        sent_headers = {**self._headers, **(headers or {})}
        with self._slots:
            conn, reused = self._take()
            try:
                answer, keep = self._exchange(conn, method, target, body, sent_headers, timeout)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if not reused or isinstance(exc, TimeoutError):
                    raise TransportError(f"{type(exc).__name__}: {exc}") from exc
                conn = self._connect()
                try:
                    answer, keep = self._exchange(conn, method, target, body, sent_headers, timeout)
                except (OSError, http.client.HTTPException) as again:
                    conn.close()
                    raise TransportError(f"{type(again).__name__}: {again}") from again
            self._give_back(conn, keep)
            return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> Tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _connect(self) -> http.client.HTTPConnection:
        """A new connection (opened lazily by the first request, within ``connect_timeout``)."""
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._connect_timeout, context=self._ssl)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._connect_timeout)

    def _give_back(self, conn: http.client.HTTPConnection, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    @staticmethod
    def _exchange(
        conn: http.client.HTTPConnection,
        method: str,
        target: str,
        body: Optional[bytes],
        headers: Dict[str, str],
        timeout: float,
    ) -> Tuple[Answer, bool]:
        if conn.sock is None:
            conn.connect()  # with the connect timeout
        conn.sock.settimeout(timeout)  # then each read and write within ``timeout``
        conn.request(method, target, body=body, headers=headers)
        response = conn.getresponse()
        content = response.read()
        return Answer(response.status, content), not response.will_close
