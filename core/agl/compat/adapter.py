"""Agent Lightning's adapters (``agl.adapter``), as settings of agl's LightningRL.

Agent Lightning turns spans into triplets with an adapter object given to its Trainer
(``adapter=TracerTraceToTriplet(agent_match=...)``, or a dict of its arguments). In agl the Trainer's
``adapter`` holds the settings of :class:`agl.lightningrl.LightningRL`, which builds the training samples
from a rollout's spans. :class:`AdapterSettings` is such a dict whose settings read as attributes too
(``trainer.adapter.agent_match``); the Agent Lightning classes build one from their own arguments.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Generic, Optional, TypeVar

from agl.algorithm.apo import TraceToMessages
from agl.compat.execution import say_once
from agl.lightningrl.adapter import LightningRL

T_from = TypeVar("T_from")
T_to = TypeVar("T_to")

AL_LLM_CALL_MATCH = r"openai\.chat\.completion"  # Agent Lightning's default: a span name agl's calls do not have
_SETTINGS = frozenset(LightningRL.__init__.__kwdefaults__ or {})


class Adapter(Generic[T_from, T_to]):
    """An adapter of one's own: ``adapt(source)``. agl's algorithms do not call it; one's own algorithm may
    (``self.get_adapter()``)."""

    def __call__(self, source: T_from, /) -> T_to:
        return self.adapt(source)

    def adapt(self, source: T_from, /) -> T_to:
        raise NotImplementedError(f"{type(self).__name__} must implement adapt(self, source)")


class TraceAdapter(Adapter[Any, T_to], Generic[T_to]):
    """An adapter of agl spans (``agl.Span``)."""


class OtelTraceAdapter(Adapter[Any, T_to], Generic[T_to]):
    """An adapter of OpenTelemetry spans; agl's store holds ``agl.Span``, so such an adapter sees those."""


class AdapterSettings(Dict[str, Any], TraceAdapter[Any]):
    """The settings of agl's LightningRL (``agent_match``, ``llm_call_match``, ``credit``, ...) as a dict that
    every agl algorithm reads as it reads ``adapter={...}``, with the settings as attributes too."""

    def __getattr__(self, name: str) -> Any:
        if name in _SETTINGS:
            return self.get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; its settings: {sorted(_SETTINGS)}")

    def adapt(self, source: Any, /) -> Any:
        raise NotImplementedError(
            "agl builds training samples per rollout, not from a list of spans: "
            "agl.LightningRL.from_config(self.get_adapter()).build_batch(store, rollouts)"
        )


class TraceToTripletBase(AdapterSettings):
    """Agent Lightning's base of the span-to-triplet adapters."""


class TracerTraceToTriplet(TraceToTripletBase):
    """``agent_match`` and ``llm_call_match`` become LightningRL's. agl always repairs the trace tree, leaves
    calls made inside a reward's computation out, and credits rewards by span linkage (docs/lightningrl.md), so
    ``repair_hierarchy``, ``exclude_llm_call_in_reward`` and ``reward_match`` are accepted and named once."""

    def __init__(
        self,
        repair_hierarchy: bool = True,
        llm_call_match: str = AL_LLM_CALL_MATCH,
        agent_match: Optional[str] = None,
        exclude_llm_call_in_reward: bool = True,
        reward_match: Any = "first_occurrence",
        _skip_empty_token_spans: bool = False,
    ) -> None:
        super().__init__()
        if agent_match is not None:
            self["agent_match"] = agent_match
        if llm_call_match != AL_LLM_CALL_MATCH:  # agl selects LLM calls by span kind; a regex of one's own narrows
            re.compile(llm_call_match)
            self["llm_call_match"] = llm_call_match
        if not repair_hierarchy or not exclude_llm_call_in_reward or str(reward_match) != "first_occurrence":
            say_once(
                "triplet",
                "TracerTraceToTriplet(repair_hierarchy=, exclude_llm_call_in_reward=, reward_match=): agl's "
                "LightningRL always repairs the trace tree and credits rewards by span linkage (docs/lightningrl.md)",
            )
        if _skip_empty_token_spans:
            say_once(
                "empty-token",
                "TracerTraceToTriplet(_skip_empty_token_spans=True): a call without token ids is re-tokenized with "
                "LightningRL's tokenizer= setting, else refused with what to do",
            )


class LlmProxyTraceToTriplet(TraceToTripletBase):
    """agl's LightningRL reads the LLM calls agl's proxy records like any other spans: LightningRL's defaults."""

    def __init__(self) -> None:
        super().__init__()
        say_once("proxy", "LlmProxyTraceToTriplet: agl's LightningRL reads the proxy's LLM spans as any others")


__all__ = [
    "Adapter",
    "AdapterSettings",
    "LlmProxyTraceToTriplet",
    "OtelTraceAdapter",
    "TraceAdapter",
    "TraceToMessages",
    "TraceToTripletBase",
    "TracerTraceToTriplet",
]
