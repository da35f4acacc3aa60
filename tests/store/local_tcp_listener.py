"""A TCP listener on a free port of 127.0.0.1, the base of this folder's fault-injecting proxies."""

from __future__ import annotations

import socket
import threading


class LocalListener:
    """Accepts connections on a daemon thread and hands each to ``_handle`` (a subclass's), until ``close()``.
    Subclasses set their own attributes before calling ``__init__``: the accepting starts in it."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()
