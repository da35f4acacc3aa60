"""``agl.instrument()``: hook the OpenAI client and every installed agent framework, in one call.

The OpenAI client is always hooked (every framework's LLM calls go through it, so token ids are captured
in one place), and so is ``ThreadPoolExecutor.submit`` (tasks submitted inside a rollout stay in it:
:mod:`agl.instrumentation.thread_pools`). Framework adapters are found through the entry-point group
``agl.integrations``; a third-party package adds its own adapter by registering an ``Instrumentor``
subclass there.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional

from agl.instrumentation.base import Instrumentor
from agl.tracing.tracer import get_tracer

logger = logging.getLogger("agl.instrumentation")

ENTRY_POINT_GROUP = "agl.integrations"
_lock = threading.Lock()
_instances: Dict[str, Instrumentor] = {}
_ALWAYS = ("openai", "thread_pools")  # hooked by every instrument(), whatever the frameworks


def _discover() -> Dict[str, Any]:
    """name -> entry point (not loaded yet: loading imports the framework adapter)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _instance(name: str, loader: Any) -> Optional[Instrumentor]:
    if name not in _instances:
        try:
            cls = loader() if callable(loader) else loader.load()
            _instances[name] = cls()
        except ImportError as exc:
            logger.debug("agl integration %s is not importable: %s", name, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - one broken adapter must not stop the others
            logger.warning("agl integration %s could not be loaded and is skipped: %s", name, exc)
            return None
    return _instances[name]


def available_integrations() -> List[str]:
    """Names of the framework adapters that are registered (installed or not)."""
    return sorted(_discover())


def instrument(
    frameworks: Optional[Iterable[str]] = None,
    *,
    request_token_ids: Optional[bool] = None,
    otlp_endpoint: Optional[str] = None,
    otlp_headers: Optional[Mapping[str, str]] = None,
) -> List[str]:
    """Instrument the OpenAI client and the installed frameworks (or only ``frameworks``).

    ``request_token_ids=True`` makes every OpenAI call ask the server for token ids (vLLM / agl server);
    by default they are asked for inside training rollouts only. ``otlp_endpoint`` (an OTLP/HTTP traces URL,
    e.g. Phoenix's ``http://127.0.0.1:6006/v1/traces``) also sends every span to it, besides the store
    (docs/otlp.md; ``AGL_OTLP_ENDPOINT`` does the same). Idempotent; returns what is hooked.
    """
    from agl.instrumentation.openai_client import OpenAIInstrumentor
    from agl.instrumentation.thread_pools import ThreadPoolInstrumentor

    if otlp_endpoint is not None:
        get_tracer().set_otlp(otlp_endpoint, otlp_headers)
    with _lock:
        hooked: List[str] = []
        openai_inst = _instance("openai", lambda: OpenAIInstrumentor)
        if openai_inst is not None and openai_inst.instrument(request_token_ids=request_token_ids):
            hooked.append("openai")
        pools_inst = _instance(ThreadPoolInstrumentor.name, lambda: ThreadPoolInstrumentor)
        if pools_inst is not None and pools_inst.instrument():
            hooked.append(ThreadPoolInstrumentor.name)
        registered = _discover()
        wanted = list(registered) if frameworks is None else list(frameworks)
        for name in wanted:
            if name in _ALWAYS:
                continue
            if name not in registered:
                raise ValueError(f"unknown framework {name!r}: agl has adapters for {sorted(registered)}")
            inst = _instance(name, registered[name])
            if inst is not None and inst.instrument():
                hooked.append(name)
        return hooked


def instrumented() -> Optional[Dict[str, Any]]:
    """What ``instrument()`` hooked in this process, as its keyword arguments (None: nothing is hooked).

    A spawned runner process starts from a fresh interpreter: it calls ``instrument(**instrumented())`` of its
    parent, so an agent that calls ``agl.instrument()`` under ``if __name__ == "__main__":`` is traced there
    too (a forked one inherits the hooks).
    """
    with _lock:
        hooked = [name for name, inst in _instances.items() if inst.is_instrumented]
        if not hooked:
            return None
        openai_inst = _instances.get("openai")
        otlp = get_tracer().otlp
        return {
            "frameworks": [name for name in hooked if name not in _ALWAYS],
            "request_token_ids": getattr(openai_inst, "request_token_ids", None),
            "otlp_endpoint": otlp.endpoint if otlp is not None else None,
            "otlp_headers": otlp.headers if otlp is not None else None,
        }


def uninstrument(frameworks: Optional[Iterable[str]] = None) -> None:
    """Undo ``instrument()``: every hooked function and handler is restored exactly (with no ``frameworks``,
    OTLP export stops too)."""
    if frameworks is None:
        get_tracer().set_otlp(None)
    with _lock:
        names = list(_instances) if frameworks is None else list(frameworks)
        for name in names:
            inst = _instances.get(name)
            if inst is not None:
                inst.uninstrument()
