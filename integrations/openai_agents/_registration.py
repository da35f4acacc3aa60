"""Putting agl's tracing processor beside the user's, and taking exactly it out again.

The SDK can add a processor (``add_trace_processor``) or replace the whole list (``set_trace_processors``),
but not remove one. Replacing would drop the user's processors (and the SDK's own exporter), so removal
edits the default provider's processor tuple under the lock the SDK itself takes for it. With a custom
provider that has no such tuple, ours stays registered but disabled: it then ignores every new span.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

from agents.tracing import TraceProvider, TracingProcessor, get_trace_provider
from agents.tracing.traces import NoOpTrace

from agl.instrumentation.safety import guarded
from agl.integrations.openai_agents._processor import AglTracingProcessor

logger = logging.getLogger("agl.instrumentation")


def add_processor(processor: AglTracingProcessor) -> Optional[TraceProvider]:
    """Register ``processor`` with the SDK's provider and return that provider; None (nothing added) if
    another instrumentor's processor already mirrors spans there, as two would duplicate every span."""
    provider = get_trace_provider()
    if any(isinstance(p, AglTracingProcessor) and p.enabled for p in _registered(provider)):
        return None
    provider.register_processor(processor)  # what agents.add_trace_processor does
    return provider


@guarded("openai_agents.tracing_disabled", default=False)
def tracing_disabled(provider: TraceProvider) -> bool:
    """Whether the SDK's tracing switch is off now (``OPENAI_AGENTS_DISABLE_TRACING`` or
    ``set_tracing_disabled``). A trace that is never started reports nothing, so asking costs nothing."""
    return isinstance(provider.create_trace(name="agl probe"), NoOpTrace)


def remove_processor(processor: AglTracingProcessor, provider: TraceProvider) -> None:
    """Disable ``processor`` and take it, and only it, out of ``provider``."""
    processor.enabled = False
    multi = getattr(provider, "_multi_processor", None)
    lock = getattr(multi, "_lock", None)
    if multi is None or lock is None or not isinstance(getattr(multi, "_processors", None), tuple):
        logger.debug("agl: the Agents SDK provider %r cannot drop one processor; agl's stays, disabled", provider)
        return
    with lock:
        multi._processors = tuple(p for p in multi._processors if p is not processor)


def _registered(provider: TraceProvider) -> Tuple[TracingProcessor, ...]:
    processors: Any = getattr(getattr(provider, "_multi_processor", None), "_processors", ())
    return tuple(processors) if isinstance(processors, tuple) else ()
