"""agl adapter for the OpenAI Agents SDK (``openai-agents``, imported as ``agents``).

``agl.instrument()`` adds one ``agents.tracing.TracingProcessor`` beside the user's own (and the SDK's
exporter), which stays there when the user replaces the list (``set_trace_processors([])``, to keep
traces away from api.openai.com), and mirrors the SDK's spans as agl spans: each ``Agent`` run becomes an
``agent`` span named ``Agent.name`` under which the model requests of that agent nest, function tools
become ``tool`` spans, handoffs and guardrails ``chain`` spans. The model requests themselves are the OpenAI-client layer's
``llm`` spans (one per HTTP request, with token ids). The one SDK function patched is the processor
list's ``set_processors``, to put agl's processor back after a replacement.

Nothing from the SDK is imported here, so ``agl.instrument()`` works without it installed.
See docs/integrations/openai_agents.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Tuple

from agl.instrumentation.base import Instrumentor
from agl.instrumentation.framework import PatchSet
from agl.instrumentation.safety import guard

logger = logging.getLogger("agl.instrumentation")


class _Registration:
    """agl's one processor on one SDK trace provider, and the patch that keeps it there, shared by every
    hooked :class:`OpenAIAgentsInstrumentor` of that provider (``users`` counts them)."""

    def __init__(self, processor: Any, provider: Any) -> None:
        self.processor = processor
        self.provider = provider
        self.patches = PatchSet()
        self.users = 0


_registrations_lock = threading.Lock()
_registrations: Dict[int, _Registration] = {}  # id(provider) -> its registration (which keeps the provider alive)


class OpenAIAgentsInstrumentor(Instrumentor):
    """Mirrors the Agents SDK's traces into agl spans through a tracing processor of its own.

    Several instances (``agl.instrument()``'s and one a user or a library hooks itself, OpenInference-style)
    share one processor per SDK trace provider, reference-counted: the first ``instrument()`` registers it,
    every later one joins it (two processors would mirror every span twice), and only the last
    ``uninstrument()`` takes it out, agl's processor and nothing else. So every instance that reports
    ``is_instrumented`` really has agl's processor registered, whichever of them is uninstrumented first.
    ``instrument()`` twice on one instance is still one use.
    """

    name = "openai_agents"
    instruments: Tuple[str, ...] = ("openai-agents>=0.5.0,<1",)

    def __init__(self) -> None:
        super().__init__()
        self._registration: Optional[_Registration] = None

    def _instrument(self, **kwargs: Any) -> None:
        from agents.tracing import get_trace_provider

        from agl.integrations.openai_agents._processor import AglTracingProcessor
        from agl.integrations.openai_agents._registration import (
            add_processor,
            keep_after_replace,
            tracing_disabled,
            watch_untraced,
        )

        provider = get_trace_provider()
        with _registrations_lock:
            registration = _registrations.get(id(provider))
            joined = registration is not None
            if registration is None:
                registration = _registrations[id(provider)] = _Registration(AglTracingProcessor(), provider)
            registration.users += 1
            self._registration = registration  # before hooking: a failure below is undone by _uninstrument
            if joined:
                logger.debug("agl: another OpenAIAgentsInstrumentor traces the Agents SDK; sharing its processor")
            else:
                add_processor(registration.processor, provider)
                keep_after_replace(registration.patches, registration.processor, provider)
                watch_untraced(registration.processor)
        if tracing_disabled(provider):
            # The SDK's switch silences every processor, agl's too: agents would go unnamed in the spans.
            logger.warning(
                "agl: the OpenAI Agents SDK's tracing is disabled (OPENAI_AGENTS_DISABLE_TRACING or "
                "set_tracing_disabled), which also hides its agents and tools from agl; LLM calls are still "
                "recorded, without their agent. To keep traces away from api.openai.com, call "
                "agents.set_trace_processors([]) and agents.set_tracing_disabled(False) instead."
            )

    def _uninstrument(self) -> None:
        from agl.integrations.openai_agents._registration import remove_processor

        with _registrations_lock:
            registration, self._registration = self._registration, None
            if registration is None:
                return
            registration.users -= 1
            if registration.users > 0:
                return  # another hooked instance still uses the processor
            _registrations.pop(id(registration.provider), None)
            registration.patches.restore()
            with guard("openai_agents.uninstrument"):
                remove_processor(registration.processor, registration.provider)


__all__ = ["OpenAIAgentsInstrumentor"]
