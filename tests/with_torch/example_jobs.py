"""The CPU jobs of examples/ (main_job, multi_turn) as modules for their tests: each job's folder goes on
sys.path while its train.py is in use, as when it runs as a script."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterator

import agl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(folder: str, name: str) -> Any:
    """``examples/<folder>/<name>.py`` as a module of its own."""
    path = EXAMPLES / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def job_module(folder: str) -> Iterator[Any]:
    """The job's train.py, with its folder on sys.path; unhooks what the job instrumented after."""
    where = str(EXAMPLES / folder)
    sys.path.insert(0, where)
    try:
        yield load(folder, "train")
    finally:
        sys.path.remove(where)
        agl.uninstrument()
