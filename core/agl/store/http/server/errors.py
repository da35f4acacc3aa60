"""How the store server answers errors: the store's own as their status with a JSON body naming the error
(500 with a logged traceback for a bug; 503 for an outage of its database or disk, logged once per kind a
minute), malformed requests as 422 naming the field, unknown paths as 404."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from agl.errors import AglError, StoreUnavailableError
from agl.store.http.wire import ErrorBody, error_body, error_status

logger = logging.getLogger("agl.store.http.server")  # the server's one logger, whichever module logs

# The error answers every /v1 endpoint documents (OpenAPI).
ERROR_RESPONSES: Dict[int | str, Dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        401: "no token (Authorization: Bearer <token>)",
        403: "token not accepted",
        404: "an id that is not in the store (the message names it)",
        409: "a stale or illegal state change (nothing was changed)",
        413: "request body over the server's limit",
        422: "malformed request (the message names the field)",
    }.items()
}


OUTAGE_LOG_S = 60.0  # the server logs each kind of outage (its error and message) once this often


class OutageLog:
    """Warnings for the 503s of an outage, one line per kind (the error's class and message) per
    ``interval``, with how many answers the previous line stood for: every runner asks again about once a
    second, and a line (or a traceback) per request buried the log (1,867 lines in 13 s of a full disk)."""

    def __init__(
        self, what: str = "answered 503 (clients retry)", interval: float = OUTAGE_LOG_S, max_kinds: int = 1_000
    ) -> None:
        self._what = what
        self._interval = interval
        self._max_kinds = max_kinds
        self._kinds: Dict[Tuple[str, str], Tuple[float, int]] = {}  # kind -> (when logged, answers since)
        self._lock = threading.Lock()

    def answered(self, exc: BaseException) -> None:
        """Count one failure because of ``exc`` (a 503, by default); log it if its kind was not logged within
        the interval."""
        kind = (type(exc).__name__, str(exc))
        now = time.monotonic()
        with self._lock:
            logged, since = self._kinds.get(kind, (-self._interval, 0))
            if now - logged < self._interval:
                self._kinds[kind] = (logged, since + 1)
                return
            if len(self._kinds) >= self._max_kinds:
                self._kinds.clear()
            self._kinds[kind] = (now, 0)
        more = f" ({since} more times since it was last logged)" if since else ""
        logger.warning("store unavailable, %s%s: %s", self._what, more, exc)


_outages = OutageLog()


def error_response(exc: BaseException) -> Response:
    """The answer to a request whose store call raised ``exc``."""
    status = error_status(exc)
    if isinstance(exc, StoreUnavailableError):  # an outage of its database or disk, not a bug: no traceback
        _outages.answered(exc)
    if status is None:
        logger.exception("store server error", exc_info=exc)
        body = ErrorBody(error="InternalError", message=f"the store server failed: {type(exc).__name__}: {exc}")
        return Response(body.model_dump_json(exclude_none=True), status_code=500, media_type="application/json")
    return Response(
        error_body(exc).model_dump_json(exclude_none=True), status_code=status, media_type="application/json"
    )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg')}")
    more = f" (and {len(exc.errors()) - 5} more)" if len(exc.errors()) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more + " (see the API schema at /docs)"


def install_error_handlers(app: FastAPI) -> None:
    """Answer the store's errors, malformed requests and unknown paths with agl's JSON error body."""

    async def on_store_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        body = ErrorBody(error="StoreRequestError", message=_validation_message(exc))
        return JSONResponse(body.model_dump(exclude_none=True), status_code=422)

    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no endpoint {request.method} {request.url.path} on this store server (see /docs)"
            if "/v1/" in request.url.path[1:]:  # the client was given a URL with a path: .../v1, .../v1/stats
                message += "; pass the store as http://HOST:PORT, without a path (the client adds /v1/...)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path} (see /docs)"
        body = ErrorBody(error="StoreRequestError", message=message)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(AglError, on_store_error)
    app.add_exception_handler(ValueError, on_store_error)
    app.add_exception_handler(TypeError, on_store_error)
    app.add_exception_handler(OverflowError, on_store_error)
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]  # Starlette's handler type is narrower than its use
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]  # Starlette's handler type is narrower than its use
