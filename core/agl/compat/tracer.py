"""Agent Lightning's tracers (``agl.tracer``, ``agl.tracer.otel``, ``agl.tracer.agentops``) on agl's own tracing.

Agent Lightning records through a tracer object the user builds and hands to its runner or Trainer: an
OpenTelemetry SDK provider of its own (``OtelTracer``) or AgentOps's (``AgentOpsTracer``). agl records every span
with its one process-wide tracer (:mod:`agl.tracing`) and its own instrumentation (``agl.instrument()``), in one
span format. So these classes keep Agent Lightning's calls and meaning, and do the work with agl's machinery:

- ``init_worker(worker_id, store)`` / ``lifespan(store)`` point agl's tracer at the store and, when nothing is
  instrumented in the process, instrument it for the tracer's life (``agl.instrument()``: the OpenAI client and
  every installed framework), as Agent Lightning's default tracer did with AgentOps;
- ``async with tracer.trace_context(name, rollout_id=, attempt_id=)`` records what runs inside into that attempt
  (agl's rollout scope) and yields an OpenTelemetry tracer whose ``start_as_current_span`` makes agl spans;
- ``get_last_trace()`` returns the stored spans of the last traced attempt (agl's ``Span``: no second format).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncContextManager, Awaitable, Callable, ContextManager, Iterator, List, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.util import types as otel_types

from agl.instrumentation import instrument, uninstrument
from agl.instrumentation.base import any_instrumented
from agl.store.base import LightningStore
from agl.tracing.context import RolloutScope, rollout_scope
from agl.tracing.tracer import get_tracer
from agl.types import Span

logger = logging.getLogger("agl.compat.tracer")

__all__ = [
    "AgentOpsTracer",
    "DummyTracer",
    "OtelTracer",
    "Tracer",
    "WeaveTracer",
    "clear_active_tracer",
    "get_active_tracer",
    "set_active_tracer",
]

_active_tracer: Optional[Tracer] = None
_said: set = set()  # the one-line notes already logged in this process


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.info(message)


def set_active_tracer(tracer: Tracer) -> None:
    """Agent Lightning's process-wide active tracer (set inside ``trace_context``)."""
    global _active_tracer
    _active_tracer = tracer


def clear_active_tracer() -> None:
    global _active_tracer
    _active_tracer = None


def get_active_tracer() -> Optional[Tracer]:
    return _active_tracer


