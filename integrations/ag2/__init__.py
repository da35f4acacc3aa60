"""agl adapter for AG2: both lines published as the ``ag2`` distribution, whichever is installed.

- AG2 1.x (``import ag2``: ``Agent``, ``await agent.ask(...)``): agl adds its own middleware to every
  turn (see :mod:`._middleware`): an ``agent`` span per turn named ``Agent(name)``, a ``tool`` span per
  tool run, and a failed ``tool`` span per call of a tool the agent lacks (answered with no middleware).
- AG2 classic, 0.9 to 0.14 (``import autogen``: ``ConversableAgent``, ``initiate_chat``): wrapt wrappers
  on ``ConversableAgent`` (see :mod:`._wrappers`): an ``agent`` span per reply named ``agent.name``, a
  ``tool`` span per function executed, a ``chain`` span per ``initiate_chat``.

The two lines cannot be installed together (same distribution name) and their version ranges touch, so
one requirement covers both; the installed version decides which module is hooked. Nothing of AG2 is
imported until ``instrument()``.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, ClassVar, Tuple

from agl._util.safety import report_internal_error
from agl.instrumentation.base import Instrumentor, requirement_problem
from agl.instrumentation.framework import PatchSet

logger = logging.getLogger("agl.instrumentation")

__all__ = ["AG2Instrumentor"]


class AG2Instrumentor(Instrumentor):
    """Hooks AG2 1.x through its middleware, or AG2 classic through ``ConversableAgent`` wrappers."""

    name: ClassVar[str] = "ag2"
    instruments: ClassVar[Tuple[str, ...]] = ("ag2>=0.9,<2",)

    def __init__(self) -> None:
        super().__init__()
        self._patches = PatchSet()

    def _instrument(self, **kwargs: Any) -> None:
        version = importlib.metadata.version("ag2")
        try:
            if requirement_problem("ag2<1") is None:  # classic
                from agl.integrations.ag2 import _wrappers as line
            else:
                from agl.integrations.ag2 import _middleware as line
            missing = line.hook(self._patches)
        except Exception as exc:  # noqa: BLE001 - a broken hook leaves AG2 as it was, never the user's program
            self._patches.restore()
            report_internal_error("ag2.instrument", exc)
            return
        if missing:
            logger.warning("agl: AG2 %s has no %s; what runs there is not traced", version, ", ".join(missing))

    def _uninstrument(self) -> None:
        self._patches.restore()
