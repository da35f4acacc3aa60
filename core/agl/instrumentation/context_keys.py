"""OpenTelemetry context keys through which agl integrations coordinate.

``SUPPRESS_LLM_SPAN``: a framework adapter (LangChain, the Agents SDK, ...) that already opened an ``llm``
span for a model request sets this key while it calls the OpenAI client underneath. The OpenAI
instrumentation then writes its attributes (token ids, messages, usage) onto that *current* span instead
of opening a second ``llm`` span, so each model request is exactly one ``llm`` span, which LightningRL
turns into one training sample.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from opentelemetry import context as otel_context

SUPPRESS_LLM_SPAN = otel_context.create_key("agl.suppress_llm_span")


@contextlib.contextmanager
def llm_span_already_open() -> Iterator[None]:
    """Inside this block, LLM client instrumentation enriches the current span instead of making one.

    Enter it with the adapter's own ``llm`` span current (e.g. inside ``get_tracer().span(...)``).
    """
    token = otel_context.attach(otel_context.set_value(SUPPRESS_LLM_SPAN, True))
    try:
        yield
    finally:
        otel_context.detach(token)
