"""The SDK's ``with_raw_response`` / ``with_streaming_response`` views, rebuilt while agl is instrumented.

Why: each resource object (``client.chat.completions``, ``client.responses``...) builds such a view once, in a
``functools.cached_property``, and the view binds ``create`` as it is at that moment. LangChain's ChatOpenAI
and LiteLLM call every request through ``with_raw_response.create``, so a client that made one call before
``agl.instrument()`` (a warm-up call in a notebook, then ``trainer.dev``) kept calling the unhooked method
and its calls went unrecorded, without a word, while a client first used after it was traced.

While instrumented, :class:`CurrentView` sits on the class over the ``cached_property``. It is a data
descriptor, so it wins over the view the ``cached_property`` left in an instance's ``__dict__``, and it
builds (and caches, under a key of this instrumentation) a view of its own with the SDK's own factory, which
binds the hooked ``create``. Uninstrumenting puts the ``cached_property`` back: an instance then sees the
view it had before, or builds a new one from the unhooked method.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, List, Optional, Tuple

logger = logging.getLogger("agl.instrumentation")

VIEWS = ("with_raw_response", "with_streaming_response")
_generations = itertools.count(1)


class CurrentView:
    """A view of the resource built from its methods as they are now (see the module docstring)."""

    def __init__(self, original: functools.cached_property[Any], name: str, generation: int) -> None:
        self.original = original
        self.key = f"_agl_{name}_{generation}"

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        if instance is None:
            return self
        cache = instance.__dict__
        view = cache.get(self.key)
        if view is None:
            view = cache[self.key] = self.original.func(instance)
        return view

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.key] = value


def hook_views(cls: type) -> List[Tuple[type, str, CurrentView]]:
    """Put a :class:`CurrentView` over each cached view of ``cls``; returns what :func:`unhook_views` needs."""
    hooked = []
    generation = next(_generations)
    for name in VIEWS:
        original = vars(cls).get(name)
        if isinstance(original, functools.cached_property):
            view = CurrentView(original, name, generation)
            setattr(cls, name, view)
            hooked.append((cls, name, view))
    return hooked


def unhook_views(hooked: List[Tuple[type, str, CurrentView]]) -> None:
    for cls, name, view in reversed(hooked):
        if vars(cls).get(name) is view:
            setattr(cls, name, view.original)
        else:
            logger.warning("agl cannot unhook %s.%s: something else replaced it since", cls.__name__, name)
