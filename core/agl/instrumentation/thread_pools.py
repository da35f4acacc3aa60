"""The rollout's context in the agent's own thread pools.

A ``ThreadPoolExecutor`` runs its tasks in worker threads that do not inherit the submitter's contextvars,
so an LLM call an agent makes in a pool (parallel tool calls, a fan-out over documents,
``loop.run_in_executor``) belonged to no rollout: it was not stored or trained on. ``agl.instrument()``
hooks ``ThreadPoolExecutor.submit``: inside a rollout, each task carries the submitter's rollout scope and
OpenTelemetry context (:func:`agl.tracing.context.carry_scope`), captured at submit time, so a pool made in one
rollout and reused in the next serves each with its own. Outside rollouts ``submit`` is unchanged. Plain
``threading.Thread`` is left alone (a long-lived thread would keep the rollout it started in); use
``agl.propagate`` there.
"""

from __future__ import annotations

from typing import Any

from agl.instrumentation.base import Instrumentor
from agl.instrumentation.framework import PatchSet
from agl.tracing.context import carry_scope, current_scope


def _submit(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    if not args or current_scope() is None:
        return wrapped(*args, **kwargs)
    return wrapped(carry_scope(args[0]), *args[1:], **kwargs)


class ThreadPoolInstrumentor(Instrumentor):
    """Hooks ``ThreadPoolExecutor.submit`` (see the module docstring); always on with ``agl.instrument()``."""

    name = "thread_pools"

    def __init__(self) -> None:
        super().__init__()
        self._patches = PatchSet()

    def _instrument(self, **kwargs: Any) -> None:
        self._patches.wrap("concurrent.futures", "ThreadPoolExecutor.submit", _submit)

    def _uninstrument(self) -> None:
        self._patches.restore()
