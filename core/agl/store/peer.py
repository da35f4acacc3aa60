"""Agent Lightning v0.3's store classes on agl's stores, so that its code runs unchanged with ``import agl``.

- :class:`LightningStoreClient`: agl's client of a store server, with Agent Lightning's constructor.
- :class:`LightningStoreServer`: serves a store over HTTP from this process (what ``agl store serve`` runs), and is
  itself a store that hands every call to the store it serves.
- :func:`LightningStoreThreaded`: agl's stores are thread-safe already; it returns the store it is given.
- :class:`CollectionBasedLightningStore`, :class:`MongoLightningStore`: refused, naming agl's store to use.

Every method of these is awaitable from user coroutines, as on every agl store (:mod:`agl.store.async_calls`).
"""

from __future__ import annotations

import abc
import functools
import logging
from typing import Any, Callable, Dict, Optional, Sequence

from agl.errors import UnsupportedStoreError
from agl.store import async_calls
from agl.store.base import _API, LightningStore
from agl.store.http.client import RemoteLightningStore

logger = logging.getLogger("agl.store")

DEFAULT_PORT = 4747  # Agent Lightning's and `agl store serve`'s


@functools.cache
def say_once(message: str) -> None:
    """Log ``message`` the first time it comes up in this process: an Agent Lightning setting agl has no use for
    is named once, not at every use."""
    logger.info(message)


class LightningStoreClient(RemoteLightningStore):
    """A store server's client (``agl store serve``, :class:`LightningStoreServer`), made as Agent Lightning makes
    its ``LightningStoreClient``. ``retry_delays`` become agl's retries (as many, the first delay doubling up to the
    longest); the token is ``$AGL_STORE_TOKEN``, as for every agl client."""

    def __init__(
        self,
        server_address: str,
        *,
        retry_delays: Optional[Sequence[float]] = None,
        health_retry_delays: Optional[Sequence[float]] = None,
        request_timeout: float = 30.0,
        connection_timeout: Optional[float] = None,
    ) -> None:
        retries: Dict[str, Any] = {}
        if retry_delays is not None:
            delays = [float(d) for d in retry_delays] or [0.1]
            retries = {"retries": len(retry_delays), "backoff": min(delays), "max_backoff": max(delays)}
        if health_retry_delays is not None or connection_timeout is not None:
            say_once(
                "LightningStoreClient: health_retry_delays and connection_timeout are not used: agl's client "
                "connects within min(request_timeout, 10 s) and retries each request itself"
            )
        super().__init__(server_address, timeout=request_timeout, **retries)

    def __repr__(self) -> str:
        return f"LightningStoreClient({self.url!r})"


class LightningStoreServer(LightningStore):
    """``store`` served over HTTP on ``host:port`` from this process, by agl's store server (the app of
    ``agl store serve``) on a background thread: ``start()`` / ``stop()`` (awaitable from a coroutine).

    It is also a store: each call goes to ``store`` directly. The token is ``$AGL_STORE_TOKEN`` when set; without
    one the server accepts anybody who reaches it (Agent Lightning's server has no tokens), and says so loudly
    when it listens beyond this machine. ``launch_mode`` and the other Agent Lightning settings are accepted and
    unused (one log line): agl's server always runs on a thread of this process.
    """

    def __init__(
        self,
        store: LightningStore,
        host: Optional[str] = None,
        port: Optional[int] = None,
        **unused: Any,
    ) -> None:
        if not isinstance(store, LightningStore):
            raise TypeError(f"LightningStoreServer serves an agl store (an InMemoryLightningStore, ...), not {store!r}")
        if unused:
            say_once(
                f"LightningStoreServer: {', '.join(sorted(unused))} not used: agl's store server runs on a thread "
                "of this process (`agl store serve` runs it in a process of its own)"
            )
        self.store = store
        self.host = host or "127.0.0.1"
        self.port = DEFAULT_PORT if port is None else port
        self._server: Optional[Any] = None  # the ServerThread while serving

    def __repr__(self) -> str:
        return f"LightningStoreServer({self.store!r}, {self.host!r}, {self.port})"

    @property
    def url(self) -> str:
        """Where clients reach it: ``http://host:port`` (``port=0`` picks a free port, known once started)."""
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        """Agent Lightning's name for :attr:`url`."""
        return self.url

    def start(self) -> None:
        """Serve the store until :meth:`stop`; returns once the server accepts connections."""
        from agl.store.http.server import ServerThread, TokenSet, create_app
        from agl.store.http.server.running import warn_if_open_to_all

        if self._server is not None:
            return
        tokens = TokenSet.load()
        warn_if_open_to_all(self.host, tokens, not tokens)
        app = create_app(self.store, tokens=tokens, allow_anonymous=not tokens)
        self._server = ServerThread(app, self.host, self.port).start()
        self.port = self._server.port or self.port  # the one picked for port=0
        logger.info("store server for %r on %s", self.store, self.url)

    def stop(self) -> None:
        """Stop serving (a no-op when not serving). The store stays open: this object still reaches it."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def close(self) -> None:
        """Stop serving, then close the store."""
        self.stop()
        self.store.close()


def _forward(name: str) -> Callable[..., Any]:
    def call(self: LightningStoreServer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.store, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{name}`` of the store it serves."
    return call


for _name in (_API | LightningStore.__abstractmethods__) - {"close"}:
    setattr(LightningStoreServer, _name, _forward(_name))
abc.update_abstractmethods(LightningStoreServer)  # type: ignore[type-abstract]  # made concrete just above
async_calls.install(LightningStoreServer, _API | {"start", "stop"})


def LightningStoreThreaded(store: LightningStore) -> LightningStore:
    """``store`` itself: every agl store is thread-safe (and SQLite, PostgreSQL and the HTTP client process-safe),
    so no lock around it is needed."""
    say_once("LightningStoreThreaded: agl's stores are thread-safe already; the store is used as it is")
    return store


class CollectionBasedLightningStore:
    """Not in agl: its stores are not built on collections."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedStoreError(
            "CollectionBasedLightningStore is Agent Lightning's: agl's stores are not built on collections; use "
            "agl.SqliteLightningStore(path) (or agl.InMemoryLightningStore(), or subclass agl.LightningStore)"
        )


class MongoLightningStore:
    """Not in agl: it has no MongoDB store."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedStoreError(
            "MongoLightningStore is Agent Lightning's: agl has no MongoDB store; use its PostgreSQL store, "
            "agl.open_store('postgresql://user@host/database') (several machines), or agl.SqliteLightningStore(path)"
        )
