"""Third-party adapters: a package that registers an ``Instrumentor`` under the entry-point group
``agl.integrations`` is hooked by ``agl.instrument()`` and unhooked by ``agl.uninstrument()``; one that is
not installed, or whose import fails, is skipped without stopping the others (a real ``.dist-info`` on
``sys.path``, found by ``importlib.metadata`` as an installed package would be)."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

import agl
from agl.instrumentation import ENTRY_POINT_GROUP, _instances, available_integrations

PLUGIN = textwrap.dedent(
    """
    from agl.instrumentation.base import Instrumentor

    calls = []

    class DemoInstrumentor(Instrumentor):
        name = "demo"

        def _instrument(self, **kwargs):
            calls.append("instrument")

        def _uninstrument(self):
            calls.append("uninstrument")
    """
)
NAMES = ("agl_demo_plugin", "agl_missing_plugin", "agl_broken_plugin")


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "agl_demo_plugin.py").write_text(PLUGIN)
    (tmp_path / "agl_broken_plugin.py").write_text("raise RuntimeError('this adapter has a bug')\n")
    dist = tmp_path / "agl_demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: agl-demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "demo = agl_demo_plugin:DemoInstrumentor\n"
        "missing = agl_missing_plugin:Nothing\n"  # its package is not installed
        "broken = agl_broken_plugin:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    agl.uninstrument()
    for name in ("demo", "missing", "broken"):
        _instances.pop(name, None)
    for module in NAMES:
        sys.modules.pop(module, None)


def test_a_registered_third_party_adapter_is_hooked_and_broken_ones_are_skipped(plugins: Path, caplog) -> None:
    assert {"demo", "missing", "broken"} <= set(available_integrations())
    with caplog.at_level(logging.DEBUG, logger="agl.instrumentation"):
        hooked = agl.instrument()
        assert agl.instrument() == hooked  # idempotent
    assert "openai" in hooked and "demo" in hooked and not {"missing", "broken"} & set(hooked)
    calls = sys.modules["agl_demo_plugin"].calls
    assert calls == ["instrument"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("broken could not be loaded and is skipped" in m and "this adapter has a bug" in m for m in warnings)
    assert any("missing is not importable" in m for m in debug)
    assert not any("missing" in m for m in warnings)  # not installed: nothing worth a warning
    agl.uninstrument()
    assert calls == ["instrument", "uninstrument"]


def test_instrumenting_an_unknown_framework_names_the_known_ones(plugins: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown framework 'nope': agl has adapters for \[.*'demo'"):
        agl.instrument(["nope"])
    assert agl.instrument(["demo"])[-1] == "demo"
