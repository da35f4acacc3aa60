"""A fast path for a runner's hot requests, straight to their endpoint functions past Starlette's and
FastAPI's per-request machinery (:class:`DirectRoutes`)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send


class DirectRoutes:
    """ASGI middleware: a runner's hot requests go straight to their endpoint functions.

    Why: under load, Starlette's and FastAPI's per-request machinery (matching the path against every route,
    the exception and exit-stack middlewares, dependency solving, the request and response wrappers) was ~18%
    of the server's CPU per PostgreSQL rollout (py-spy under ``benchmarks/store_load.py``); calling the
    endpoints directly cut the server's CPU per rollout by ~15% (alternated runs, 8 clients). The routes stay
    registered with FastAPI, which documents them (OpenAPI) and answers every other method and path; errors
    get the app's own exception handlers, looked up along the exception's MRO as Starlette looks them up.
    Only endpoints taking path strings and the request may be listed (their bodies are parsed by ``parse_body``).
    """

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, names: Sequence[str]) -> None:
        self.app = app
        self._fastapi = fastapi_app
        self._names = names
        self._table: Optional[List[Tuple[str, Any, Callable[..., Awaitable[Response]]]]] = None

    def _routes(self) -> List[Tuple[str, Any, Callable[..., Awaitable[Response]]]]:
        if self._table is None:  # built on the first request: the routes are registered after the middleware
            found = {route.name: route for route in self._fastapi.routes if isinstance(route, APIRoute)}
            self._table = [
                (method, found[name].path_regex, found[name].endpoint)
                for name in self._names
                for method in found[name].methods or ()
            ]
        return self._table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            for method, regex, endpoint in self._routes():
                if scope["method"] == method and (match := regex.match(path)):
                    await self._call(endpoint, match.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _call(
        self,
        endpoint: Callable[..., Awaitable[Response]],
        params: Dict[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        request = Request(scope, receive)
        try:
            response = await endpoint(request=request, **params)
        except Exception as exc:
            handlers = self._fastapi.exception_handlers
            handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
            if handler is None:
                raise  # as through FastAPI: ServerErrorMiddleware answers 500
            response = await handler(request, exc)  # type: ignore[misc]  # agl's handlers are all async
        await response(scope, receive, send)
