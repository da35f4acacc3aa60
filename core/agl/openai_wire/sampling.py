"""The sampling settings a trainer imposes on requests it did not write (shared by ``PolicyServer`` and
``LLMProxy``).

A trainer publishes its sampling parameters in the LLM resource, but an agent may not pass them on (the
README's agent does not): the serving side then fills them into each request that leaves them out, so the
agent is sampled the way the trainer computes log-probs whatever its code does. Light: no torch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Collection, Dict, FrozenSet, Mapping, Tuple

from agl.openai_wire.apis import CHAT, COMPLETIONS, RESPONSES, is_int

# The names a request may give its token limit: chat (both), completions, Responses API.
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Per API, in the order they are read (the first one given counts).
TOKEN_LIMIT_NAMES = {
    CHAT: ("max_completion_tokens", "max_tokens"),
    RESPONSES: ("max_output_tokens",),
    COMPLETIONS: ("max_tokens",),
}


def with_defaults(body: Dict[str, Any], defaults: Mapping[str, Any], keys: Collection[str]) -> Dict[str, Any]:
    """``body`` with ``defaults`` for those of ``keys`` it leaves out (a ``None`` value counts as left out;
    a token limit of any name counts as ``max_tokens`` given). A new dict when anything is added."""
    given = {k for k, v in body.items() if v is not None}
    if given.intersection(TOKEN_LIMITS):
        given.add("max_tokens")
    missing = {k: v for k, v in defaults.items() if k in keys and k not in given and v is not None}
    return {**body, **missing} if missing else body


def with_token_cap(body: Dict[str, Any], api: str, cap: int) -> Dict[str, Any]:
    """``body`` (a new dict) with each token limit it gives lowered to ``cap``, or ``cap`` as its ``max_tokens``
    (Responses: ``max_output_tokens``) when it gives none. A chat or Completions body is read with both chat
    names."""
    names = TOKEN_LIMIT_NAMES[RESPONSES] if api == RESPONSES else TOKEN_LIMIT_NAMES[CHAT]
    given = [n for n in names if is_int(body.get(n))]
    if given:
        return {**body, **{n: min(body[n], cap) for n in given}}
    return {**body, ("max_output_tokens" if api == RESPONSES else "max_tokens"): cap}


def openai_arguments(sampling: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``sampling`` split into what the OpenAI SDK's ``chat.completions.create`` takes as arguments and the
    rest (vLLM's ``top_k``, ``min_p``...), which the SDK refuses as keywords: a trainer publishes only the
    first in ``llm.sampling_parameters`` (agents pass them to ``create()`` or a framework's model class) and
    has its server fill in the rest; a client of its own sends the rest in ``extra_body``."""
    own = _chat_arguments()
    return ({k: v for k, v in sampling.items() if k in own}, {k: v for k, v in sampling.items() if k not in own})


@functools.lru_cache(maxsize=1)
def _chat_arguments() -> FrozenSet[str]:
    from openai.resources.chat.completions import Completions

    return frozenset(inspect.signature(Completions.create).parameters) - {"self", "messages", "model", "extra_body"}


__all__ = ["TOKEN_LIMITS", "TOKEN_LIMIT_NAMES", "openai_arguments", "with_defaults", "with_token_cap"]
