"""Agent Lightning's metrics backends (``agentlightning.utils.metrics``), written for agl.

Register metrics on a backend, then ``await backend.inc_counter(...)``. The console backend logs a summary per
metric and label group over a sliding window; the Prometheus backend feeds ``prometheus_client`` (not an agl
dependency). agl's own training metrics go to the run folder instead.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger("agl.compat.metrics")
Labels = Mapping[str, Any]


@dataclass(frozen=True)
class _Metric:
    """A registered metric: what :meth:`MetricsBackend.register_counter` or ``register_histogram`` was given."""

    kind: str  # "counter" or "histogram"
    name: str
    label_names: Tuple[str, ...]
    buckets: Tuple[float, ...] = ()
    group_level: Optional[int] = field(default=None, compare=False)  # a display setting: may differ

    def label_values(self, labels: Optional[Labels]) -> Tuple[str, ...]:
        """The label values in registration order; a one-line error unless ``labels`` has exactly the names."""
        given = dict(labels or {})
        if set(given) != set(self.label_names):
            names = list(self.label_names)
            raise ValueError(f"{self.kind} {self.name!r} takes labels {names}, got {sorted(given)}: pass exactly those")
        return tuple(str(given[name]) for name in self.label_names)


class MetricsBackend:
    """Where metrics go: register each one first, then record it. Subclasses implement the four methods."""

    def __init__(self) -> None:
        self._metrics: Dict[str, _Metric] = {}

    def has_prometheus(self) -> bool:
        """Whether the metrics reach Prometheus (so a caller knows to serve ``/metrics``)."""
        return False

    def register_counter(
        self, name: str, label_names: Optional[Sequence[str]] = None, group_level: Optional[int] = None
    ) -> None:
        """Register a counter; registering it again the same way does nothing."""
        self._register(_Metric("counter", name, tuple(label_names or ()), (), group_level))

    def register_histogram(
        self,
        name: str,
        label_names: Optional[Sequence[str]] = None,
        buckets: Optional[Sequence[float]] = None,
        group_level: Optional[int] = None,
    ) -> None:
        """Register a histogram (``buckets`` are upper bounds; the backend's defaults when None)."""
        self._register(_Metric("histogram", name, tuple(label_names or ()), tuple(buckets or ()), group_level))

    async def inc_counter(self, name: str, amount: float = 1.0, labels: Optional[Labels] = None) -> None:
        """Add ``amount`` to a registered counter."""
        self._record(*self._resolve("counter", name, labels), amount)

    async def observe_histogram(self, name: str, value: float, labels: Optional[Labels] = None) -> None:
        """Record one observation of a registered histogram."""
        self._record(*self._resolve("histogram", name, labels), value)

    def _register(self, metric: _Metric) -> None:
        known = self._metrics.setdefault(metric.name, metric)  # the first registration stays
        if known != metric:
            buckets = f" and buckets {list(known.buckets)}" if known.buckets else ""
            raise ValueError(
                f"metric {metric.name!r} is already registered as a {known.kind} with labels "
                f"{list(known.label_names)}{buckets}: register each name once, the same way each time"
            )

    def _resolve(self, kind: str, name: str, labels: Optional[Labels]) -> Tuple[_Metric, Tuple[str, ...]]:
        metric = self._metrics.get(name)
        if metric is None or metric.kind != kind:
            raise ValueError(f"{kind} {name!r} is not registered: call register_{kind}({name!r}, label_names) first")
        return metric, metric.label_values(labels)

    def _record(self, metric: _Metric, values: Tuple[str, ...], amount: float) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _record (or the async methods)")


class ConsoleMetricsBackend(MetricsBackend):
    """Keeps each metric's events of the last ``window_seconds`` and, at most every ``log_interval_seconds``,
    logs one line per metric and label group (its first ``group_level`` labels; all merged when None or < 1)."""

    def __init__(
        self,
        window_seconds: Optional[float] = 60.0,
        log_interval_seconds: float = 10.0,
        group_level: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.window_seconds = window_seconds
        self.log_interval_seconds = log_interval_seconds
        self.group_level = group_level
        self._events: Dict[Tuple[str, Tuple[str, ...]], Deque[Tuple[float, float]]] = defaultdict(deque)
        self._last_log: Optional[float] = None
        self._lock = threading.Lock()  # held briefly: callers may record from several threads or event loops

    def _record(self, metric: _Metric, values: Tuple[str, ...], amount: float) -> None:
        now = time.monotonic()
        lines: List[str] = []
        with self._lock:
            self._events[(metric.name, values)].append((now, amount))
            if self._last_log is None or now - self._last_log >= self.log_interval_seconds:
                self._last_log, lines = now, self._summary(now)
        for line in lines:
            logger.info("%s", line)

    def _summary(self, now: float) -> List[str]:
        """One line per metric and label group over the window (lock held); old events are dropped here."""
        groups: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], List[Tuple[float, float]]] = defaultdict(list)
        for (name, values), events in self._events.items():
            while events and self.window_seconds is not None and events[0][0] < now - self.window_seconds:
                events.popleft()
            level = self.group_level if self.group_level is not None else self._metrics[name].group_level
            kept = tuple(zip(self._metrics[name].label_names, values))[: max(level or 0, 0)]
            groups[(name, kept)].extend(events)
        return [self._line(name, kept, events, now) for (name, kept), events in sorted(groups.items()) if events]

    def _line(self, name: str, kept: Tuple[Tuple[str, str], ...], events: List[Tuple[float, float]], now: float) -> str:
        """The counter's count, total and rate (per second since its oldest event), or the histogram's quantiles."""
        labels = "{" + ",".join(f"{k}={v}" for k, v in kept) + "}" if kept else ""
        amounts = [amount for _, amount in events]
        if self._metrics[name].kind == "counter":
            total, seconds = sum(amounts), max(now - min(t for t, _ in events), self.log_interval_seconds, 1e-3)
            return f"{name}{labels} count={len(amounts)} total={total:g} rate={total / seconds:.2f}/s"
        ordered = sorted(amounts)
        p50, p95, p99 = (ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)] for p in (50, 95, 99))
        return f"{name}{labels} count={len(ordered)} p50={p50:.4g} p95={p95:.4g} p99={p99:.4g} max={ordered[-1]:.4g}"


