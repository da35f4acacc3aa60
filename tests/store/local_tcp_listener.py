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


class Forwarder(LocalListener):
    """A proxy to ``127.0.0.1:target``: each connection is piped both ways by ``_pipe`` (a subclass's), one
    daemon thread a direction; ``from_client`` tells which."""

    target: int

    def _handle(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        raise NotImplementedError
