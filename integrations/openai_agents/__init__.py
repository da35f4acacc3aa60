"""agl adapter for the OpenAI Agents SDK (``openai-agents``, imported as ``agents``).

``agl.instrument()`` adds one ``agents.tracing.TracingProcessor`` beside the user's own (and the SDK's
exporter) and mirrors the SDK's spans as agl spans: each ``Agent`` run becomes an ``agent`` span named
``Agent.name`` under which the model requests of that agent nest, function tools become ``tool`` spans,
handoffs and guardrails ``chain`` spans. The model requests themselves are the OpenAI-client layer's
``llm`` spans (one per HTTP request, with token ids). No SDK function is patched.

Nothing from the SDK is imported here, so ``agl.instrument()`` works without it installed.
See docs/integrations/openai_agents.md.
"""

from __future__ import annotations

import logging
from typing import Any, Tuple

from agl.instrumentation.base import Instrumentor
from agl.instrumentation.safety import guard

logger = logging.getLogger("agl.instrumentation")


class OpenAIAgentsInstrumentor(Instrumentor):
    """Mirrors the Agents SDK's traces into agl spans through a tracing processor of its own."""

    name = "openai_agents"
    instruments: Tuple[str, ...] = ("openai-agents>=0.5.0,<1",)

    def __init__(self) -> None:
        super().__init__()
        self._processor: Any = None
        self._provider: Any = None

    def _instrument(self, **kwargs: Any) -> None:
        from agl.integrations.openai_agents._processor import AglTracingProcessor
        from agl.integrations.openai_agents._registration import add_processor, tracing_disabled

        processor = AglTracingProcessor()
        provider = add_processor(processor)
        if provider is None:
            logger.debug("agl: another OpenAIAgentsInstrumentor already traces the Agents SDK")
            return
        self._processor, self._provider = processor, provider
        if tracing_disabled(provider):
            # The SDK's switch silences every processor, agl's too: agents would go unnamed in the spans.
            logger.warning(
                "agl: the OpenAI Agents SDK's tracing is disabled (OPENAI_AGENTS_DISABLE_TRACING or "
                "set_tracing_disabled), which also hides its agents and tools from agl; LLM calls are still "
                "recorded, without their agent. Enable it with agents.set_tracing_disabled(False) and choose "
                "exporters with agents.set_trace_processors([...]) before agl.instrument()."
            )

    def _uninstrument(self) -> None:
        from agl.integrations.openai_agents._registration import remove_processor

        if self._processor is not None:
            with guard("openai_agents.uninstrument"):
                remove_processor(self._processor, self._provider)
        self._processor = self._provider = None


__all__ = ["OpenAIAgentsInstrumentor"]