def _prometheus(what: str) -> Any:
    """The ``prometheus_client`` module, or a one-line error saying how to install it."""
    try:
        import prometheus_client.multiprocess  # binds prometheus_client; its multiprocess mode is used below
    except ImportError:
        message = f"{what} needs prometheus_client, which agl does not install: `pip install prometheus_client`"
        raise ImportError(message, name="prometheus_client") from None
    return prometheus_client


class PrometheusMetricsBackend(MetricsBackend):
    """Forwards each metric to a ``prometheus_client`` Counter or Histogram in ``registry`` (None: the default one,
    which ``start_http_server`` serves); characters Prometheus disallows become ``_`` (``a.b`` -> ``a_b``)."""

    def __init__(self, registry: Any = None) -> None:
        super().__init__()
        self._client = _prometheus("PrometheusMetricsBackend")
        self._registry = registry if registry is not None else self._client.REGISTRY
        self._objects: Dict[str, Any] = {}

    def has_prometheus(self) -> bool:
        return True

    def _register(self, metric: _Metric) -> None:
        if metric.name not in self._metrics:  # new: make its Prometheus object first, so a refusal registers nothing
            exported = re.sub(r"[^a-zA-Z0-9_:]", "_", metric.name)
            kind = self._client.Counter if metric.kind == "counter" else self._client.Histogram
            options = {"buckets": metric.buckets} if metric.buckets else {}
            try:
                self._objects[metric.name] = kind(
                    exported, f"{metric.kind} {metric.name}", metric.label_names, registry=self._registry, **options
                )
            except ValueError as error:  # mostly: the name is in the registry already (or two names map to one)
                hint = "give each PrometheusMetricsBackend its own registry=, or register the metric once"
                raise ValueError(f"prometheus_client refused {metric.kind} {metric.name!r} ({error}): {hint}") from None
        super()._register(metric)

    def _record(self, metric: _Metric, values: Tuple[str, ...], amount: float) -> None:
        target = self._objects[metric.name].labels(*values) if values else self._objects[metric.name]
        getattr(target, "inc" if metric.kind == "counter" else "observe")(amount)


class MultiMetricsBackend(MetricsBackend):
    """Sends every registration and event to each of ``backends`` in turn."""

    def __init__(self, backends: Sequence[MetricsBackend]) -> None:
        super().__init__()
        if not backends:
            raise ValueError("MultiMetricsBackend needs at least one backend, e.g. [ConsoleMetricsBackend()]")
        self.backends = list(backends)

    def has_prometheus(self) -> bool:
        return any(backend.has_prometheus() for backend in self.backends)

    def _register(self, metric: _Metric) -> None:
        for backend in self.backends:  # through the public methods: a backend may be the caller's own subclass
            if metric.kind == "counter":
                backend.register_counter(metric.name, metric.label_names, metric.group_level)
            else:
                backend.register_histogram(metric.name, metric.label_names, metric.buckets or None, metric.group_level)

    async def inc_counter(self, name: str, amount: float = 1.0, labels: Optional[Labels] = None) -> None:
        for backend in self.backends:
            await backend.inc_counter(name, amount=amount, labels=labels)

    async def observe_histogram(self, name: str, value: float, labels: Optional[Labels] = None) -> None:
        for backend in self.backends:
            await backend.observe_histogram(name, value=value, labels=labels)


def setup_multiprocess_prometheus() -> None:
    """Point ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder (unless set) before workers start, to collect them all."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        logger.warning("PROMETHEUS_MULTIPROC_DIR is set already: empty that folder between runs")
        return
    folder, owner = tempfile.mkdtemp(prefix="agl-prometheus-"), os.getpid()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder

    def remove() -> None:  # forked workers inherit this exit hook: only the process that made the folder acts
        if os.getpid() == owner:
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)


def get_prometheus_registry() -> Any:
    """The registry to serve: one collecting every process's files in multiprocess mode, else the default."""
    client = _prometheus("get_prometheus_registry")
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None:
        return client.REGISTRY
    client.multiprocess.MultiProcessCollector(registry := client.CollectorRegistry())
    return registry


def shutdown_metrics(server: Any = None, worker: Any = None, *args: Any, **kwargs: Any) -> None:
    """Mark a finished process (``worker.pid``, else this one) dead for Prometheus; fits gunicorn's child_exit."""
    if folder := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _prometheus("shutdown_metrics").multiprocess.mark_process_dead(getattr(worker, "pid", os.getpid()), folder)
