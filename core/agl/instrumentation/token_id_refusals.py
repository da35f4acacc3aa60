"""Servers that refuse ``return_token_ids``: the call goes again as the agent wrote it, and is remembered.

Inside a training rollout agl asks every OpenAI call for token ids (vLLM's ``return_token_ids``), because
it cannot know in advance which calls reach the policy. The policy's servers (``agl serve``, vLLM, agl's
proxy) answer with the ids. But agents also call hosted models the rollout does not train — an LLM judge
computing the reward, a summarizer tool — and api.openai.com, Azure OpenAI or TGI reject the unknown
parameter: a 400 ("Unrecognized request argument supplied: return_token_ids") or a 422 that names it.
Without care the agent's judge would fail only while it is being trained.

So when a call agl added the flag to is refused that way, agl sends it again at once without the flag and
the user's code sees the answer it gets without agl; the server (its ``base_url``) is remembered for the
rest of the process, so later calls to it go out without the flag, and a warning names it once. Such calls'
spans say ``agl.llm.token_ids_source = "refused"``: the server cannot return token ids, so it is not a policy
agl trains, and LightningRL leaves these calls out instead of failing the batch (unless it re-tokenizes; see
``agl.lightningrl.transitions``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Set

from agl.openai_wire.apis import TOKEN_IDS_REQUEST

logger = logging.getLogger("agl.instrumentation")

_REFUSAL_STATUS = (400, 422)  # OpenAI and Azure: 400; servers with strict schemas (TGI, FastAPI): 422

_lock = threading.Lock()
_refusing: Set[str] = set()


def server_of(resource: Any) -> Optional[str]:
    """The ``base_url`` of the client behind an SDK resource (``client.chat.completions``), or None."""
    base_url = getattr(getattr(resource, "_client", None), "base_url", None)
    return str(base_url) if base_url is not None else None


def refuses(resource: Any) -> bool:
    """Whether the server behind ``resource`` refused ``return_token_ids`` earlier in this process (free
    while none has: reading a client's ``base_url`` as a string costs microseconds on every call)."""
    return bool(_refusing) and server_of(resource) in _refusing


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is a server's rejection of the ``return_token_ids`` parameter itself.

    The parameter's name must appear in the error: a 400 for anything else (a bad message list, a context
    too long) is the agent's own error and goes to it unchanged, not retried.
    """
    if getattr(error, "status_code", None) not in _REFUSAL_STATUS:
        return False
    return TOKEN_IDS_REQUEST in f"{error} {getattr(error, 'body', '')}"


def remember(server: Optional[str]) -> None:
    """Note that ``server`` refuses ``return_token_ids``; the first time, say so once."""
    if server is None:
        return
    with _lock:
        if server in _refusing:
            return
        _refusing.add(server)
    logger.warning(
        "the server at %s refused return_token_ids (agl asks every call in a training rollout for token ids): "
        "agl sent the call again without it and will not ask this server again in this process. Its calls "
        "have no token ids, and LightningRL leaves them out of training unless it re-tokenizes (tokenizer=): "
        "right for an LLM judge or another model the agent calls; the policy you train needs a server that "
        "returns token ids (agl serve, vLLM)",
        server,
    )


def forget_all() -> None:
    """Forget every refusal (tests; a server that was replaced by one that returns ids)."""
    with _lock:
        _refusing.clear()
