"""Test sessions, each in its own virtualenv: `nox -l` lists them, `nox -s NAME` runs one.

- ``tests``: the core suite (what `.ci/run` runs, in the README's venv).
- ``benchmarks``: prints the speed figures of benchmarks/ (figures, not pass/fail).
Framework sessions (one per framework and version: oldest supported and latest) are added with the
framework adapters; CrewAI and the OpenAI Agents SDK need separate venvs (openai<3 vs openai>=3).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python=PYTHON)
def benchmarks(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    for script in ("benchmarks/store.py", "benchmarks/tracer_overhead.py", "benchmarks/dev_latency.py"):
        session.run("python", script)
