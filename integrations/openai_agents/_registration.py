"""Putting agl's tracing processor beside the user's, keeping it there, and taking exactly it out again.

The SDK can add a processor (``add_trace_processor``) or replace the whole list (``set_trace_processors``),
but not remove one. Replacing would drop the user's processors (and the SDK's own exporter), so removal
edits the default provider's processor tuple under the lock the SDK itself takes for it. With a custom
provider that has no such tuple, ours stays registered but disabled: it then ignores every new span.

``set_trace_processors([])`` is how users keep traces away from api.openai.com (its exporter), often at
import time, after ``agl.instrument()``: it would drop agl's processor too, so :func:`keep_after_replace`
puts ours back after every replacement of the list it was added to. The SDK's other switch,
``set_tracing_disabled(True)`` (or ``RunConfig(tracing_disabled=True)``), makes no spans at all; agl cannot
see agents then, and :func:`watch_untraced` says so at the first LLM call made inside such a run.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

from agents.tracing import TraceProvider, TracingProcessor, get_current_trace
from agents.tracing.traces import NoOpTrace

from agl import semconv
from agl._util.safety import guarded
from agl.instrumentation.framework import PatchSet
from agl.integrations.openai_agents._processor import AglTracingProcessor
from agl.tracing.spans import AglSpan
from agl.tracing.tracer import get_tracer

logger = logging.getLogger("agl.instrumentation")

UNTRACED_WARNING = (
    "agl: an LLM call ran inside an OpenAI Agents SDK run whose tracing is disabled (set_tracing_disabled, "
    "OPENAI_AGENTS_DISABLE_TRACING or RunConfig(tracing_disabled=True)): the SDK then tells no processor about "
    "its agents and tools, agl's included, so this call belongs to no SDK agent (agent_match cannot select it "
    "by Agent.name) and tool calls are not recorded. To keep traces away from api.openai.com and let agl see "
    "the agents, call agents.set_trace_processors([]) instead of disabling tracing."
)


def add_processor(processor: AglTracingProcessor, provider: TraceProvider) -> None:
    """Register ``processor`` with ``provider`` (the SDK's current one), as ``agents.add_trace_processor``
    does. One per provider: the instrumentors share it (see ``OpenAIAgentsInstrumentor``)."""
    provider.register_processor(processor)


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


def keep_after_replace(patches: PatchSet, processor: AglTracingProcessor, provider: TraceProvider) -> None:
    """Re-add ``processor`` whenever the list of ``provider``'s processors is replaced without it (while it is
    enabled). Nothing is patched for a custom provider without the SDK's multi-processor."""
    multi = getattr(provider, "_multi_processor", None)
    if multi is None:
        return

    def keep_ours(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if instance is multi and processor.enabled and processor not in _registered(provider):
            instance.add_tracing_processor(processor)
            logger.debug("agl: set_trace_processors() replaced agl's processor too; it was added back")
        return result

    patches.wrap(type(multi).__module__, f"{type(multi).__name__}.set_processors", keep_ours)


class _Untraced:
    """What the tracer start hook below checks: the processor of the active instrumentor, and whether the
    process was warned already (once is enough: every later call of such a run has the same cause)."""

    processor: Optional[AglTracingProcessor] = None
    warned = False


def watch_untraced(processor: AglTracingProcessor) -> None:
    """Warn at the first LLM call made inside an SDK run with tracing disabled while ``processor`` is on."""
    _Untraced.processor = processor
    get_tracer().add_start_hook(_warn_if_untraced)  # the same function each time: added once per tracer


def _warn_if_untraced(span: AglSpan) -> None:
    """A tracer start hook: a dictionary read per span, and a context variable read per ``llm`` span."""
    processor = _Untraced.processor
    if _Untraced.warned or processor is None or not processor.enabled:
        return
    if span.attributes.get(semconv.SPAN_KIND) == "llm" and isinstance(get_current_trace(), NoOpTrace):
        _Untraced.warned = True
        logger.warning(UNTRACED_WARNING)
