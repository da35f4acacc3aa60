"""Agent Lightning's ``agentlightning.emitter``: agl's emitters, its ``@reward`` decorator and the readers
that find rewards, messages and objects in a list of spans.

The emitters are agl's own (:mod:`agl.tracing.emitters`), so what they record follows agl's reward rule
(docs/rewards.md). The readers work on agl's spans (``agl.reward`` spans with ``agl.reward.value``) and also
on spans that arrive over OTLP with Agent Lightning's attributes (``agentlightning.reward.0.value``).
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypeVar, cast

from agl import semconv
from agl.tracing.emitters import (
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    operation,
    reward_number,
)
from agl.tracing.tracer import get_tracer

F = TypeVar("F", bound=Callable[..., Any])

AL_REWARD = "agentlightning.reward"  # Agent Lightning's reward attributes: agentlightning.reward.N.{name,value}
AL_MESSAGE_BODY = "agentlightning.message.body"
AL_OBJECT_JSON = "agentlightning.object.json"
AL_OBJECT_LITERAL = "agentlightning.object.literal"
SPAN_ANNOTATION = semconv.SPAN_ANNOTATION


def _emit_returned(fn_name: str, result: Any) -> None:
    """Emit what a ``@reward`` function returned: a number is a reward, None is none."""
    if result is not None:
        emit_reward(reward_number(result, f"the result of @reward function {fn_name}()", "a number or None"))


def reward(fn: F) -> F:
    """Agent Lightning's deprecated ``@reward``: the decorated function (sync or async) still returns its
    result, and a number it returns is also emitted as a reward (``agl.emit_reward``)."""
    name = getattr(fn, "__name__", "reward")
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await fn(*args, **kwargs)
            _emit_returned(name, result)
            return result

        return cast(F, async_wrapper)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        _emit_returned(name, result)
        return result

    return cast(F, wrapper)


def emit_annotation(annotation: Mapping[str, Any], propagate: bool = True) -> Dict[str, Any]:
    """Record ``annotation`` (flat span attributes: tags, links, metadata) as an ``agl.annotation`` span;
    returns the attributes. ``propagate=False`` records nothing, as in Agent Lightning."""
    attributes = dict(annotation)
    if propagate:
        with get_tracer().span(SPAN_ANNOTATION, "annotation", attributes):
            pass
    return attributes


def _attributes(span: Any) -> Mapping[str, Any]:
    """A span's attributes: agl's ``Span``, an OpenTelemetry span or a dict with ``attributes``."""
    attributes = span.get("attributes") if isinstance(span, Mapping) else getattr(span, "attributes", None)
    return attributes or {}


def get_rewards_from_span(span: Any) -> List[Dict[str, Any]]:
    """The span's reward dimensions as ``[{"name": ..., "value": ...}]``, the primary first; [] for none."""
    attributes = _attributes(span)
    value = attributes.get(semconv.REWARD_VALUE)
    if value is not None:
        primary = str(attributes.get(semconv.REWARD_PRIMARY, "primary"))
        dimensions = json.loads(attributes.get(semconv.REWARD_DIMENSIONS) or "{}")
        others = [{"name": k, "value": float(v)} for k, v in dimensions.items() if k != primary]
        return [{"name": primary, "value": float(value)}, *others]
    found: List[Dict[str, Any]] = []
    while f"{AL_REWARD}.{len(found)}.value" in attributes:
        index = len(found)
        found.append(
            {
                "name": attributes.get(f"{AL_REWARD}.{index}.name"),
                "value": float(attributes[f"{AL_REWARD}.{index}.value"]),
            }
        )
    return found


def get_reward_value(span: Any) -> Optional[float]:
    """The span's primary reward, or None if it is no reward span."""
    rewards = get_rewards_from_span(span)
    return rewards[0]["value"] if rewards else None


def is_reward_span(span: Any) -> bool:
    return get_reward_value(span) is not None


def find_reward_spans(spans: Sequence[Any]) -> List[Any]:
    """The reward spans among ``spans``, in their order."""
    return [span for span in spans if is_reward_span(span)]


def find_final_reward(spans: Sequence[Any]) -> Optional[float]:
    """The reward that counts for the rollout: the last episode reward (the one ``rollout()`` returned, else
    the last one emitted outside a step, docs/rewards.md), else the last reward of any kind; None if none.
    ``spans`` in store order (``store.query_spans(rollout_id)``)."""
    rewards = find_reward_spans(spans)
    episode = [s for s in rewards if _attributes(s).get(semconv.REWARD_SCOPE) == "episode"]
    chosen = episode or rewards
    return get_reward_value(chosen[-1]) if chosen else None


def get_message_value(span: Any) -> Optional[str]:
    """The text of an ``agl.emit_message`` span, else None."""
    attributes = _attributes(span)
    body = attributes.get(semconv.MESSAGE_BODY, attributes.get(AL_MESSAGE_BODY))
    return None if body is None else str(body)


def get_object_value(span: Any) -> Any:
    """The object an ``agl.emit_object`` span recorded (decoded from its JSON), else None."""
    attributes = _attributes(span)
    if AL_OBJECT_LITERAL in attributes:
        return attributes[AL_OBJECT_LITERAL]
    recorded = attributes.get(semconv.OBJECT_JSON, attributes.get(AL_OBJECT_JSON))
    if recorded is None:
        return None
    return json.loads(recorded) if isinstance(recorded, str) else recorded


__all__ = [
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "operation",
    "reward",
]
