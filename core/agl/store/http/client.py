"""The HTTP store client: the LightningStore of a store server (``agl store serve``) on another machine.

``open_store("http://host:4747")`` returns one, so a runner uses a URL instead of a file and nothing else
changes: the same methods, results and exception classes (with the server's messages) as in-process.

Why it is built this way:
- One connection pool per process (``_http.ConnectionPool``, HTTP/1.1 on plain sockets: about a tenth
  of httpx's CPU per call), made lazily: after ``fork`` (runner pools) the child makes its own instead of
  sharing the parent's sockets, and the object pickles as its settings.
- Connection errors, timeouts and 5xx answers are retried with exponential back-off and jitter (the
  server may be restarting); after the last try the call raises StoreUnavailableError.
- Every call is safe to retry, even when the lost try did reach the store:
  enqueue sends client-chosen rollout ids (a retry finding them stored returns them), resources get a
  client-chosen id the same way, spans are insert-only by id, complete_attempt checks whether the
  attempt already ended as asked, and dequeue, enqueue, complete and add_spans carry an
  ``Idempotency-Key`` so a server that is still up answers a retry with its first answer.
- Dequeue and wait are long polls of at most ``max_poll`` seconds each: the server answers as soon as the
  store has something, the client asks again until its own timeout. Nobody sleeps and polls.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import re
import threading
import time
import uuid
from typing import Any, Callable, ClassVar, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

from agl.errors import (
    DuplicateResourcesError,
    DuplicateRolloutError,
    StaleAttemptError,
    StoreAddressError,
    StoreAuthError,
    StoreClosedError,
    StoreRequestError,
    StoreUnavailableError,
    UnknownAttemptError,
    UnknownRolloutError,
)
from agl.store import _rules
from agl.store.base import Completion, EnqueueRequest, LightningStore, RolloutQuery, StoreStats
from agl.store.http.transport import Answer, ConnectionPool, TransportError, bearer_token
from agl.store.http.wire import (
    AUTH_HEADER,
    IDEMPOTENCY_HEADER,
    TOKEN_ENV,
    AttemptList,
    CompleteAndDequeueBody,
    CompleteBody,
    CompletedAndClaimed,
    Deleted,
    DeleteSpansBody,
    DequeueBody,
    EnqueueBody,
    MaybeResources,
    QueryBody,
    Renewed,
    RolloutList,
    Stored,
    WaitBody,
    raise_for_error,
)
from agl.store.span_codec import SPANS_MEDIA_TYPE, frame_rows, span_frame
from agl.store.sqlite.schema import span_from_row, storable_row
from agl.types import Attempt, Resource, ResourcesUpdate, Rollout, Span, new_id, parse_resources

logger = logging.getLogger("agl.store.http.client")

T = TypeVar("T")


class _Parsed(Protocol):
    """What an answer is read as: a response model, or :class:`_SpanFrames`."""

    @classmethod
    def model_validate_json(cls: type[M], data: bytes) -> M: ...


M = TypeVar("M", bound=_Parsed)


class _SpanFrames:
    """A binary span batch (``SPANS_MEDIA_TYPE``), which ``query_spans`` asks for: a third of JSON's bytes."""

    def __init__(self, spans: List[Span]) -> None:
        self.spans = spans

    @classmethod
    def model_validate_json(cls, data: bytes) -> _SpanFrames:
        return cls([span_from_row(row) for row in frame_rows(data)])


_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})  # 408: the body stalled on its way
_OVER_LIMIT = re.compile(r"larger than this server's limit of (\d+) bytes")  # the server's 413 message


def _server_url(url: str) -> str:
    """``url`` checked, without a trailing ``/`` or ``/v1`` (the API's prefix, which the client adds; a path
    before it stays, for a proxy that serves the store under one): a typo fails here, in one line saying
    what to pass, not on the first call."""
    example = "pass http://HOST:PORT, e.g. http://127.0.0.1:4747"
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise StoreAddressError(f"store server URL {url!r} must start with http:// or https://: {example}")
    try:
        if not parts.hostname or parts.port == 0:
            raise ValueError
    except ValueError:
        raise StoreAddressError(
            f"store server URL {url!r} needs a host and a port from 1 to 65535: {example}"
        ) from None
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _body_limit(exc: Exception) -> Optional[int]:
    """The server's body limit, if ``exc`` is its 413 answer."""
    found = _OVER_LIMIT.search(str(exc))
    return int(found.group(1)) if found else None


