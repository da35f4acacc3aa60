"""The web view's app (:func:`create_ui`): its routes, the token gate, and error pages instead of tracebacks.

The pages only read. Each route is a plain function that FastAPI runs on a worker thread, since every store
call blocks. Served behind a store server's tokens (``agl store serve``'s ``/ui``), a browser sends the token
once as ``?token=...``: the answer stores it in an HttpOnly cookie and redirects to the same page without
it, so that the token leaves the address bar and history; scripts may send ``Authorization: Bearer``."""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable, Optional
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from agl.errors import AglError, StoreUnavailableError, UnknownAttemptError, UnknownRolloutError
from agl.store.base import LightningStore
from agl.store.http.server.auth import TokenSet
from agl.ui.html import esc, page
from agl.ui.pages import render_list, render_rollout
from agl.ui.queries import (
    MAX_PAGE_SIZE,
    MODES,
    PAGE_SIZE,
    STATUSES,
    Counts,
    ResourceVersions,
    rollout_detail,
    rollout_page,
)
from agl.ui.training import MAX_WINDOW, WINDOW, render_training, training_view

logger = logging.getLogger("agl.ui")

COOKIE = "agl_ui_token"
REFRESH_S = 5


class BadInput(ValueError):
    """A query parameter the pages cannot use: a 400 page that names it."""


def create_ui(store: LightningStore, *, tokens: Optional[TokenSet] = None) -> FastAPI:
    """The pages over ``store`` (which the caller owns and closes). With ``tokens``, every page needs one of
    them (query parameter ``token`` once, then the cookie, or a bearer header)."""
    app = FastAPI(title="agl web view", docs_url=None, redoc_url=None, openapi_url=None)
    versions, counts = ResourceVersions(), Counts()
    _install_errors(app)
    if tokens:
        _install_gate(app, tokens)

    @app.get("/", response_class=HTMLResponse)
    def rollouts(request: Request) -> str:
        status = _choice(request, "status", STATUSES)
        mode = _choice(request, "mode", MODES)
        offset = _integer(request, "offset", 0, 0, 10**12)
        limit = _integer(request, "limit", PAGE_SIZE, 1, MAX_PAGE_SIZE)
        data = rollout_page(store, versions, counts, status=status, mode=mode, offset=offset, limit=limit)
        return page("Rollouts", render_list(data, root=_root(request), status=status, mode=mode), root=_root(request))

    @app.get("/rollouts/{rollout_id}", response_class=HTMLResponse)
    def rollout(request: Request, rollout_id: str) -> str:
        attempt = request.query_params.get("attempt") or None
        agent_match = request.query_params.get("agent_match") or None
        detail = rollout_detail(store, versions, rollout_id, attempt, agent_match)
        return page(f"Rollout {rollout_id}", render_rollout(detail, root=_root(request)), root=_root(request))

    @app.get("/training", response_class=HTMLResponse)
    def training(request: Request) -> str:
        window = _integer(request, "window", WINDOW, 1, MAX_WINDOW)
        threshold = _number(request, "threshold", 1.0)
        view = training_view(store, versions, counts, window)
        body = render_training(view, threshold, window)
        return page("Training", body, root=_root(request), refresh_s=REFRESH_S)

    return app


def _root(request: Request) -> str:
    """Where the app is mounted: "" for ``agl ui``, "/ui" under the store server."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _choice(request: Request, name: str, allowed: list) -> Optional[str]:
    value = request.query_params.get(name) or None
    if value is not None and value not in allowed:
        raise BadInput(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def _integer(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name) or ""
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise BadInput(f"{name}={raw!r} is not a whole number") from None
    if not low <= value <= high:
        raise BadInput(f"{name}={value} must be between {low} and {high}")
    return value


def _number(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name) or ""
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise BadInput(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise BadInput(f"{name} must be a finite number, got {raw!r}")
    return value


def _error_page(request: Request, status: int, message: str) -> HTMLResponse:
    body = f'<h1>{status}</h1><div class="error-box">{esc(message)}</div>'
    return HTMLResponse(page(str(status), body, root=_root(request)), status_code=status)


def _install_errors(app: FastAPI) -> None:
    """Unknown ids: 404; bad parameters: 400; a store that does not answer: 503; any other agl error: 500.
    Each a page with one line that says what was wrong."""

    async def unknown(request: Request, exc: Exception) -> Response:
        return _error_page(
            request, 404, f"{exc.args[0] if exc.args else exc}: check the id (the rollouts list links to each)"
        )

    async def bad(request: Request, exc: Exception) -> Response:
        return _error_page(request, 400, str(exc))

    async def unavailable(request: Request, exc: Exception) -> Response:
        return _error_page(request, 503, f"the store does not answer: {exc}")

    async def failed(request: Request, exc: Exception) -> Response:
        logger.warning("web view: %s failed: %s", request.url.path, exc)
        return _error_page(request, 500, str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _error_page(request, exc.status_code, f"{request.url.path}: {exc.detail}")

    for kind in (UnknownRolloutError, UnknownAttemptError):
        app.add_exception_handler(kind, unknown)
    app.add_exception_handler(BadInput, bad)
    app.add_exception_handler(StoreUnavailableError, unavailable)
    app.add_exception_handler(AglError, failed)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _install_gate(app: FastAPI, tokens: TokenSet) -> None:
    @app.middleware("http")
    async def gate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        offered = request.query_params.get("token")
        if offered is not None:
            if tokens.check(offered) is None:
                return _error_page(request, 403, "token not accepted: use the store server's token (--token)")
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            answer = RedirectResponse(target, status_code=303)
            answer.set_cookie(COOKIE, offered, httponly=True, samesite="strict", path=_root(request) or "/")
            return answer
        header = request.headers.get("authorization", "")
        presented = request.cookies.get(COOKIE) or (header[7:].strip() if header.lower().startswith("bearer ") else "")
        if not presented:
            return _error_page(
                request,
                401,
                "these pages need the store server's token: open this address once with ?token=TOKEN "
                "added (a cookie then keeps it)",
            )
        if tokens.check(presented) is None:
            return _error_page(
                request, 403, "token not accepted: open this address with ?token=TOKEN and the right token"
            )
        return await call_next(request)
