"""Agent Lightning's metrics backends (``agl.utils.metrics``): console summaries, fan-out, Prometheus, bad labels."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.request
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest

from agl.utils.metrics import (
    ConsoleMetricsBackend,
    MetricsBackend,
    MultiMetricsBackend,
    PrometheusMetricsBackend,
    get_prometheus_registry,
)


@pytest.fixture
def summaries(caplog: pytest.LogCaptureFixture, monkeypatch) -> Iterator[pytest.LogCaptureFixture]:
    """The metrics logger's lines, each once, captured even when setup_logging() stopped agl's propagating."""
    metrics_logger = logging.getLogger("agl.compat.metrics")
    monkeypatch.setattr(metrics_logger, "propagate", False)
    metrics_logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="agl.compat.metrics"):
        yield caplog
    metrics_logger.removeHandler(caplog.handler)


def register(backend: MetricsBackend) -> None:
    backend.register_counter("requests_total", ["operation", "status"])
    backend.register_histogram("latency_seconds", ["operation"], buckets=[0.1, 0.5, 1.0])


REQUESTS = (("search", "200"), ("search", "200"), ("search", "500"), ("answer", "200"), ("search", "200"))
LATENCIES = (("search", 0.1), ("search", 0.4), ("search", 0.2), ("search", 0.3), ("answer", 0.9))


async def emit(backend: MetricsBackend) -> None:
    for operation, status in REQUESTS:
        await backend.inc_counter("requests_total", labels={"operation": operation, "status": status})
    for operation, value in LATENCIES:
        await backend.observe_histogram("latency_seconds", value=value, labels={"operation": operation})


def summary_after(caplog: pytest.LogCaptureFixture, lines_before: int) -> List[str]:
    """The lines logged since ``lines_before`` records: with no log interval, the summary the last event made."""
    return [record.getMessage() for record in caplog.records[lines_before:]]


async def test_console_summary_counts_and_quantiles_per_label_group(summaries):
    backend = ConsoleMetricsBackend(window_seconds=None, log_interval_seconds=0.0, group_level=1)
    register(backend)
    await emit(backend)
    before = len(summaries.records)
    await backend.inc_counter("requests_total", amount=2.5, labels={"operation": "answer", "status": "404"})
    lines = summary_after(summaries, before)
    assert lines[0].startswith("latency_seconds{operation=answer} count=1 p50=0.9 p95=0.9 p99=0.9 max=0.9")
    assert lines[1].startswith("latency_seconds{operation=search} count=4 p50=0.2 p95=0.4 p99=0.4 max=0.4")
    assert lines[2].startswith("requests_total{operation=answer} count=2 total=3.5 rate=")
    assert lines[3].startswith("requests_total{operation=search} count=4 total=4 rate=")
    assert len(lines) == 4


async def test_console_group_level_none_merges_labels_and_a_metric_level_applies_when_the_backend_has_none(summaries):
    backend = ConsoleMetricsBackend(window_seconds=None, log_interval_seconds=0.0)
    backend.register_counter("requests_total", ["operation", "status"], group_level=2)
    backend.register_histogram("latency_seconds", ["operation"])
    await emit(backend)
    before = len(summaries.records)
    await backend.observe_histogram("latency_seconds", 0.5, labels={"operation": "answer"})
    lines = summary_after(summaries, before)
    assert lines[0].startswith("latency_seconds count=6 p50=0.3 ")
    assert [line.split(" rate=")[0] for line in lines[1:]] == [
        "requests_total{operation=answer,status=200} count=1 total=1",
        "requests_total{operation=search,status=200} count=3 total=3",
        "requests_total{operation=search,status=500} count=1 total=1",
    ]


async def test_console_logs_at_most_once_per_interval_and_forgets_events_outside_the_window(summaries):
    spaced = ConsoleMetricsBackend(window_seconds=None, log_interval_seconds=3600.0)
    spaced.register_counter("ticks")
    for _ in range(5):
        await spaced.inc_counter("ticks")
    assert [r.getMessage().split(" rate=")[0] for r in summaries.records] == ["ticks count=1 total=1"]

    windowed = ConsoleMetricsBackend(window_seconds=0.0, log_interval_seconds=0.0)
    windowed.register_counter("ticks")
    for _ in range(3):
        await windowed.inc_counter("ticks")
        time.sleep(0.002)  # the next event is later than this one: a zero window holds only the newest
    assert summaries.records[-1].getMessage().startswith("ticks count=1 total=1 ")


class ListBackend(MetricsBackend):
    """A backend written by the caller, overriding the public methods only (as Agent Lightning code does)."""

    def __init__(self) -> None:
        self.seen: List[Tuple[str, str, float, Optional[dict]]] = []

    def register_counter(self, name: str, label_names: Optional[Sequence[str]] = None, group_level=None) -> None:
        self.seen.append(("register_counter", name, 0.0, {"labels": list(label_names or ())}))

    def register_histogram(self, name, label_names=None, buckets=None, group_level=None) -> None:
        self.seen.append(("register_histogram", name, 0.0, {"buckets": list(buckets or ())}))

    async def inc_counter(self, name, amount=1.0, labels=None) -> None:
        self.seen.append(("inc_counter", name, amount, labels))

    async def observe_histogram(self, name, value, labels=None) -> None:
        self.seen.append(("observe_histogram", name, value, labels))


async def test_multi_backend_sends_everything_to_each_backend(summaries):
    console, own = ConsoleMetricsBackend(window_seconds=None, log_interval_seconds=0.0, group_level=1), ListBackend()
    backend = MultiMetricsBackend([console, own])
    register(backend)
    await emit(backend)
    assert not backend.has_prometheus()
    assert own.seen[:2] == [
        ("register_counter", "requests_total", 0.0, {"labels": ["operation", "status"]}),
        ("register_histogram", "latency_seconds", 0.0, {"buckets": [0.1, 0.5, 1.0]}),
    ]
    assert sum(amount for kind, _, amount, _ in own.seen if kind == "inc_counter") == len(REQUESTS)
    assert [value for kind, _, value, _ in own.seen if kind == "observe_histogram"] == [v for _, v in LATENCIES]
    messages = [r.getMessage() for r in summaries.records]
    assert any(m.startswith("requests_total{operation=search} count=4 total=4 ") for m in messages)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda b: b.inc_counter("missing"), "counter 'missing' is not registered: call register_counter("),
        (lambda b: b.observe_histogram("requests_total", 1.0), "histogram 'requests_total' is not registered"),
        (
            lambda b: b.inc_counter("requests_total", labels={"operation": "search"}),
            "counter 'requests_total' takes labels ['operation', 'status'], got ['operation']",
        ),
        (
            lambda b: b.observe_histogram("latency_seconds", 1.0, labels={"operation": "a", "path": "/"}),
            "histogram 'latency_seconds' takes labels ['operation'], got ['operation', 'path']",
        ),
    ],
)
async def test_unknown_metrics_and_wrong_labels_say_what_to_pass_in_one_line(call, message):
    for backend in (ConsoleMetricsBackend(), MultiMetricsBackend([ConsoleMetricsBackend()])):
        register(backend)
        with pytest.raises(ValueError) as raised:
            await call(backend)
        assert message in str(raised.value) and "\n" not in str(raised.value)


def test_registering_a_name_again_differently_or_no_backend_is_a_one_line_error():
    backend = ConsoleMetricsBackend()
    register(backend)
    register(backend)  # the same again: nothing happens
    with pytest.raises(ValueError, match=r"'requests_total' is already registered as a counter with labels \["):
        backend.register_histogram("requests_total", ["operation", "status"])
    with pytest.raises(ValueError, match=r"already registered as a histogram .* and buckets \[0.1, 0.5, 1.0\]"):
        backend.register_histogram("latency_seconds", ["operation"], buckets=[1.0])
    with pytest.raises(ValueError, match="needs at least one backend"):
        MultiMetricsBackend([])


def test_without_prometheus_client_the_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what an environment without it imports
    for construct in (PrometheusMetricsBackend, get_prometheus_registry):
        with pytest.raises(ImportError) as raised:
            construct()
        assert "`pip install prometheus_client`" in str(raised.value) and "\n" not in str(raised.value)


# prometheus_client is not an agl dependency: these run where it is installed (.venv-peer, docs/agent-lightning.md).
async def test_prometheus_backend_counts_into_its_registry_served_over_http():
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    backend = MultiMetricsBackend([ConsoleMetricsBackend(), PrometheusMetricsBackend(registry=registry)])
    assert backend.has_prometheus()
    register(backend)
    backend.register_counter("agl.dotted")
    await emit(backend)
    await backend.inc_counter("agl.dotted", amount=2.0)
    value = registry.get_sample_value
    assert value("requests_total", {"operation": "search", "status": "200"}) == 3
    assert value("requests_total", {"operation": "search", "status": "500"}) == 1
    assert value("agl_dotted_total") == 2
    assert value("latency_seconds_count", {"operation": "search"}) == 4
    assert value("latency_seconds_bucket", {"operation": "search", "le": "0.1"}) == 1
    assert value("latency_seconds_bucket", {"operation": "search", "le": "0.5"}) == 4
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            page = response.read().decode()
    finally:
        server.shutdown()
        thread.join()
    assert 'requests_total{operation="answer",status="200"} 1.0' in page


async def test_two_prometheus_backends_on_one_registry_get_a_one_line_error():
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    register(PrometheusMetricsBackend(registry=registry))
    second = PrometheusMetricsBackend(registry=registry)
    with pytest.raises(ValueError) as raised:
        register(second)
    assert "give each PrometheusMetricsBackend its own registry=" in str(raised.value)
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="counter 'requests_total' is not registered"):  # the refusal kept nothing
        await second.inc_counter("requests_total")


MULTIPROCESS_SCRIPT = """
import asyncio, os, sys
from agl.utils.metrics import (
    PrometheusMetricsBackend, get_prometheus_registry, setup_multiprocess_prometheus, shutdown_metrics,
)
setup_multiprocess_prometheus()  # before prometheus_client is imported: it picks its value class then
folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
for amount in (2, 3):
    pid = os.fork()
    if pid == 0:  # a worker: count, then leave as a normal exit does (running the inherited exit hooks)
        backend = PrometheusMetricsBackend()
        backend.register_counter("jobs_total", ["worker"])
        asyncio.run(backend.inc_counter("jobs_total", amount=amount, labels={"worker": "w"}))
        sys.exit(0)
    os.waitpid(pid, 0)
    shutdown_metrics(None, type("Worker", (), {"pid": pid})())
print(os.path.isdir(folder), get_prometheus_registry().get_sample_value("jobs_total", {"worker": "w"}), folder)
"""


def test_multiprocess_prometheus_collects_every_worker_and_its_folder_outlives_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    run = subprocess.run([sys.executable, "-c", MULTIPROCESS_SCRIPT], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    alive, total, folder = run.stdout.split()
    assert (alive, total) == ("True", "5.0")  # the workers' exits left the folder to the process that made it
    assert not os.path.exists(folder)  # which removed it when it ended