class _SpanMaker(otel_trace.Tracer):
    """What ``trace_context`` yields: an OpenTelemetry tracer whose spans are agl's, stored with the attempt."""

    def start_span(
        self,
        name: str,
        context: Optional[otel_context.Context] = None,
        kind: otel_trace.SpanKind = otel_trace.SpanKind.INTERNAL,
        attributes: otel_types.Attributes = None,
        links: Optional[Any] = None,
        start_time: Optional[int] = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> otel_trace.Span:
        parent = otel_trace.get_current_span(context) if context is not None else None
        return get_tracer().start_span(name, "chain", attributes, parent=parent, start_time=start_time)

    @contextlib.contextmanager
    def start_as_current_span(  # type: ignore[override]  # a generator context manager, as the SDK's own
        self,
        name: str,
        context: Optional[otel_context.Context] = None,
        kind: otel_trace.SpanKind = otel_trace.SpanKind.INTERNAL,
        attributes: otel_types.Attributes = None,
        links: Optional[Any] = None,
        start_time: Optional[int] = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[otel_trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with otel_trace.use_span(span, end_on_exit, record_exception, set_status_on_exception) as current:
            yield current


class _AsyncContext(AsyncContextManager[Any]):
    """A sync context manager used with ``async with``: entered and left in the caller's task, so the rollout
    scope it sets is the task's."""

    def __init__(self, inner: ContextManager[Any]) -> None:
        self._inner = inner

    async def __aenter__(self) -> Any:
        return self._inner.__enter__()

    async def __aexit__(self, *exc: Any) -> Optional[bool]:
        return self._inner.__exit__(*exc)


class Tracer:
    """Agent Lightning's tracer base class, recording with agl's tracer (see the module docstring)."""

    #: whether ``init_worker`` instruments the process for the tracer's life when nothing is instrumented
    instruments: bool = True

    def __init__(self) -> None:
        self.worker_id: Optional[int] = None
        self._store: Optional[LightningStore] = None
        self._hooked: List[str] = []
        self._last: Optional[Tuple[LightningStore, str, str]] = None  # the attempt get_last_trace reads

    # -- lifecycle -----------------------------------------------------------------------------------------
    def init(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to prepare before the workers start: agl's tracer is created on first use."""

    def init_worker(self, worker_id: int, store: Optional[LightningStore] = None) -> None:
        self.worker_id = worker_id
        if store is not None:
            self._store = store
            get_tracer().set_store(store)
        if self.instruments and not self._hooked and not any_instrumented():
            self._hooked = instrument()
            logger.info("instrumenting %s for this tracer (agl records with its own hooks)", ", ".join(self._hooked))

    def teardown_worker(self, worker_id: int) -> None:
        """Remove the instrumentation ``init_worker`` added (none if the process was instrumented already)."""
        hooked, self._hooked = self._hooked, []
        uninstrument(hooked)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to release: agl's tracer lives as long as the process."""

    @contextlib.contextmanager
    def lifespan(self, store: Optional[LightningStore] = None) -> Iterator[None]:
        """``init`` and ``init_worker(0, store)`` on enter, their teardowns on exit."""
        self.init()
        try:
            self.init_worker(0, store)
            try:
                yield
            finally:
                self.teardown_worker(0)
        finally:
            self.teardown()

    # -- tracing -------------------------------------------------------------------------------------------
    def trace_context(
        self,
        name: Optional[str] = None,
        *,
        store: Optional[LightningStore] = None,
        rollout_id: Optional[str] = None,
        attempt_id: Optional[str] = None,
    ) -> AsyncContextManager[otel_trace.Tracer]:
        """``async with``: what runs inside is recorded into the attempt ``attempt_id`` of ``rollout_id`` in
        ``store`` (or the store given to ``init_worker``). Without ids, a rollout is started in the store for
        this trace (``name`` as its input) and ended when the block ends. Yields an OpenTelemetry tracer."""
        return _AsyncContext(self._trace_context_sync(name, store=store, rollout_id=rollout_id, attempt_id=attempt_id))

    @contextlib.contextmanager
    def _trace_context_sync(
        self,
        name: Optional[str] = None,
        *,
        store: Optional[LightningStore] = None,
        rollout_id: Optional[str] = None,
        attempt_id: Optional[str] = None,
    ) -> Iterator[otel_trace.Tracer]:
        store = store or self._store
        if store is None:
            raise ValueError(
                f"{type(self).__name__}.trace_context needs a store: use `with tracer.lifespan(store):`, "
                "tracer.init_worker(0, store), or trace_context(store=...)"
            )
        if (rollout_id is None) != (attempt_id is None):
            raise ValueError("trace_context takes rollout_id and attempt_id together (or neither)")
        owned = rollout_id is None
        if rollout_id is None or attempt_id is None:
            started = store.start_rollout(input=name)
            assert started.attempt is not None  # start_rollout returns the rollout running its first attempt
            rollout_id, attempt_id = started.rollout_id, started.attempt.attempt_id
        get_tracer().set_store(store)
        self._last = (store, rollout_id, attempt_id)
        previous = get_active_tracer()
        set_active_tracer(self)
        scope: Optional[RolloutScope] = None
        error: Optional[BaseException] = None
        try:
            with rollout_scope(rollout_id, attempt_id) as scope:
                yield _SpanMaker()
        except BaseException as exc:
            error = exc
            raise
        finally:
            _active_tracer_restored(previous)
            get_tracer().flush()
            if owned:
                _end_own_rollout(store, rollout_id, attempt_id, scope, error)

    def attach(self, store: LightningStore, rollout_id: str, attempt_id: str) -> None:
        """Called by ``LitAgentRunner`` as a rollout starts: the attempt ``get_last_trace`` reads."""
        self._last = (store, rollout_id, attempt_id)

    def get_last_trace(self) -> List[Span]:
        """The spans stored so far for the last attempt traced (agl's ``Span``); [] before any."""
        if self._last is None:
            return []
        store, rollout_id, attempt_id = self._last
        get_tracer().flush()
        return store.query_spans(rollout_id, attempt_id)

    def trace_run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func`` in a trace of its own (a rollout started for it in the tracer's store)."""
        with self._trace_context_sync(name=getattr(func, "__name__", "trace_run")):
            return func(*args, **kwargs)

    async def trace_run_async(self, func: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        async with self.trace_context(name=getattr(func, "__name__", "trace_run")):
            return await func(*args, **kwargs)

    def get_langchain_handler(self, tags: Optional[List[str]] = None) -> Any:
        """agl's LangChain callback handler (the one ``agl.instrument()`` adds to every callback manager, so
        passing it in ``callbacks=[...]`` records nothing twice)."""
        return get_tracer().get_langchain_handler()

    get_langchain_callback_handler = get_langchain_handler


def _active_tracer_restored(previous: Optional[Tracer]) -> None:
    global _active_tracer
    _active_tracer = previous


def _end_own_rollout(
    store: LightningStore,
    rollout_id: str,
    attempt_id: str,
    scope: Optional[RolloutScope],
    error: Optional[BaseException],
) -> None:
    """End the rollout a trace without ids started: succeeded with the last episode reward emitted, or failed."""
    if error is not None:
        store.complete_attempt(rollout_id, attempt_id, "failed", error=f"{type(error).__name__}: {error}")
        return
    reward = scope.episode_rewards[-1] if scope is not None and scope.episode_rewards else None
    store.complete_attempt(rollout_id, attempt_id, "succeeded", reward=reward)


class OtelTracer(Tracer):
    """Agent Lightning's OpenTelemetry tracer: agl's tracer records the spans (no SDK provider is installed)."""


class AgentOpsTracer(OtelTracer):
    """Agent Lightning's default tracer. agl does not use AgentOps: it records with its own instrumentation
    (``agl.instrument()``), which ``init_worker`` applies unless ``instrument_managed=False``."""

    def __init__(self, *, agentops_managed: bool = True, instrument_managed: bool = True, daemon: bool = True) -> None:
        super().__init__()
        self.agentops_managed = agentops_managed
        self.instrument_managed = instrument_managed
        self.daemon = daemon
        self.instruments = instrument_managed
        _say_once(
            "agentops",
            "AgentOpsTracer: agl records with its own instrumentation (agl.instrument(): the OpenAI client and "
            "every installed framework), not AgentOps; nothing is sent to AgentOps",
        )


class DummyTracer(Tracer):
    """Agent Lightning's tracer that records nothing of its own: it instruments nothing (agl's runner still
    records the rollout and its reward, and whatever the process has instrumented)."""

    instruments = False


class WeaveTracer(Tracer):
    """Agent Lightning's experimental Weave tracer: agl does not record through Weave."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "WeaveTracer is not available in agl: agl records with its own tracer and instrumentation, not Weave; "
            "use agl.OtelTracer() (or no tracer at all)"
        )
