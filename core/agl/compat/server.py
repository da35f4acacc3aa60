"""Agent Lightning's legacy v0.1 server and client (``AgentLightningServer``, ``AgentLightningClient``,
``DevTaskLoader``): importable, so old scripts load, but using them says what replaces them in agl.

Agent Lightning v0.2 replaced this HTTP task server by the store; agl has the store only: a store served
over HTTP (``agl store serve``, ``agl.LightningStoreServer``) that runners reach by URL.
"""

from __future__ import annotations

from typing import Any, ClassVar

from agl.compat.aliases import unavailable


class _Legacy:
    """A v0.1 class: constructing it raises NotImplementedError naming what agl offers instead."""

    instead: ClassVar[str] = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(unavailable(type(self).__name__, self.instead))


class AgentLightningServer(_Legacy):
    instead = "serve a store with `agl store serve` (or agl.LightningStoreServer) and enqueue rollouts into it"


class AgentLightningClient(_Legacy):
    instead = "runners reach a served store by URL: agl.LightningStoreClient(url) or `agl runner --store URL`"


class DevTaskLoader(_Legacy):
    instead = "run tasks locally with agl.Trainer(...).dev(agent, tasks)"


__all__ = ["AgentLightningClient", "AgentLightningServer", "DevTaskLoader"]
