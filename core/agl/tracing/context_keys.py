"""How agl integrations coordinate around the one ``llm`` span per model request.

``SUPPRESS_LLM_SPAN``: a framework adapter (LangChain, the Agents SDK, ...) that already opened an ``llm``
span for a model request sets this key while it calls the OpenAI client underneath. The OpenAI
instrumentation then writes its attributes (token ids, messages, usage) onto that *current* span instead
of opening a second ``llm`` span, so each model request is exactly one ``llm`` span, which LightningRL
turns into one training sample.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

from opentelemetry import context as otel_context
from opentelemetry.trace import Span

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


# -- parent resolvers ----------------------------------------------------------------------------------------
# Callback-style frameworks (LangChain) never make their run spans *current* (a missed detach in a callback
# would leave a context attached forever), so a span agl starts inside a run (the llm span of the OpenAI
# client layer, an agl.operation or @agl.tool in a LangGraph node) would be parented to whatever is current.
# Such an adapter registers a resolver instead: called when an agl span starts, it returns the span of the
# framework run executing now (e.g. the LangChain run calling the model, or the node running), or None. The
# tracer parents the new span to the innermost of that span and the current one (Tracer.start_span).

ParentResolver = Callable[[], Optional[Span]]
_resolvers: List[ParentResolver] = []


def register_parent_resolver(resolver: ParentResolver) -> None:
    if resolver not in _resolvers:
        _resolvers.append(resolver)


def unregister_parent_resolver(resolver: ParentResolver) -> None:
    if resolver in _resolvers:
        _resolvers.remove(resolver)


def resolve_parent() -> Optional[Span]:
    """The span of the framework run executing now, as an adapter reports it, or None. Never raises."""
    for resolver in _resolvers:
        try:
            parent = resolver()
        except Exception as exc:  # noqa: BLE001 - an adapter bug must not break the user's call
            from agl._util.safety import report_internal_error

            report_internal_error("parent_resolver", exc)
            continue
        if parent is not None:
            return parent
    return None
