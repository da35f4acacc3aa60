"""The store server's FastAPI app (:func:`create_app`): its middleware, error handlers and endpoints, and a
lifespan that renews heartbeats at start and runs the reap timer."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import AsyncIterator, Dict, Optional

import anyio
import anyio.to_thread
from fastapi import FastAPI

from agl.errors import StoreUnavailableError
from agl.store.base import LightningStore
from agl.store.http import otlp
from agl.store.http.server import attempts, resources, rollouts, spans, traces
from agl.store.http.server.auth import TokenCheck, TokenSet
from agl.store.http.server.context import ServerContext
from agl.store.http.server.direct_routes import DirectRoutes
from agl.store.http.server.errors import OutageLog, install_error_handlers
from agl.store.http.server.limits import BodyLimit, ServerLimits
from agl.store.http.server.routing import document_models

logger = logging.getLogger("agl.store.http.server")  # the server's one logger, whichever module logs

# In the order their routes are matched.
_ROUTERS = [rollouts.router, attempts.router, spans.router, traces.router, resources.router]
# A runner's hot requests, which DirectRoutes sends straight to their endpoints.
_DIRECT = ["dequeue", "complete", "complete_and_dequeue", "add_spans"]

_DESCRIPTION = (
    "The LightningStore over HTTP: trainers and runners on different machines meet here. Every "
    "endpoint but /healthz and this description needs `Authorization: Bearer <token>`. Errors are JSON "
    "`{error, message, ...ids}` where `error` names the exception the Python client raises. "
    "POST endpoints honour an `Idempotency-Key` header (a retry gets the first answer). "
    "OpenTelemetry exporters send spans to /v1/traces (OTLP/HTTP, JSON or protobuf)."
)


def create_app(
    store: LightningStore,
    *,
    tokens: Optional[TokenSet] = None,
    allow_anonymous: bool = False,
    limits: Optional[ServerLimits] = None,
) -> FastAPI:
    """The FastAPI app serving ``store``. It does not close the store; its owner does.

    ``tokens`` are required unless ``allow_anonymous`` (then anybody who can reach the port has full access).
    """
    if not tokens and not allow_anonymous:
        raise ValueError(
            "a store server needs at least one token (--token, $AGL_STORE_TOKEN or --tokens-file); "
            "pass allow_anonymous=True (--insecure-no-auth) only on a trusted network"
        )
    limits = limits or ServerLimits()
    context = ServerContext(store, limits)
    app = FastAPI(title="agl store server", version="1", description=_DESCRIPTION, lifespan=_lifespan)
    app.state.store_server = context
    install_error_handlers(app)
    app.add_middleware(DirectRoutes, fastapi_app=app, names=_DIRECT)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(TokenCheck, tokens=tokens, prefix="/v1/")  # added last: runs first, before bodies are read

    @app.get("/healthz", tags=["meta"], summary="liveness (no token needed)")
    async def healthz() -> Dict[str, str]:
        return {"status": "ok"}

    for router in _ROUTERS:
        # the routes themselves, not app.include_router(router): see StoreRouter
        app.router.routes.extend(router.routes)
    document_models(app, [body for router in _ROUTERS for body in router.bodies] + [otlp.ExportTraceServiceRequest])
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    context: ServerContext = app.state.store_server
    limits, store = context.limits, context.store
    anyio.to_thread.current_default_thread_limiter().total_tokens = limits.max_workers
    context.pollers = anyio.CapacityLimiter(limits.max_pollers)
    # Runners could not send heartbeats while this server was down: without this, a restart after more
    # than the heartbeat timeout would end all their attempts as unresponsive at once.
    renewed = await anyio.to_thread.run_sync(store.renew_heartbeats)
    if renewed:
        logger.info("renewed the heartbeat deadline of %d running attempt(s) for their runners to reconnect", renewed)
    stop = threading.Event()
    reaper = threading.Thread(target=_reap_forever, args=(store, stop, limits.reap_interval), daemon=True)
    reaper.start()
    try:
        yield
    finally:
        stop.set()


def _reap_forever(store: LightningStore, stop: threading.Event, interval: float) -> None:
    """End attempts past their deadline even when nobody calls the store (every runner is dead)."""
    outages = OutageLog("could not end expired attempts (retried each interval)")
    while not stop.wait(interval):
        try:
            changed = store.reap_expired()
        except StoreUnavailableError as exc:  # an outage: one line a minute, not one a second
            outages.answered(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a failing store must not kill the timer
            logger.warning("reap_expired failed: %s", exc)
            continue
        for rollout in changed:
            logger.info("rollout %s: attempt expired, rollout is now %s", rollout.rollout_id, rollout.status)
