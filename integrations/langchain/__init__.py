"""agl's LangChain + LangGraph adapter: graph nodes and agents become ``agent`` spans, tools ``tool`` spans.

LangChain's own extension point is its callback system, and LangGraph runs through it, so one callback
handler sees every graph, node, chain, tool and model run. Users pass no ``callbacks=[...]``: a wrapt patch
on ``BaseCallbackManager.__init__`` adds the one agl handler (inheritable) to every callback manager that
does not hold it yet (child managers copy their parent's handlers, hence the membership check). LLM
spans come from the OpenAI-client layer; this adapter tells it, through a parent resolver, which node's
span the request belongs to. See docs/integrations/langchain.md.

Nothing from LangChain is imported here at module import time, so ``agl.instrument()`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from agl._util.safety import guard
from agl.instrumentation.base import Instrumentor, hooks_owner
from agl.instrumentation.framework import PatchSet
from agl.tracing.callback_handlers import register_callback_handler
from agl.tracing.context_keys import register_parent_resolver, unregister_parent_resolver

if TYPE_CHECKING:
    from agl.integrations.langchain._handler import AglCallbackHandler

__all__ = ["LangChainInstrumentor"]


def _adding_handler(handler: AglCallbackHandler) -> Callable[..., None]:
    """A wrapper for ``BaseCallbackManager.__init__`` that makes ``handler`` one of the manager's
    inheritable handlers, in new lists so that lists the caller passed in are left untouched."""

    def wrapper(wrapped: Callable[..., None], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        wrapped(*args, **kwargs)
        with guard("langchain.callback_manager"):
            if not any(h is handler for h in instance.handlers or ()):
                instance.handlers = [*(instance.handlers or ()), handler]
            if not any(h is handler for h in instance.inheritable_handlers or ()):
                instance.inheritable_handlers = [*(instance.inheritable_handlers or ()), handler]

    return wrapper


def callback_handler() -> AglCallbackHandler:
    """The handler ``agl.instrument()`` adds to every LangChain callback manager, for code that passes it in
    ``callbacks=[...]`` as Agent Lightning's ``tracer.get_langchain_handler()`` asks: the manager holds it
    once either way, so nothing is recorded twice."""
    owner = hooks_owner(LangChainInstrumentor)
    handler = getattr(owner, "_handler", None)
    if handler is None:
        raise RuntimeError(
            "agl is not recording LangChain in this process: call agl.instrument() (a Trainer does unless "
            "instrument=False), after which no callbacks=[...] is needed at all"
        )
    return handler


register_callback_handler("langchain", callback_handler)


class LangChainInstrumentor(Instrumentor):
    """Hooks LangChain (and LangGraph, which runs on LangChain's callbacks) for agl.

    Agent names: a LangGraph node's name; a ``create_agent(name=...)`` agent's name; an ``AgentExecutor``'s
    run name. The root run of each invocation is a ``chain`` span; tools are ``tool`` spans.
    """

    name = "langchain"
    instruments = ("langchain-core>=0.3.30,<2",)

    def __init__(self) -> None:
        super().__init__()
        self._patches = PatchSet()
        self._handler: Optional[AglCallbackHandler] = None

    def _instrument(self, **kwargs: Any) -> None:
        from agl.integrations.langchain._handler import AglCallbackHandler

        # A fresh handler each time: managers built before an uninstrument keep the old, disabled one.
        handler = AglCallbackHandler()
        self._patches.wrap("langchain_core.callbacks.base", "BaseCallbackManager.__init__", _adding_handler(handler))
        register_parent_resolver(handler.llm_parent)
        self._handler = handler

    def _uninstrument(self) -> None:
        self._patches.restore()
        if self._handler is not None:
            unregister_parent_resolver(self._handler.llm_parent)
            self._handler.disable()
            self._handler = None
