"""The store over HTTP: ``agl store serve`` (FastAPI + uvicorn) in front of any LightningStore.

Why it is built this way:
- Every endpoint is one LightningStore call, so the HTTP store behaves exactly like the one it serves;
  the client (agl.store.http.client) passes the same contract suite. The API is documented at ``/docs``
  (OpenAPI schema at ``/openapi.json``).
- No token, no access: every endpoint but ``/healthz`` and the API's description (``/docs``,
  ``/openapi.json``: routes and schemas, no data) needs ``Authorization: Bearer <token>``; tokens
  are a shared secret and/or one per runner from a file. A missing token gets 401, a wrong one 403.
- Bad input never reaches the store half-checked and never gets a 5xx: bodies over the size limit get
  413 before they are parsed, malformed ones 422 (400 for OTLP) naming the field, unknown ids 404 naming
  the id, stale updates 409. Nothing is changed by a refused request.
- Dequeue and wait are long polls: the request thread blocks inside the store, which wakes it when work
  arrives or a rollout ends (a condition variable, SQLite's doorbell, PostgreSQL's notifications). They
  run on their own thread limiter so waiting runners never starve other requests; a poll is answered
  after at most ``max_poll_seconds`` and the client asks again.
- Retries are safe: a request with an ``Idempotency-Key`` header that arrives again (the client timed out
  or lost the connection) gets the first answer, even while the first is still running.
- A timer calls ``reap_expired`` so attempts of runners that died are ended and retried even when no
  runner or trainer is calling.

The app is built in :mod:`.app`; the endpoints live in one module per area (rollouts, attempts, spans,
OTLP traces, resources), the middleware and the state they share in modules of their own.
"""

from __future__ import annotations

from agl.store.http.server.app import create_app
from agl.store.http.server.auth import TokenSet
from agl.store.http.server.limits import ServerLimits
from agl.store.http.server.running import ServerThread, serve

__all__ = ["ServerLimits", "ServerThread", "TokenSet", "create_app", "serve"]
