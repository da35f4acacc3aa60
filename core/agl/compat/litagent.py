"""Agent Lightning's ``agl.litagent``: ``LitAgent`` and its decorators, on agl's own LitAgent.

``@llm_rollout`` and ``@prompt_rollout`` are ``@agl.rollout`` with Agent Lightning's check of the function's
arguments (``task`` first, then ``llm`` or ``prompt_template``, optionally ``rollout``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union, overload

from agl.runtime.litagent import FunctionalLitAgent, LitAgent, rollout

__all__ = ["FunctionalLitAgent", "LitAgent", "llm_rollout", "prompt_rollout", "rollout"]

Decorated = Union[FunctionalLitAgent, Callable[[Callable[..., Any]], FunctionalLitAgent]]


def _checked(fn: Callable[..., Any], resource: str, decorator: str) -> FunctionalLitAgent:
    """``@agl.rollout`` of ``fn`` once its arguments are ``(task, <resource>[, rollout])``."""
    params = list(inspect.signature(fn).parameters)
    if not params or params[0] != "task" or resource not in params:
        raise ValueError(
            f"@{decorator} function {getattr(fn, '__name__', fn)!r} takes {params}: it must take (task, {resource}) "
            f"or (task, {resource}, rollout)"
        )
    return rollout(fn)


@overload
def llm_rollout(func: Callable[..., Any]) -> FunctionalLitAgent: ...


@overload
def llm_rollout(*, strip_proxy: bool = True) -> Callable[[Callable[..., Any]], FunctionalLitAgent]: ...


def llm_rollout(func: Optional[Callable[..., Any]] = None, *, strip_proxy: bool = True) -> Decorated:
    """``@llm_rollout`` or ``@llm_rollout(strip_proxy=...)`` on ``def agent(task, llm[, rollout])``.

    ``strip_proxy`` is accepted: agl hands the agent the ``LLM`` or ``ProxyLLM`` resource itself, and a
    ``ProxyLLM``'s ``get_base_url()`` adds the rollout's route by itself."""
    if func is None:
        return lambda fn: _checked(fn, "llm", "llm_rollout")
    return _checked(func, "llm", "llm_rollout")


@overload
def prompt_rollout(func: Callable[..., Any]) -> FunctionalLitAgent: ...


@overload
def prompt_rollout() -> Callable[[Callable[..., Any]], FunctionalLitAgent]: ...


def prompt_rollout(func: Optional[Callable[..., Any]] = None) -> Decorated:
    """``@prompt_rollout`` (or ``@prompt_rollout()``) on ``def agent(task, prompt_template[, rollout])``."""
    if func is None:
        return lambda fn: _checked(fn, "prompt_template", "prompt_rollout")
    return _checked(func, "prompt_template", "prompt_rollout")
