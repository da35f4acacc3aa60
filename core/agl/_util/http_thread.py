"""An ASGI app served by uvicorn from a daemon thread of the calling process.

The fake model server, the policy server, the LLM proxy and the store server all run this way in tests,
notebooks and trainers. The socket is bound and listening before uvicorn's loop starts, so the port is
known at once (port 0 picks a free one) and clients that connect early just queue.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

import uvicorn

STARTUP_TIMEOUT_S = 30.0  # generous: a loaded 2-core machine can be slow to start uvicorn


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


class ThreadedServer:
    """``start()`` returns once connections are accepted; ``stop()`` asks uvicorn to exit and joins."""

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
    ) -> None:
        self.app = app
        self.name = name
        self.host = host
        self.requested_port = port
        self.lifespan = lifespan
        self.graceful_shutdown_s = graceful_shutdown_s
        self.backlog = backlog
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
