"""Agent Lightning's environment variables and their resolvers (``agentlightning.env_var``).

What each variable does in agl:

- ``AGL_EMITTER_DEBUG``: true puts agl's emitter logger (``agl.tracing.emitters``) at DEBUG when
  ``setup_logging()`` runs.
- ``AGL_CURRENT_ROLE``, ``AGL_SERVER_HOST``, ``AGL_SERVER_PORT``: no effect. agl's Trainer has no roles: run
  the algorithm side with ``agl.Trainer(n_runners=0, store=...)`` and the runners anywhere with
  ``agl runner --store URL`` (docs/agent-lightning.md).
- ``AGL_MANAGED_STORE``: no effect. Agent Lightning wraps the store in a server or a lock unless it is 0; agl's
  stores are thread- and process-safe as they are, so there is nothing to wrap.

The resolvers read any of them as Agent Lightning's do, for code that reads them itself.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class LightningEnvVar(Enum):
    """Agent Lightning's environment variables (see the module docstring for what each does in agl)."""

    AGL_EMITTER_DEBUG = "AGL_EMITTER_DEBUG"
    AGL_MANAGED_STORE = "AGL_MANAGED_STORE"
    AGL_CURRENT_ROLE = "AGL_CURRENT_ROLE"
    AGL_SERVER_HOST = "AGL_SERVER_HOST"
    AGL_SERVER_PORT = "AGL_SERVER_PORT"


def _resolve(
    env_var: LightningEnvVar, override: Optional[T], fallback: Optional[T], parse: Callable[[str], T]
) -> Optional[T]:
    """``override`` if given, else the variable's value parsed, else ``fallback``."""
    if override is not None:
        return override
    value = os.environ.get(env_var.value)
    return fallback if value is None else parse(value)


def _bool(name: str) -> Callable[[str], bool]:
    def parse(value: str) -> bool:
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise ValueError(f"{name}={value!r} is not a yes/no value: set it to one of 1/0, true/false, yes/no, on/off")

    return parse


def _int(name: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer: set it to a whole number") from None

    return parse


def resolve_bool_env_var(
    env_var: LightningEnvVar, override: Optional[bool] = None, fallback: Optional[bool] = None
) -> Optional[bool]:
    """``override``, else the variable as a yes/no value, else ``fallback``."""
    return _resolve(env_var, override, fallback, _bool(env_var.value))


def resolve_int_env_var(
    env_var: LightningEnvVar, override: Optional[int] = None, fallback: Optional[int] = None
) -> Optional[int]:
    """``override``, else the variable as an integer, else ``fallback``."""
    return _resolve(env_var, override, fallback, _int(env_var.value))


def resolve_str_env_var(
    env_var: LightningEnvVar, override: Optional[str] = None, fallback: Optional[str] = None
) -> Optional[str]:
    """``override``, else the variable's text, else ``fallback``."""
    return _resolve(env_var, override, fallback, str)


__all__ = ["LightningEnvVar", "resolve_bool_env_var", "resolve_int_env_var", "resolve_str_env_var"]
