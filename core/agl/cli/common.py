"""What the ``agl`` commands share: loading an agent and its tasks, reading settings, argparse types, and
opening (and closing) the store a command looks at."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit

from agl.runtime.litagent import LitAgent, as_agent

STORE_HELP = (
    "store location: a .db file, sqlite:///path, memory, postgresql://... or a store server's "
    "http://HOST:PORT (default: $AGL_STORE or .agl/store.db)"
)


FINISHED = ["succeeded", "failed", "cancelled"]


UNFINISHED = ["queued", "running"]


def load_agent(target: str) -> LitAgent[Any]:
    """``path/to/file.py:name`` or ``package.module:name`` -> a LitAgent.

    The object may be a LitAgent instance, a LitAgent subclass (built with no arguments) or a plain
    rollout function (wrapped with ``@agl.rollout``).
    """
    module_part, sep, attr = target.partition(":")
    if not sep or not attr:
        raise SystemExit(f"agl: agent {target!r} must look like MODULE:NAME or path/to/file.py:NAME")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.exists():
            raise SystemExit(f"agl: file {path} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        sys.path.insert(0, str(path.parent.resolve()))
        spec.loader.exec_module(module)
    else:
        module = _import_module(module_part, target)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        where = getattr(module, "__file__", None)
        raise SystemExit(
            f"agl: {module_part}{f' ({where})' if where else ''} has no attribute {attr!r}: pass MODULE:NAME with the "
            "name of a LitAgent or rollout function defined in it"
        ) from None
    try:
        return as_agent(obj)
    except TypeError as exc:  # not an agent, or a function taking arguments agl cannot supply
        raise SystemExit(f"agl: {target}: {exc}") from None


def _import_module(name: str, target: str) -> Any:
    """``import name`` with the current folder on ``sys.path`` first, as ``python -m`` has it (the ``agl`` script
    has its own folder there instead), so that ``agl dev my_agent:agent`` finds ./my_agent.py. A module that
    cannot be found is one line saying what was tried; an error inside a module that was found is its own."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise  # the module was found, and one it imports is missing: its own traceback says which
        path = Path(*name.split(".")).with_suffix(".py")
        raise SystemExit(
            f"agl: cannot import module {name!r} for {target!r}: no module named {exc.name!r} in the current folder "
            f"({cwd}) or on sys.path (PYTHONPATH, installed packages); pass MODULE:NAME for an importable module, "
            f"or path/to/file.py:NAME for a file (e.g. {path}:{target.partition(':')[2]})"
        ) from None


def load_tasks(path: str) -> List[Any]:
    """A dataset file's tasks, or a clean exit saying what is wrong with the file."""
    from agl.runtime.dataset import load_dataset

    try:
        tasks = load_dataset(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"agl: cannot read tasks from {path}: {exc}") from None
    if not tasks:
        raise SystemExit(f"agl: {path} holds no tasks")
    return tasks


def json_setting(value: str, flag: str, *, yaml_ok: bool = False) -> Dict[str, Any]:
    """A JSON object given inline or as ``@file`` (``.yaml``/``.yml`` files too when ``yaml_ok``)."""
    try:
        data = _read_setting(value, yaml_ok)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"agl: cannot read {flag} {value!r}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"agl: {flag} must be a JSON object of settings, got {value!r}")
    return data


def prompt_setting(value: str, flag: str = "--prompt") -> str:
    """A prompt given inline or as ``@FILE``."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise SystemExit(f"agl: cannot read {flag} {value!r}: {exc}") from None


def _read_setting(value: str, yaml_ok: bool) -> Any:
    if not value.startswith("@"):
        return json.loads(value)
    path = Path(value[1:])
    if yaml_ok and path.suffix in (".yaml", ".yml"):
        import yaml  # the verl extra brings it (omegaconf needs it)

        try:
            return yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(str(exc)) from None
    return json.loads(path.read_text())


def positive_int(value: str) -> int:
    """An argparse type: an int of at least 1 (argparse says what is wrong, with the usage line)."""
    number = int(value)  # a ValueError reads "invalid positive_int value: 'x'"
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def non_negative_int(value: str) -> int:
    """An argparse type: an int of at least 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def store_argument(store: str) -> str:
    """A store address for a command line agl prints as a hint: without a database password (the output goes
    to terminals, CI and Job logs; libpq then takes it from PGPASSWORD or ~/.pgpass), quoted for the shell."""
    return shlex.quote(shown_store(store))


OPENED_STORES: List[Any] = []  # closed by main() when the command ends


def existing_store(target: Optional[str]) -> Any:
    """The store a reading command looks at: never a new, empty SQLite file made by a mistyped path. main()
    closes it when the command ends: a SQLite store's last connection then folds its write-ahead log into the
    file and deletes it (left open, `agl store prune` left a log as large as what it deleted beside the file)."""
    from agl.errors import StoreNotFoundError
    from agl.store import open_store

    try:
        store = open_store(target, create=False)
    except StoreNotFoundError as exc:
        raise SystemExit(f"agl: {exc}") from None
    OPENED_STORES.append(store)
    return store


def close_opened_stores() -> None:
    while OPENED_STORES:
        store = OPENED_STORES.pop()
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - the command's own result stands
            logging.getLogger("agl").warning("could not close the store %r: %s", store, exc)


def shown_store(url: str) -> str:
    """``url`` as log lines and messages show it: a PostgreSQL URL or key=value string through the store's
    own ``redacted`` (no password), any other URL without the user and password it may carry. The runner's
    logs go to Job logs and log collectors; the password must not."""
    parts = urlsplit(url)
    if parts.scheme in ("postgresql", "postgres") or (not parts.scheme and "=" in url):
        try:
            from agl.store.postgres.store import redacted
        except ImportError:  # no psycopg (then nothing was sent anywhere), but still show no password
            return "<a PostgreSQL URL>"
        return redacted(url)
    if "@" in parts.netloc:
        return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return url
