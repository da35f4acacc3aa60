"""An ASGI app served by uvicorn from a daemon thread of the calling process.

The fake model server, the policy server, the LLM proxy and the store server all run this way in tests,
notebooks and trainers. The socket is bound and listening before uvicorn's loop starts, so the port is
known at once (port 0 picks a free one) and clients that connect early just queue.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from typing import Any, Dict, Optional

import uvicorn

STARTUP_TIMEOUT_S = 30.0  # generous: a loaded 2-core machine can be slow to start uvicorn
HEADER_TIMEOUT_S = 10.0  # a request's headers arrive whole within this, from its first byte (or the connection's start)
BODY_TIMEOUT_S = 30.0  # a request's body may stall this long (no byte received) before its connection is closed
MAX_CONNECTIONS = 4096  # open connections and running requests; requests above get 503

_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def advertised_url(host: str, port: int, path: str = "/v1") -> str:
    """Where other machines reach a server bound to ``host:port``: a wildcard bind (``0.0.0.0``, ``::``) is
    advertised at this machine's outbound IP address, since a loopback or wildcard address would point every
    remote client at itself; a specific host as it is."""
    name = outbound_ip() if host in WILDCARD_HOSTS else host
    name = f"[{name}]" if ":" in name else name
    return f"http://{name}:{port}{path}"


def outbound_ip() -> str:
    """The address of the interface this machine reaches other hosts through (a UDP socket's route; no packet
    is sent), else its host name. An address, not a name: ``getfqdn()`` often says ``localhost`` in
    containers and VMs, and names need a DNS the runners share."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # any non-local address: only the routing table is consulted
        return str(probe.getsockname()[0])
    except OSError:  # no route at all (an isolated machine)
        return socket.gethostname()
    finally:
        probe.close()


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name (or a wildcard, ""): other machines may reach it
        return False


class _ReadTimeouts:
    """Mixin for uvicorn's HTTP protocols (httptools or h11): a request's headers must arrive whole within
    ``header_timeout`` of its first byte (or of the connection's start), and its body may not stall longer than
    ``body_timeout``; else the connection is closed (with a 408 if part of a request came).

    Why: uvicorn has no read timeout (only one for idle keep-alive connections), so a client that sends half
    a request holds a connection and its descriptor for ever. Both protocols create a request's ``cycle`` as its
    headers complete and clear its ``more_body`` as its body does, which is all this watches; a stall while
    uvicorn itself stopped reading (flow control: the app has not taken the body yet) is not the client's.
    """

    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S
    cycle: Any
    flow: Any
    loop: asyncio.AbstractEventLoop
    transport: Optional[asyncio.Transport]

    _deadline: Optional[asyncio.TimerHandle] = None
    _partial = False  # bytes of a request whose headers are not complete have come

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # the protocol class this is mixed into
        self._arm(self.header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]  # as above
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # the next request's headers are still coming
            self._partial = True
            if self._deadline is None:
                self._arm(self.header_timeout)
        elif cycle.more_body:  # its body is coming: a stall is timed from the last byte
            self._partial = False
            self._arm(self.body_timeout)
        else:  # the request is in: the app answers in its own time
            self._partial = False
            self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]  # as above

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        transport, cycle = self.transport, self.cycle
        if transport is None or transport.is_closing():
            return
        receiving = cycle is not None and not cycle.response_complete
        if receiving and not cycle.more_body:
            return  # a request started since (h11 starts a pipelined one after an answer): it is in
        if receiving and self.flow.read_paused:
            self._arm(self.body_timeout)  # uvicorn stopped reading, not the client
            return
        if receiving:
            message = f"request body stalled: nothing received for {self.body_timeout:g} s"
        elif self._partial:
            message = f"request headers not received within {self.header_timeout:g} s"
        else:  # a connection that never sent anything: closed without a word
            transport.close()
            return
        body = message.encode()
        transport.write(_TIMED_OUT % (len(body), body))
        transport.close()


def read_timeout_protocol(header_timeout: float, body_timeout: float) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with read timeouts (:class:`_ReadTimeouts`)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    timeouts = {"header_timeout": header_timeout, "body_timeout": body_timeout}
    return type("ReadTimeoutProtocol", (_ReadTimeouts, AutoHTTPProtocol), timeouts)


def hardened_config(
    header_timeout: float = HEADER_TIMEOUT_S,
    body_timeout: float = BODY_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> Dict[str, Any]:
    """uvicorn settings for a server other machines may reach: read timeouts, and a cap on connections and
    requests (above it uvicorn answers 503, which clients retry), so half-sent requests cannot pile up."""
    return {"http": read_timeout_protocol(header_timeout, body_timeout), "limit_concurrency": max_connections}


class ThreadedServer:
    """``start()`` returns once connections are accepted; ``stop()`` asks uvicorn to exit and joins. It serves
    with read timeouts and a connection cap (:func:`hardened_config`), so it may listen beyond this machine."""

    def __init__(
        self,
        app: Any,
        *,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        lifespan: str = "off",
        graceful_shutdown_s: float = 2.0,
        backlog: int = 256,
        header_timeout: float = HEADER_TIMEOUT_S,
        body_timeout: float = BODY_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.app = app
        self.name = name
        self.host = host
        self.requested_port = port
        self.lifespan = lifespan
        self.graceful_shutdown_s = graceful_shutdown_s
        self.backlog = backlog
        self.hardening = hardened_config(header_timeout, body_timeout, max_connections)
        self.port: Optional[int] = None
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> ThreadedServer:
        """Bind, serve, wait until uvicorn accepts connections (``port`` then says where)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} is already running; stop() it before starting it again")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this; without it small answers wait ~40 ms for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.requested_port))
        except OSError as exc:
            sock.close()
            raise OSError(
                f"{self.name} cannot listen on {self.host}:{self.requested_port}: {exc} "
                "(pick another port, or 0 for a free one)"
            ) from exc
        sock.listen(self.backlog)
        self.port = sock.getsockname()[1]
        # log_config=None: uvicorn must not reconfigure the host process's logging, only log through it.
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            log_config=None,
            loop="asyncio",  # in the host's process: never uvloop, which older uvicorn installs process-wide
            access_log=False,
            lifespan=self.lifespan,  # type: ignore[arg-type]  # one of uvicorn's literals, which uvicorn checks
            timeout_graceful_shutdown=self.graceful_shutdown_s,  # type: ignore[arg-type]  # uvicorn takes fractions of a second too
            **self.hardening,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=self.name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} did not start on {self.host}:{self.port} (see the 'uvicorn.error' log)"
                )
            time.sleep(0.01)
        return self

    def stop(self, *, wait: bool = True) -> None:
        """Stop serving (open streams get the graceful-shutdown time to finish); a no-op when stopped.

        ``wait=False`` returns at once; the thread ends by itself shortly after.
        """
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        if wait:
            self._thread.join(timeout=STARTUP_TIMEOUT_S + self.graceful_shutdown_s)
        self._server, self._thread, self.port = None, None, None

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
