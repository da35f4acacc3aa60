"""Framework adapters' callback handlers, by framework, for code that asks the tracer for one (Agent Lightning's
``tracer.get_langchain_handler()``). The adapter fills this when imported: the tracer sits below the adapters."""

from __future__ import annotations

from typing import Any, Callable, Dict

callback_handlers: Dict[str, Callable[[], Any]] = {}


def register_callback_handler(framework: str, handler: Callable[[], Any]) -> None:
    """Let the tracer's ``get_<framework>_handler()`` return ``handler()``."""
    callback_handlers[framework] = handler
