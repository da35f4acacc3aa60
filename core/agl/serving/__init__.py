"""agl's policy server: an OpenAI-compatible API over a transformers causal LM, with exact token ids.

    from agl.serving.models import load_policy
    from agl.serving import PolicyServer

    model, tokenizer = load_policy("smollm2")
    server = PolicyServer(model, tokenizer, model_name="policy")
    base_url = server.start()        # give agents this base_url
    with server.paused():            # no generation while the weights change
        ...                          # optimizer step on the shared model
    server.set_version(1)

The names below are imported on first use: they need torch and transformers, while other modules of this
package (``agl.instrumentation.proxy``, in front of vLLM) must import without them. See docs/serving.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineStats": "agl.serving.generation",
    "Generation": "agl.serving.generation",
    "GenerationEngine": "agl.serving.engine",
    "LLMProxy": "agl.instrumentation.proxy",
    "SamplingParams": "agl.serving.generation",
    "PolicyServer": "agl.serving.server",
    "WeightsError": "agl.serving.weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agl.serving' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
