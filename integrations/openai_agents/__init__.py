"""agl adapter for the OpenAI Agents SDK (``openai-agents``, imported as ``agents``).

``agl.instrument()`` adds one ``agents.tracing.TracingProcessor`` beside the user's own (and the SDK's
exporter), which stays there when the user replaces the list (``set_trace_processors([])``, to keep
traces away from api.openai.com), and mirrors the SDK's spans as agl spans: each ``Agent`` run becomes an
``agent`` span named ``Agent.name`` under which the model requests of that agent nest, function tools
become ``tool`` spans, handoffs and guardrails ``chain`` spans. The model requests themselves are the OpenAI-client
layer's ``llm`` spans (one per HTTP request, with token ids). The one SDK function patched is the processor
list's ``set_processors``, to put agl's processor back after a replacement.

Nothing from the SDK is imported here, so ``agl.instrument()`` works without it installed.
See docs/integrations/openai_agents.md.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Tuple

from agl._util.safety import guard
from agl.instrumentation.base import Instrumentor
from agl.instrumentation.framework import PatchSet

logger = logging.getLogger("agl.instrumentation")


class OpenAIAgentsInstrumentor(Instrumentor):
    """Mirrors the Agents SDK's traces into agl spans through a tracing processor of its own.

    ``agl.instrument()``'s instance and one a user or a library hooks itself (OpenInference-style) share that
    one processor (the base class shares the hooks of one instrumentor class): two processors would mirror
    every span twice, and the last ``uninstrument()`` takes it out, agl's processor and nothing else.
    """

    name = "openai_agents"
    instruments: ClassVar[Tuple[str, ...]] = ("openai-agents>=0.5.0,<1",)

    def __init__(self) -> None:
        super().__init__()
        self._processor: Any = None
        self._provider: Any = None
        self._patches = PatchSet()

    def _instrument(self, **kwargs: Any) -> None:
        from agents.tracing import get_trace_provider

        from agl.integrations.openai_agents._processor import AglTracingProcessor
        from agl.integrations.openai_agents._registration import (
            add_processor,
            keep_after_replace,
            tracing_disabled,
            watch_untraced,
        )

        self._processor, self._provider = AglTracingProcessor(), get_trace_provider()
        add_processor(self._processor, self._provider)
        keep_after_replace(self._patches, self._processor, self._provider)
        watch_untraced(self._processor)
        if tracing_disabled(self._provider):
            # The SDK's switch silences every processor, agl's too: agents would go unnamed in the spans.
            logger.warning(
                "agl: the OpenAI Agents SDK's tracing is disabled (OPENAI_AGENTS_DISABLE_TRACING or "
                "set_tracing_disabled), which also hides its agents and tools from agl; LLM calls are still "
                "recorded, without their agent. To keep traces away from api.openai.com, call "
                "agents.set_trace_processors([]) and agents.set_tracing_disabled(False) instead."
            )

    def _uninstrument(self) -> None:
        from agl.integrations.openai_agents._registration import remove_processor

        self._patches.restore()
        if self._processor is not None:
            with guard("openai_agents.uninstrument"):
                remove_processor(self._processor, self._provider)
        self._processor = self._provider = None


__all__ = ["OpenAIAgentsInstrumentor"]
