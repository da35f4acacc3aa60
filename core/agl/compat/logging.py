"""Agent Lightning's ``setup_logging``: one console handler for agl's loggers and the ones named in ``apply_to``.

Agent Lightning scripts call ``setup_logging()`` (often several times: once per entry point) before anything
else; here it configures the ``agl`` logger hierarchy the same way. It is idempotent: a second call changes
the level and format of the handler the first one attached instead of adding another, so no line is ever
printed twice. Other libraries' loggers and the root logger are left alone unless named in ``apply_to``.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Dict, List, Mapping, Optional, Union

from agl.compat.env_var import LightningEnvVar, resolve_bool_env_var

BASE = "agl"
FORMAT = "%(asctime)s [%(levelname)s] (Process-%(process)d %(name)s)   %(message)s"
DATE_FORMAT = "%H:%M:%S"

Level = Union[int, str]
_OWN = "_agl_setup_logging"  # marks the handlers setup_logging attached, so a later call finds them


def level_value(level: Level) -> int:
    """``level`` as a number: ``logging.DEBUG``, ``"debug"`` and ``"DEBUG"`` alike."""
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return value


def _console_handler(color: Union[bool, Dict[str, Any]]) -> logging.Handler:
    if color:
        from rich.logging import RichHandler

        return RichHandler(**(color if isinstance(color, dict) else {}))
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    return handler


def _own_handler(logger: logging.Logger, handler: Optional[logging.Handler], level: int) -> None:
    """Replace the handler an earlier call attached to ``logger`` by ``handler`` (None: remove it)."""
    for old in [h for h in logger.handlers if getattr(h, _OWN, False)]:
        logger.removeHandler(old)
        old.close()
    if handler is not None:
        setattr(handler, _OWN, True)
        handler.setLevel(level)
        logger.addHandler(handler)


def setup_module_logging(
    level: Level = "INFO",
    *,
    name: str = BASE,
    console: bool = True,
    color: Union[bool, Dict[str, Any]] = True,
    propagate: bool = False,
    disable_existing_loggers: bool = False,
) -> logging.Logger:
    """Configure the one logger ``name`` (its level, one console handler, propagation) and return it."""
    if disable_existing_loggers:
        for existing in list(logging.Logger.manager.loggerDict.values()):
            if isinstance(existing, logging.Logger) and not (existing.name + ".").startswith(name + "."):
                existing.disabled = True
    value = level_value(level)
    logger = logging.getLogger(name)
    logger.setLevel(value)
    logger.propagate = propagate
    logger.disabled = False
    _own_handler(logger, _console_handler(color) if console else None, value)
    return logger


def _add_file(logger: logging.Logger, filename: str, formatter: Optional[logging.Formatter]) -> None:
    """A file handler for ``filename`` on ``logger``, unless it already has one."""
    path = os.path.abspath(filename)
    if any(getattr(h, "baseFilename", None) == path for h in logger.handlers):
        return
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logger.getEffectiveLevel())
    handler.setFormatter(formatter or logging.Formatter(FORMAT, DATE_FORMAT))
    logger.addHandler(handler)


def setup_logging(
    level: Level = "INFO",
    *,
    console: bool = True,
    color: Union[bool, Dict[str, Any]] = True,
    propagate: bool = False,
    disable_existing_loggers: bool = False,
    capture_warnings: bool = False,
    submodule_levels: Optional[Mapping[str, Level]] = None,
    extra_handlers: Optional[List[logging.Handler]] = None,
    formatter: Optional[logging.Formatter] = None,
    apply_to: Optional[List[str]] = None,
    files: Union[str, Mapping[str, str], None] = None,
) -> None:
    """Configure logging for agl (the ``agl`` loggers) and the loggers named in ``apply_to``, which get the
    same handlers and level and stop propagating (so nothing is printed twice). ``submodule_levels`` sets
    the level of single loggers (``{"agl.proxy": "DEBUG"}``), ``files`` adds a log file for agl (a path) or
    per logger (``{name: path}``), ``extra_handlers`` are added once, ``formatter`` is given to handlers
    that have none. Calling it again reconfigures; it never adds a second console handler."""
    base = setup_module_logging(
        level,
        console=console,
        color=color,
        propagate=propagate,
        disable_existing_loggers=disable_existing_loggers,
    )
    if formatter is not None:
        for handler in base.handlers:
            if handler.formatter is None:
                handler.setFormatter(formatter)
    for handler in extra_handlers or []:
        if handler not in base.handlers:
            base.addHandler(handler)
    if resolve_bool_env_var(LightningEnvVar.AGL_EMITTER_DEBUG, fallback=False):
        logging.getLogger("agl.tracing.emitters").setLevel(logging.DEBUG)
    for name, sub_level in (submodule_levels or {}).items():
        logging.getLogger(name).setLevel(level_value(sub_level))
    if isinstance(files, str):
        _add_file(base, files, formatter)
    else:
        for name, filename in (files or {}).items():
            _add_file(logging.getLogger(name), filename, formatter)
    for name in apply_to or []:
        logger = logging.getLogger(name)
        logger.handlers = list(base.handlers)
        logger.setLevel(base.level)
        logger.propagate = False
    if capture_warnings:
        logging.captureWarnings(True)


def configure_logger(level: int = logging.INFO, name: str = BASE) -> logging.Logger:
    """Agent Lightning's deprecated ``configure_logger``: :func:`setup_module_logging` for ``name``."""
    warnings.warn("configure_logger is deprecated: use agl.setup_logging()", DeprecationWarning, stacklevel=2)
    return setup_module_logging(level, name=name, propagate=False)


__all__ = ["configure_logger", "setup_logging", "setup_module_logging"]
