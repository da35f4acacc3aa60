"""Running the store server: on a background thread (:class:`ServerThread`, for tests, benchmarks and
notebooks) or in the foreground until a signal (:func:`serve`, for ``agl store serve``)."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Mapping, Optional

from fastapi import FastAPI

from agl._util.http_thread import ThreadedServer, hardened_config, is_loopback
from agl.store.base import LightningStore
from agl.store.http.server.app import create_app
from agl.store.http.server.auth import TokenSet
from agl.store.http.server.limits import ServerLimits


class ServerThread(ThreadedServer):
    """The store server for ``app`` on a background thread (tests, benchmarks, notebooks).

    ``port=0`` picks a free port; ``url`` tells which once started. ``stop()`` shuts it down gracefully. The
    read timeouts and the connection cap are the app's :class:`ServerLimits`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        limits: ServerLimits = app.state.store_server.limits
        super().__init__(
            app,
            name="agl-store-server",
            host=host,
            port=port,
            lifespan="on",
            header_timeout=limits.header_timeout,
            body_timeout=limits.body_timeout,
            max_connections=limits.max_connections,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve(
    store: LightningStore,
    host: str = "127.0.0.1",
    port: int = 4747,
    *,
    tokens: Optional[TokenSet] = None,
    allow_anonymous: bool = False,
    limits: Optional[ServerLimits] = None,
    log_level: str = "info",
    mounts: Optional[Mapping[str, Any]] = None,
) -> None:
    """Serve ``store`` until SIGINT/SIGTERM (uvicorn stops gracefully on both), then close it and return.

    ``mounts``: more ASGI apps served beside the store's endpoints, by path (``agl store serve`` mounts its web
    pages at ``/ui``; they check the token themselves).

    uvicorn raises the signal again once it has shut down, so that the process dies of it: ``store.close()``
    then never ran, and a clean stop exited 143, which process managers report as a failure. A handler of
    our own is what uvicorn restores before raising it: the signal then does nothing more, and this returns."""
    import uvicorn

    limits = limits or ServerLimits()
    app = create_app(store, tokens=tokens, allow_anonymous=allow_anonymous, limits=limits)
    for path, mounted in (mounts or {}).items():
        app.mount(path, mounted)
    warn_if_open_to_all(host, tokens, allow_anonymous)
    hardening = hardened_config(limits.header_timeout, limits.body_timeout, limits.max_connections)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # no access log: a line per request costs more than some requests (errors are still logged)
        uvicorn.run(
            app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, **hardening
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()


def warn_if_open_to_all(host: str, tokens: Optional[TokenSet], allow_anonymous: bool) -> None:
    """One loud line on stderr when a server without tokens listens beyond this machine: anybody who can reach
    the port may then read and change everything in the store. On stderr rather than in the log, so that it shows
    whatever logging the process set up."""
    if tokens or not allow_anonymous or is_loopback(host):
        return
    line = (
        f"agl: WARNING: the store server on {host} accepts requests WITHOUT A TOKEN (--insecure-no-auth) from "
        "any machine that reaches it: anyone can read and change the store; pass --token or bind 127.0.0.1"
    )
    print(line, file=sys.stderr, flush=True)
