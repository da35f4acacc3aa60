"""Agent Lightning's module paths and top-level names, resolved to agl's modules when first used.

Code written for Agent Lightning v0.3.0 imports ``agentlightning.tracer.agentops`` or reads
``agentlightning.OtelTracer``; with ``agl`` in place of ``agentlightning`` these resolve here. ``MODULES``
maps each Agent Lightning module path that agl lacks to the agl module serving it (the alias *is* that
module: ``agl.runner is agl.compat.runner``); ``MISSING_MODULES`` gives a one-line reason for the paths agl
has no counterpart for; ``NAMES`` maps each name Agent Lightning exports from its package root to the agl
module holding it. ``import agl`` installs the finder and imports nothing else: a compat module is loaded
only when its path or one of its names is first used, so ``import agl`` stays as fast as it was.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Dict, Optional, Sequence, Tuple

GUIDE = "docs/agent-lightning.md"

# Agent Lightning module path (agl in place of agentlightning) -> the agl module that serves it.
MODULES: Dict[str, str] = {
    "agl.adapter": "agl.compat.adapter",
    "agl.adapter.base": "agl.compat.adapter",
    "agl.adapter.messages": "agl.compat.adapter",
    "agl.adapter.triplet": "agl.compat.adapter",
    "agl.client": "agl.compat.server",
    "agl.emitter": "agl.compat.emitter",
    "agl.env_var": "agl.compat.env_var",
    "agl.execution": "agl.compat.execution",
    "agl.litagent": "agl.compat.litagent",
    "agl.llm_proxy": "agl.compat.llm_proxy",
    "agl.logging": "agl.compat.logging",
    "agl.reward": "agl.compat.reward",
    "agl.runner": "agl.compat.runner",
    "agl.server": "agl.compat.server",
    "agl.tracer": "agl.compat.tracer",
    "agl.tracer.agentops": "agl.compat.tracer",
    "agl.tracer.base": "agl.compat.tracer",
    "agl.tracer.dummy": "agl.compat.tracer",
    "agl.tracer.otel": "agl.compat.tracer",
    "agl.utils": "agl.compat.utils",
    "agl.utils.metrics": "agl.compat.metrics",
    "agl.utils.otel": "agl.compat.utils",
}

# Agent Lightning module paths agl has no counterpart for -> what to use instead (one line).
MISSING_MODULES: Dict[str, str] = {
    "agl.algorithm.utils": "iterate the dataset directly (agl datasets are lists or task files)",
    "agl.config": "agl's command line takes settings as `agl train --set KEY=VALUE`",
    "agl.store.collection": "agl's stores are not built on collections; subclass agl.LightningStore",
    "agl.store.collection_based": "agl's stores are not built on collections; subclass agl.LightningStore",
    "agl.store.mongo": "agl has no MongoDB store; use PostgreSQL (agl.open_store('postgresql://...')) or SQLite",
    "agl.tracer.weave": "agl has no Weave tracer; agl.instrument() records the frameworks' calls",
}

_SPANS = "agl's spans are agl.Span (agl.types), their attribute names are in agl.semconv"
_LEGACY = "Agent Lightning v0.1's API is not served; use agl.Rollout and agl.Task with the store"
_QUERIES = "agl's store queries take plain keyword arguments (store.query_rollouts(status=..., limit=...))"
_STORES = "use agl.InMemoryLightningStore, agl.SqliteLightningStore or agl.open_store(...)"
_RUNNERS = "agl's runners are agl.Runner, started by agl.Trainer or `agl runner --store URL`"

# Each name Agent Lightning v0.3.0 exports from its package root (and agl does not itself) ->
# (the agl module holding it, or "" for none; what to use when it is not there).
NAMES: Dict[str, Tuple[str, str]] = {
    "Adapter": ("agl.compat.adapter", "agl.Trainer(adapter={'agent_match': ...}) configures agl's adapter"),
    "AgentLightningClient": ("agl.compat.server", "use agl.LightningStoreClient"),
    "AgentLightningServer": ("agl.compat.server", "use agl.LightningStoreServer or `agl store serve`"),
    "AgentOpsTracer": ("agl.compat.tracer", "agl.instrument() traces the agent"),
    "AttemptStatus": ("agl.types", "a string: preparing, running, succeeded, failed, timeout, unresponsive"),
    "AttemptedRollout": ("agl.types", "agl.Rollout with its attempt"),
    "AttributeValue": ("agl.types", _SPANS),
    "Attributes": ("agl.types", _SPANS),
    "ClientServerExecutionStrategy": ("agl.compat.execution", "agl.Trainer(n_runners=...) runs the runners"),
    "CollectionBasedLightningStore": ("agl.store", _STORES),
    "Dataset": ("agl.types", "a list of tasks, or the path of a task file"),
    "DevTaskLoader": ("agl.compat.server", "use agl.Trainer(...).dev(agent, tasks)"),
    "DummyTracer": ("agl.compat.tracer", "agl records nothing outside a rollout"),
    "EnqueueRolloutRequest": ("agl.types", "agl.store.EnqueueRequest"),
    "Event": ("agl.types", _SPANS),
    "ExecutionEvent": ("agl.compat.execution", "agl.Trainer stops its runners itself"),
    "ExecutionStrategy": ("agl.compat.execution", "agl.Trainer(n_runners=...) runs the runners"),
    "FastAlgorithm": ("agl.algorithm", "agl.Baseline"),
    "FilterField": ("agl.types", _QUERIES),
    "FilterOptions": ("agl.types", _QUERIES),
    "GenericResponse": ("agl.types", _LEGACY),
    "Hook": ("agl.types", "agl.Trainer reports progress in its run folder"),
    "LLMProxy": ("agl.compat.llm_proxy", "agl.instrumentation.proxy.LLMProxy"),
    "LegacyAgentRunner": ("agl.compat.runner", _RUNNERS),
    "LightningEnvVar": ("agl.compat.env_var", "set agl's settings as arguments"),
    "LightningStoreCapabilities": ("agl.store", "every agl store is thread-safe"),
    "LightningStoreClient": ("agl.store", "agl.open_store('http://host:port')"),
    "LightningStoreServer": ("agl.store", "`agl store serve`"),
    "LightningStoreStatistics": ("agl.store", "agl.store.StoreStats"),
    "LightningStoreThreaded": ("agl.store", "every agl store is thread-safe; use it directly"),
    "Link": ("agl.types", _SPANS),
    "LitAgentRunner": ("agl.compat.runner", _RUNNERS),
    "LlmProxyTraceToTriplet": ("agl.compat.adapter", "agl's LightningRL reads the proxy's spans as any other"),
    "MultiprocessingEvent": ("agl.compat.execution", "agl.Trainer stops its runners itself"),
    "OtelResource": ("agl.types", _SPANS),
    "OtelTraceAdapter": ("agl.compat.adapter", "agl.Trainer(adapter={'agent_match': ...})"),
    "OtelTracer": ("agl.compat.tracer", "agl.instrument() traces the agent"),
    "PaginatedResult": ("agl.types", _QUERIES),
    "ParallelWorkerBase": ("agl.types", _RUNNERS),
    "Resource": ("agl.types", "agl.LLM, agl.ProxyLLM or agl.PromptTemplate"),
    "ResourceUnion": ("agl.types", "agl.LLM, agl.ProxyLLM or agl.PromptTemplate"),
    "RolloutLegacy": ("agl.types", _LEGACY),
    "RolloutMode": ("agl.types", "a string: train, val or dev"),
    "RolloutRawResult": ("agl.types", "rollout() returns None, a number or {'reward': number}"),
    "RolloutRawResultLegacy": ("agl.types", _LEGACY),
    "RolloutStatus": ("agl.types", "a string: queuing, running, succeeded, failed, cancelled, requeuing"),
    "SharedMemoryExecutionStrategy": ("agl.compat.execution", "agl.Trainer(n_runners=...) runs the runners"),
    "SortOptions": ("agl.types", _QUERIES),
    "SpanAttributeNames": ("agl.types", _SPANS),
    "SpanContext": ("agl.types", _SPANS),
    "SpanCoreFields": ("agl.types", _SPANS),
    "SpanLike": ("agl.types", _SPANS),
    "SpanNames": ("agl.types", _SPANS),
    "SpanRecordingContext": ("agl.types", _SPANS),
    "StatusCode": ("agl.types", _SPANS),
    "TaskIfAny": ("agl.types", _LEGACY),
    "TaskInput": ("agl.types", "a task is any JSON-serialisable value"),
    "ThreadingEvent": ("agl.compat.execution", "agl.Trainer stops its runners itself"),
    "TraceAdapter": ("agl.compat.adapter", "agl.Trainer(adapter={'agent_match': ...})"),
    "TraceState": ("agl.types", _SPANS),
    "TraceStatus": ("agl.types", _SPANS),
    "TraceToTripletBase": ("agl.compat.adapter", "agl.Trainer(adapter={'agent_match': ...})"),
    "Tracer": ("agl.compat.tracer", "agl.instrument() traces the agent"),
    "TracerTraceToTriplet": ("agl.compat.adapter", "agl.Trainer(adapter={'agent_match': ...})"),
    "Triplet": ("agl.types", "agl's LightningRL builds its samples from the spans (agl.lightningrl)"),
    "Worker": ("agl.types", _RUNNERS),
    "WorkerStatus": ("agl.types", _RUNNERS),
    "algo": ("agl.algorithm", "subclass agl.Algorithm"),
    "build_component": ("agl.trainer", "pass the component itself to agl.Trainer"),
    "clear_active_tracer": ("agl.compat.tracer", "agl.get_tracer() is always set"),
    "configure_logger": ("agl.compat.logging", "agl.setup_logging()"),
    "emit_annotation": ("agl.compat.emitter", "agl.emit_object"),
    "find_final_reward": ("agl.compat.emitter", "read the store's rollout reward"),
    "find_reward_spans": ("agl.compat.emitter", "read the store's rollout reward"),
    "get_active_tracer": ("agl.compat.tracer", "agl.get_tracer()"),
    "get_message_value": ("agl.compat.emitter", "read the span's agl.message.body attribute"),
    "get_object_value": ("agl.compat.emitter", "read the span's agl.object.json attribute"),
    "get_reward_value": ("agl.compat.emitter", "read the span's agl.reward.value attribute"),
    "get_rewards_from_span": ("agl.compat.emitter", "read the span's agl.reward.* attributes"),
    "is_reward_span": ("agl.compat.emitter", "the span's name is agl.reward"),
    "lightning_cli": ("", "agl's command line takes settings as `agl train --set KEY=VALUE`"),
    "llm_rollout": ("agl.compat.litagent", "@agl.rollout"),
    "prompt_rollout": ("agl.compat.litagent", "@agl.rollout"),
    "resolve_bool_env_var": ("agl.compat.env_var", "read os.environ"),
    "resolve_int_env_var": ("agl.compat.env_var", "read os.environ"),
    "resolve_str_env_var": ("agl.compat.env_var", "read os.environ"),
    "reward": ("agl.compat.emitter", "return the reward from rollout() or call agl.emit_reward"),
    "set_active_tracer": ("agl.compat.tracer", "agl.get_tracer() is always set"),
    "setup_logging": ("agl.compat.logging", "logging.basicConfig()"),
    "setup_module_logging": ("agl.compat.logging", "logging.getLogger(NAME).setLevel(...)"),
}

_MISSING = object()


def unavailable(what: str, instead: str) -> str:
    """The one line that says ``what`` of Agent Lightning agl does not offer, and what to use."""
    return f"{what} (Agent Lightning) is not in agl: {instead}; see {GUIDE}"


def peer_attribute(name: str) -> Any:
    """``agl.<name>`` for an Agent Lightning name or module that agl's package root does not define itself."""
    entry = NAMES.get(name)
    if entry is None:
        if f"agl.{name}" in MODULES:
            return importlib.import_module(f"agl.{name}")
        raise AttributeError(f"module 'agl' has no attribute {name!r}")
    module, instead = entry
    if module:
        found = getattr(importlib.import_module(module), name, _MISSING)
        if found is not _MISSING:
            return found
    raise AttributeError(unavailable(f"agl.{name}", instead))


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the very module it names: ``sys.modules['agl.runner'] is agl.compat.runner``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        spec.loader_state = module.__spec__  # the import system writes the alias's spec over it: put it back
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        alias_spec = module.__spec__
        assert alias_spec is not None
        module.__spec__ = alias_spec.loader_state


class _MissingLoader(importlib.abc.Loader):
    """An Agent Lightning module agl has no counterpart for: importing it says what to use instead."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        raise ModuleNotFoundError(unavailable(spec.name, self.reason), name=spec.name)

    def exec_module(self, module: types.ModuleType) -> None:  # never reached: create_module raises
        raise AssertionError(module)


# Aliases other aliases sit under (agl.tracer for agl.tracer.agentops): they must look like packages.
_PARENTS = {name.rpartition(".")[0] for name in (*MODULES, *MISSING_MODULES)} & set(MODULES)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the Agent Lightning paths of :data:`MODULES` and :data:`MISSING_MODULES`; nothing else."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        alias = MODULES.get(fullname)
        if alias is not None:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(alias), is_package=fullname in _PARENTS)
        reason = MISSING_MODULES.get(fullname)
        if reason is not None:
            return importlib.machinery.ModuleSpec(fullname, _MissingLoader(reason))
        return None


_FINDER = AliasFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an alias under a real package (``agl.utils.otel``)
    must be found before the path finder looks in that package's folder."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