class RemoteLightningStore(LightningStore):
    """A LightningStore served over HTTP by ``agl store serve``."""

    multiprocess_safe: ClassVar[bool] = True

    def __init__(
        self,
        url: str,
        *,
        token: Optional[str] = None,
        timeout: float = 30.0,
        retries: int = 8,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        max_poll: float = 20.0,
        max_connections: int = 32,
        outage_timeout: Optional[float] = None,
    ) -> None:
        """``token`` defaults to ``$AGL_STORE_TOKEN``. ``timeout`` bounds one request (plus the poll time of a
        long poll); ``retries`` more tries follow a failed one, ``backoff`` seconds apart, doubling up to
        ``max_backoff`` (with jitter). With the defaults a call rides out roughly 15 s of server downtime.

        ``outage_timeout``: a call whose ``retries`` ran out keeps trying, every ``max_backoff`` seconds, until
        this many seconds after it began (a warning says so once per outage). The Trainer and ``agl runner``
        set it through :meth:`ride_out_outages` (``Trainer(store_outage_timeout=)``, default 600 s), so that
        a store server restart or a network blip does not end a training run or throw away a finished
        rollout's result; interactive commands keep the short default and fail fast."""
        self.url = _server_url(url)
        try:
            self.token = (
                bearer_token(token, "token=")
                if token is not None
                else bearer_token(os.environ.get(TOKEN_ENV), f"${TOKEN_ENV}")
            )
        except ValueError as exc:
            raise StoreAuthError(str(exc)) from None
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_poll = max_poll
        self.max_connections = max_connections
        self.outage_timeout = outage_timeout
        self._closed = False
        self._max_body: Optional[int] = None  # the server's body limit, once a 413 named it
        self._versions: Dict[str, ResourcesUpdate] = {}  # resources versions read so far (immutable)
        self._reset_process_state()

    _SETTINGS = (
        "url",
        "token",
        "timeout",
        "retries",
        "backoff",
        "max_backoff",
        "max_poll",
        "max_connections",
        "outage_timeout",
    )

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._client: Optional[ConnectionPool] = None
        self._client_lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._SETTINGS}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        url = state.pop("url")
        # unpickling rebuilds the client from its settings (this class's constructor: a subclass may take others)
        RemoteLightningStore.__init__(self, url, **state)

    def __repr__(self) -> str:
        return f"RemoteLightningStore({self.url!r})"

    # -- transport -----------------------------------------------------------------------------------------
    def _http(self) -> ConnectionPool:
        if self._closed:
            raise StoreClosedError(f"{self!r} was closed; create a new RemoteLightningStore (or open_store(url))")
        if os.getpid() != self._pid:
            self._reset_process_state()  # forked: the parent's connections are not ours (never closed here)
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    headers = {AUTH_HEADER: f"Bearer {self.token}"} if self.token else {}
                    self._client = ConnectionPool(
                        self.url, headers, max_connections=self.max_connections, connect_timeout=min(self.timeout, 10.0)
                    )
                client = self._client
        return client

    def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        *,
        body: Optional[bytes] = None,
        params: Optional[Dict[str, str]] = None,
        poll: float = 0.0,
        idempotent_key: bool = False,
        after_retry: Optional[Callable[[Exception], M]] = None,
        content_type: str = "application/json",
        accept: Optional[str] = None,
    ) -> M:
        """One API call with retries; the answer parsed as ``model``, or the store's exception raised.

        ``after_retry`` decides what an error means when an earlier try may have been applied already
        (e.g. "already stored" after a lost answer): it returns the result or re-raises.
        """
        headers = {"Content-Type": content_type} if body is not None else {}
        if accept is not None:
            headers["Accept"] = accept
        if idempotent_key:
            headers[IDEMPOTENCY_HEADER] = uuid.uuid4().hex
        timeout = self.timeout + poll
        started = time.monotonic()
        last_problem = ""
        for attempt in itertools.count():
            if attempt:
                if not self._keep_trying(attempt, started, method, path, last_problem):
                    break
                self._sleep_before(attempt)
            try:
                response = self._http().request(
                    method, path, body=body, params=params, headers=headers, timeout=timeout
                )
            except TransportError as exc:
                last_problem = str(exc)
                logger.debug("%s %s failed (%s); retrying", method, path, last_problem)
                continue
            if response.status in _RETRY_STATUSES:
                last_problem = f"HTTP {response.status}: {response.text[:200]}"
                continue
            if response.status >= 400:
                try:
                    self._raise(response)
                except Exception as exc:
                    if attempt and after_retry is not None:
                        return after_retry(exc)
                    raise
            return model.model_validate_json(response.content)
        raise StoreUnavailableError(
            f"store server {self.url} did not answer {method} {path} after {attempt} tries over "
            f"{time.monotonic() - started:.1f} s (last: {last_problem}): is `agl store serve` running there and "
            "reachable? The call is safe to repeat"
        )

    def ride_out_outages(self, seconds: float) -> None:
        if self.outage_timeout is None:
            self.outage_timeout = seconds

    def _keep_trying(self, attempt: int, started: float, method: str, path: str, problem: str) -> bool:
        """Whether try number ``attempt`` (0: the first) may go: within ``retries``, or within ``outage_timeout``."""
        if attempt <= self.retries:
            return True
        waited = time.monotonic() - started
        if self.outage_timeout is None or waited >= self.outage_timeout:
            return False
        if attempt == self.retries + 1:
            logger.warning(
                "store server %s has not answered %s %s for %.0f s (%s); still trying, up to %.0f s",
                self.url,
                method,
                path,
                waited,
                problem,
                self.outage_timeout,
            )
        return True

    def _sleep_before(self, attempt: int) -> None:
        delay = min(self.max_backoff, self.backoff * 2 ** min(attempt - 1, 30))
        time.sleep(delay / 2 + random.uniform(0, delay / 2))  # jitter: clients that failed together spread out

    @staticmethod
    def _raise(response: Answer) -> None:
        try:
            body = response.json()
        except ValueError:
            body = {}
        raise_for_error(response.status, body if isinstance(body, dict) else {})

    @staticmethod
    def _segment(value: str, unknown: Callable[[], Exception]) -> str:
        """An id as one URL path segment; an id that cannot be one cannot be stored either (ids are
        store-made or pattern-checked), so it is unknown without asking."""
        if not value or "/" in value or value in (".", ".."):
            raise unknown()
        return quote(value, safe="")

    def _rollout_path(self, rollout_id: str, attempt_id: Optional[str] = None) -> str:
        path = "/v1/rollouts/" + self._segment(rollout_id, lambda: UnknownRolloutError(rollout_id))
        if attempt_id is not None:
            path += "/attempts/" + self._segment(attempt_id, lambda: UnknownAttemptError(rollout_id, attempt_id))
        return path

    # -- rollouts ------------------------------------------------------------------------------------------
    def enqueue_many(self, requests: Sequence[EnqueueRequest]) -> List[Rollout]:
        """One POST, or several in order if the batch is over the server's body limit (a data set of thousands
        of tasks in ``Trainer.dev``): then each part is one transaction, and a failing part leaves the earlier
        parts enqueued."""
        if not requests:
            return []
        named = [r if r.rollout_id else r.model_copy(update={"rollout_id": new_id("ro")}) for r in requests]
        EnqueueBody(requests=named)  # checks the batch before anything is sent
        _rules.check_request_ids(named)  # a lone surrogate could not even be sent as JSON
        encoded = [_rules.encode_json(r, "rollout input and metadata").encode() for r in named]
        ids = [str(r.rollout_id) for r in named]  # set by check_request_ids above

        def send(body: bytes, part: slice) -> List[Rollout]:
            def already_enqueued(exc: Exception) -> RolloutList:
                if not isinstance(exc, DuplicateRolloutError):
                    raise exc
                found = {r.rollout_id: r for r in self.query_rollouts(rollout_ids=ids[part])}
                if len(found) != len(ids[part]):
                    raise exc
                return RolloutList(rollouts=[found[i] for i in ids[part]])

            return self._call(
                "POST", "/v1/rollouts", RolloutList, body=body, idempotent_key=True, after_retry=already_enqueued
            ).rollouts

        return [rollout for part in self._post_fitting("requests", encoded, send) for rollout in part]

    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)

        def poll(wait: float) -> List[Rollout]:
            body = DequeueBody(runner_id=runner_id, limit=limit, timeout=wait).model_dump_json().encode()
            got = self._call("POST", "/v1/rollouts/dequeue", RolloutList, body=body, poll=wait, idempotent_key=True)
            return got.rollouts

        return self._long_poll(timeout, poll) or []

    def _long_poll(self, timeout: Optional[float], poll: Callable[[float], Optional[T]]) -> Optional[T]:
        """Call ``poll(seconds)`` until it returns something truthy or ``timeout`` (None: forever) passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self.max_poll if deadline is None else max(0.0, deadline - time.monotonic())
            result = poll(min(left, self.max_poll))
            if result or (deadline is not None and time.monotonic() >= deadline):
                return result

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        return self._call("POST", self._rollout_path(rollout_id, attempt_id) + "/heartbeat", Attempt)

    def _complete_attempt(self, done: Completion) -> Rollout:
        rollout_id, attempt_id, status, reward, error = done
        path = self._rollout_path(rollout_id, attempt_id) + "/complete"
        body = CompleteBody(status=status, reward=reward, error=error).model_dump_json().encode()

        def already_completed(exc: Exception) -> Rollout:
            return self._completed_by_lost_try(rollout_id, attempt_id, status, exc)

        return self._call("POST", path, Rollout, body=body, idempotent_key=True, after_retry=already_completed)

    def _completed_by_lost_try(self, rollout_id: str, attempt_id: str, status: str, exc: Exception) -> Rollout:
        """After a retried completion is refused as stale: the rollout if our earlier try (whose answer was
        lost) ended the attempt with ``status``; else ``exc`` is raised."""
        if isinstance(exc, StaleAttemptError):
            ended = [a for a in self.query_attempts(rollout_id) if a.attempt_id == attempt_id]
            if ended and ended[0].status == status:
                return self.get_rollout(rollout_id)
        raise exc

    def _complete_and_dequeue(self, done: Completion, runner_id: str, limit: int) -> Tuple[Rollout, List[Rollout]]:
        """One request instead of two (see ``LightningStore.complete_and_dequeue``)."""
        rollout_id, attempt_id, status, reward, error = done.checked()
        _rules.check_claim(runner_id, limit)
        path = self._rollout_path(rollout_id, attempt_id) + "/complete-and-dequeue"
        body = CompleteAndDequeueBody(status=status, reward=reward, error=error, runner_id=runner_id, limit=limit)

        def already_completed(exc: Exception) -> CompletedAndClaimed:
            # what a lost try claimed is lost with its answer: those attempts end at their heartbeat deadline
            # and their rollouts are retried
            return CompletedAndClaimed(
                rollout=self._completed_by_lost_try(rollout_id, attempt_id, status, exc), claimed=[]
            )

        got = self._call(
            "POST",
            path,
            CompletedAndClaimed,
            body=body.model_dump_json().encode(),
            idempotent_key=True,
            after_retry=already_completed,
        )
        return got.rollout, got.claimed

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        return self._call("POST", self._rollout_path(rollout_id) + "/cancel", Rollout)

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._call("GET", self._rollout_path(rollout_id), Rollout)

    def _query_rollouts(self, query: RolloutQuery) -> List[Rollout]:
        body = QueryBody(**query._asdict()).model_dump_json().encode()
        return self._call("POST", "/v1/rollouts/query", RolloutList, body=body).rollouts

    def query_attempts(self, rollout_id: str) -> List[Attempt]:
        return self._call("GET", self._rollout_path(rollout_id) + "/attempts", AttemptList).attempts

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> List[Rollout]:
        ids = list(dict.fromkeys(rollout_ids))
        if not ids:
            return []
        done: Dict[str, Rollout] = {}

        def poll(wait: float) -> bool:
            pending = [i for i in ids if i not in done]
            body = WaitBody(rollout_ids=pending, timeout=wait).model_dump_json().encode()
            for rollout in self._call("POST", "/v1/rollouts/wait", RolloutList, body=body, poll=wait).rollouts:
                done[rollout.rollout_id] = rollout
            return len(done) == len(ids)

        self._long_poll(timeout, poll)
        return [done[i] for i in ids if i in done]

    def reap_expired(self) -> List[Rollout]:
        return self._call("POST", "/v1/rollouts/reap", RolloutList).rollouts

    def renew_heartbeats(self) -> int:
        return self._call("POST", "/v1/attempts/renew-heartbeats", Renewed).renewed

    # -- spans ---------------------------------------------------------------------------------------------
    def add_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            return 0
        frames = [span_frame(storable_row(span)) for span in spans]  # refuses the batch before anything is sent

        def send(body: bytes, part: slice) -> int:
            return self._call(
                "POST", "/v1/spans", Stored, body=body, idempotent_key=True, content_type=SPANS_MEDIA_TYPE
            ).stored

        return sum(self._post_fitting("", frames, send))

    def _post_fitting(self, field: str, items: List[bytes], send: Callable[[bytes, slice], T]) -> List[T]:
        """``send(body, part)`` for the JSON items ``items[part]`` as ``{field: [...]}``, in as few requests as the
        server's body limit allows, in order; the answers, one per request.

        The limit is learnt from the server's first 413 (its message names it) and kept for later batches, so a
        large batch is refused once, not halved over and over; a single item over the limit is sent alone and
        its 413 raised (a span or task cannot be split)."""
        head, tail, sep = (f'{{"{field}":['.encode(), b"]}", b",") if field else (b"", b"", b"")
        answers: List[T] = []
        start = 0
        while start < len(items):
            stop, size = start + 1, len(head) + len(tail) + len(items[start])
            while stop < len(items) and (
                self._max_body is None or size + len(sep) + len(items[stop]) <= self._max_body
            ):
                size += len(sep) + len(items[stop])
                stop += 1
            try:
                answers.append(send(head + sep.join(items[start:stop]) + tail, slice(start, stop)))
            except StoreRequestError as exc:
                limit = _body_limit(exc)
                if limit is None or stop - start == 1:
                    raise
                self._max_body = min(limit, size - 1)  # smaller than what was refused: the next try is smaller
                logger.info(
                    "a batch of %d over the server's body limit of %d bytes: sending it in parts", stop - start, limit
                )
                continue
            start = stop
        return answers

    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = "latest") -> List[Span]:
        which = "all" if attempt_id is None else attempt_id
        path = self._rollout_path(rollout_id) + "/spans"
        return self._call("GET", path, _SpanFrames, params={"attempt_id": which}, accept=SPANS_MEDIA_TYPE).spans

    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        body = DeleteSpansBody(rollout_ids=list(rollout_ids)).model_dump_json().encode()
        return self._call("POST", "/v1/spans/delete", Deleted, body=body, idempotent_key=True).deleted

    # -- resources -----------------------------------------------------------------------------------------
    def add_resources(self, resources: Dict[str, Resource], resources_id: Optional[str] = None) -> ResourcesUpdate:
        parsed = parse_resources(dict(resources))  # bad resources are refused here, as by every store
        _rules.check_id(resources_id, "resources_id")
        chosen = resources_id or new_id("res")
        body = _rules.encode_json({"resources": parsed, "resources_id": chosen}, "resources").encode()

        def already_added(exc: Exception) -> ResourcesUpdate:
            if isinstance(exc, DuplicateResourcesError) and resources_id is None:
                update = self.get_resources(chosen)  # the id was ours: our lost try stored it
                if update is not None:
                    return update
            raise exc

        return self._call(
            "POST", "/v1/resources", ResourcesUpdate, body=body, idempotent_key=True, after_retry=already_added
        )

    def get_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        """A version by id is read once per process: versions are never overwritten, and a runner asks for
        its rollout's version every rollout. The latest (``None``) is always asked for."""
        if resources_id is not None and resources_id in self._versions:
            return self._versions[resources_id].model_copy(deep=True)
        params = {} if resources_id is None else {"resources_id": resources_id}
        update = self._call("GET", "/v1/resources", MaybeResources, params=params).update
        if update is not None and len(self._versions) < 256:
            self._versions[update.resources_id] = update.model_copy(deep=True)
        return update

    # -- misc ----------------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        return self._call("GET", "/v1/stats", StoreStats)

    def close(self) -> None:
        self._closed = True
        if os.getpid() == self._pid and self._client is not None:
            self._client.close()
