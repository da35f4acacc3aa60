"""Who may call the store server: the bearer tokens it accepts (:class:`TokenSet`) and the middleware that
checks them on every ``/v1/`` request before its body is read (:class:`TokenCheck`)."""

from __future__ import annotations

import hmac
import os
import re
from typing import Dict, Optional

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from agl.store.http.transport import bearer_token
from agl.store.http.wire import AUTH_HEADER, TOKEN_ENV, ErrorBody

CLIENT_STATE = "agl_client"  # scope["state"] key: the name of the token a request came with
_AUTH_HEADER = AUTH_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes

_COMMENT = re.compile(r"(?:^|(?<=\s))#")  # a comment starts a line or follows a space


class TokenSet:
    """The bearer tokens a server accepts, by name (the name shows up in the logs, never the token)."""

    def __init__(self, tokens: Dict[str, str]) -> None:
        tokens = {name: bearer_token(token, f"token {name!r}") or "" for name, token in tokens.items()}
        empty = [name for name, token in tokens.items() if not token]
        if empty:
            raise ValueError(f"token(s) {', '.join(empty)} are empty: every token needs at least one character")
        self._tokens = [(name, token.encode()) for name, token in tokens.items()]

    @classmethod
    def load(cls, token: Optional[str] = None, tokens_file: Optional[str] = None) -> TokenSet:
        """A shared ``token`` (default: ``$AGL_STORE_TOKEN``) and/or per-runner tokens from ``tokens_file``.

        The file has one token per line, ``NAME TOKEN`` or just ``TOKEN``; ``#`` at the start of a line or after
        a space starts a comment (one inside a token is part of it: a secret is never cut short). A name given
        twice is refused, not the first token silently dropped.
        """
        tokens: Dict[str, str] = {}
        where: Dict[str, str] = {}  # name -> where it was given
        if token is None:
            token = bearer_token(os.environ.get(TOKEN_ENV), f"${TOKEN_ENV}")
        else:
            token = bearer_token(token, "--token")
        if token:
            tokens["shared"], where["shared"] = token, "the shared token (--token or $AGL_STORE_TOKEN)"
        if tokens_file:
            with open(tokens_file, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    words = _COMMENT.split(line, 1)[0].split()
                    if not words:
                        continue
                    if len(words) > 2:
                        raise ValueError(
                            f"{tokens_file}:{number}: write 'NAME TOKEN' or 'TOKEN' (tokens have no spaces)"
                        )
                    name, value = (words[0], words[1]) if len(words) == 2 else (f"line-{number}", words[0])
                    if name in tokens:
                        raise ValueError(
                            f"{tokens_file}:{number}: the name {name!r} is given twice (also {where[name]}): give each "
                            "runner or machine its own name"
                        )
                    tokens[name], where[name] = value, f"line {number}"
        return cls(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def check(self, presented: str) -> Optional[str]:
        """The name of the token presented, or None; compares in constant time against every token."""
        found = None
        for name, token in self._tokens:
            if hmac.compare_digest(presented.encode(), token):
                found = name
        return found


class TokenCheck:
    """ASGI middleware: a request under ``prefix`` needs a bearer token the server accepts (401/403 with a JSON
    error otherwise); the token's name goes to ``scope["state"]["agl_client"]`` (the idempotency keys' owner).

    Why a middleware and not a FastAPI dependency: solving the dependency cost a light request 10-17 of its
    70-90 µs of server CPU (``benchmarks/server_overhead.py``); this is a header lookup. A request for a
    path that does not exist under ``prefix`` gets 401 without a token too (no route list for strangers).
    """

    def __init__(self, app: ASGIApp, tokens: Optional[TokenSet], prefix: str) -> None:
        self.app = app
        self.tokens = tokens
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        try:
            name = self._check(scope)
        except _AuthFailure as exc:
            body = ErrorBody(error="StoreAuthError", message=exc.message)
            headers = {"WWW-Authenticate": 'Bearer realm="agl-store"'} if exc.status == 401 else None
            response = JSONResponse(body.model_dump(exclude_none=True), status_code=exc.status, headers=headers)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[CLIENT_STATE] = name
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> str:
        if not self.tokens:
            return "anonymous"
        header = next((v for k, v in scope["headers"] if k == _AUTH_HEADER), b"").decode("latin-1")
        scheme, _, presented = header.partition(" ")
        if not header:
            raise _AuthFailure(
                401,
                "this store server needs a token: send 'Authorization: Bearer <token>' "
                f"(the agl client reads token=... or ${TOKEN_ENV})",
            )
        if scheme.lower() != "bearer" or not presented.strip():
            raise _AuthFailure(401, "the Authorization header must be 'Bearer <token>'")
        name = self.tokens.check(presented.strip())
        if name is None:
            raise _AuthFailure(403, "token not accepted by this store server: check the token you were given")
        return name


class _AuthFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
