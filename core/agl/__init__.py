"""agl: train any existing AI agent with reinforcement learning.

    import agl
    agl.instrument()          # one line: every LLM call, tool call and agent step becomes a span

Then run the agent through ``agl.Trainer(...).dev(...)`` or ``.fit(...)``; see README.md.
"""

from typing import Any as _Any

from agl.algorithm import APO, Algorithm, Baseline, TraceToMessages
from agl.compat import aliases as _compat_aliases
from agl.instrumentation import instrument, uninstrument
from agl.lightningrl import LightningRL
from agl.runtime.litagent import FunctionalLitAgent, LitAgent, rollout
from agl.runtime.runner import Runner
from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore, open_store
from agl.tracing.context import RolloutScope, propagate, rollout_scope, submit
from agl.tracing.emitters import emit_exception, emit_message, emit_object, emit_reward, operation
from agl.tracing.tool import tool
from agl.tracing.tracer import get_tracer
from agl.trainer import Trainer
from agl.types import (
    LLM,
    Attempt,
    NamedResources,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Task,
)


def _installed_version() -> str:
    """The installed distribution's version: pyproject.toml is the one place it is written."""
    from importlib import metadata

    try:
        return metadata.version("agl")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _installed_version()
_compat_aliases.install()  # Agent Lightning's module paths: agl.runner, agl.tracer.agentops, ...


def __getattr__(name: str) -> _Any:
    """``agl.VERL`` and ``agl.TorchGRPO`` are imported on first use: only training needs verl or torch.
    Agent Lightning's names (``agl.OtelTracer``, ``agl.LLMProxy``, ...) are served from agl.compat likewise."""
    if name == "VERL":
        from agl.algorithm.verl import VERL

        return VERL
    if name == "TorchGRPO":
        from agl.algorithm.torch_grpo import TorchGRPO

        return TorchGRPO
    return _compat_aliases.peer_attribute(name)


__all__ = [
    "APO",
    "Algorithm",
    "Attempt",
    "Baseline",
    "FunctionalLitAgent",
    "InMemoryLightningStore",
    "LLM",
    "LightningRL",
    "LightningStore",
    "LitAgent",
    "NamedResources",
    "PromptTemplate",
    "ProxyLLM",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutScope",
    "Runner",
    "Span",
    "SqliteLightningStore",
    "Task",
    "TorchGRPO",
    "TraceToMessages",
    "Trainer",
    "VERL",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "get_tracer",
    "instrument",
    "open_store",
    "operation",
    "propagate",
    "rollout",
    "rollout_scope",
    "submit",
    "tool",
    "uninstrument",
]
