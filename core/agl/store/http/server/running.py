"""Running the store server: on a background thread (:class:`ServerThread`, for tests, benchmarks and
notebooks) or in the foreground until a signal (:func:`serve`, for ``agl store serve``)."""

from __future__ import annotations

import signal
import threading
from typing import Optional

from fastapi import FastAPI

from agl._util.http_thread import ThreadedServer
from agl.store.base import LightningStore
from agl.store.http.server.app import create_app
from agl.store.http.server.auth import TokenSet
from agl.store.http.server.limits import ServerLimits


class ServerThread(ThreadedServer):
    """The store server for ``app`` on a background thread (tests, benchmarks, notebooks).

    ``port=0`` picks a free port; ``url`` tells which once started. ``stop()`` shuts it down gracefully.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(app, name="agl-store-server", host=host, port=port, lifespan="on")

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
) -> None:
    """Serve ``store`` until SIGINT/SIGTERM (uvicorn stops gracefully on both), then close it and return.

    uvicorn raises the signal again once it has shut down, so that the process dies of it: ``store.close()``
    then never ran, and a clean stop exited 143, which process managers report as a failure. A handler of
    our own is what uvicorn restores before raising it: the signal then does nothing more, and this returns."""
    import uvicorn

    app = create_app(store, tokens=tokens, allow_anonymous=allow_anonymous, limits=limits)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # no access log: a line per request costs more than some requests (errors are still logged)
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
