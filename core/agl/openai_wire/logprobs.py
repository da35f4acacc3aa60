"""Logprobs on the wire: the entries a server writes per token (chat and Responses: text, logprob, UTF-8 bytes,
top alternatives; the legacy Completions API: parallel lists with text offsets), and the sampled tokens'
logprobs read back out of the SDK's objects."""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# --- writing -----------------------------------------------------------------------------------------------


def logprob_entry(
    token: str, logprob: float, raw: Sequence[int], alternatives: Optional[List[Dict[str, Any]]] = None
) -> Dict[str, Any]:
    """One token's entry as chat and Responses carry it; a sampled token's lists its ``top_logprobs``
    (``alternatives``, entries without a list of their own)."""
    entry: Dict[str, Any] = {"token": token, "logprob": logprob, "bytes": list(raw)}
    if alternatives is not None:
        entry["top_logprobs"] = alternatives
    return entry


def token_logprobs(tokenizer: Any, tokens: Sequence[Any]) -> List[Dict[str, Any]]:
    """Sampled tokens' entries (``token_id``, ``logprob``, ``top_logprobs`` as ``(id, logprob)`` pairs each),
    the text and bytes from ``tokenizer``."""
    return [
        _entry(tokenizer, t.token_id, t.logprob, [_entry(tokenizer, i, lp) for i, lp in t.top_logprobs]) for t in tokens
    ]


def _entry(
    tokenizer: Any, token_id: int, logprob: float, alternatives: Optional[List[Dict[str, Any]]] = None
) -> Dict[str, Any]:
    text = tokenizer.decode([token_id])
    return logprob_entry(text, logprob, token_bytes(tokenizer, token_id, text), alternatives)


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The token's own bytes, so that joining a response's ``bytes`` rebuilds its UTF-8 text (OpenAI's purpose
    for the field). ``text`` (the token decoded alone) serves unless it holds U+FFFD: the token is part of a
    multi-byte character, whose decoded text is the replacement character, not its bytes. Those come from
    the vocabulary piece: byte-level BPE (GPT-2, SmolLM2, Qwen, Llama 3) spells each byte as one character,
    SentencePiece writes a lone byte as ``<0xNN>``."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        decoder = _byte_decoder()
        if piece and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
    return text.encode("utf-8")  # no byte-level view of this vocabulary: what it decodes to


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


def completion_logprobs(
    tokens: List[str], logprobs: List[float], top: List[Optional[Dict[str, float]]], offset: int
) -> Tuple[Dict[str, Any], int]:
    """The legacy Completions API's logprobs object: parallel lists over the tokens, ``text_offset`` counting
    the characters of the tokens before (each token's own text), from ``offset`` on. Returns it and the
    offset of the next token (a stream's chunks continue each other's offsets)."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def top_by_text(alternatives: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """Alternatives keyed by their text, as the legacy ``top_logprobs`` has them; where two tokens decode
    alike, the more likely one (listed first)."""
    top: Dict[str, float] = {}
    for alternative in alternatives:
        top.setdefault(alternative["token"], alternative["logprob"])
    return top


# --- reading -----------------------------------------------------------------------------------------------


def chat_logprob_values(content: Sequence[Any]) -> List[float]:
    """The sampled tokens' logprobs of a chat choice's (or chunk's) ``logprobs.content``."""
    return [token.logprob for token in content]


def logprob_of(entry: Any) -> float:
    """A Responses output-text logprob: a model on current SDKs, a plain dict on openai < 1.91."""
    return entry["logprob"] if isinstance(entry, dict) else entry.logprob


def output_text_logprobs(output: Sequence[Any]) -> List[float]:
    """The sampled tokens' logprobs of a Responses answer: those of its messages' text parts, in order."""
    values: List[float] = []
    for item in output or ():
        if getattr(item, "type", None) != "message":
            continue
        for part in item.content:
            values.extend(logprob_of(lp) for lp in getattr(part, "logprobs", None) or ())
    return values


def carries_logprobs(output: Sequence[Any]) -> bool:
    """Whether a Responses answer holds logprobs although the request did not ``include`` them: a server
    that fills in its own default (agl's policy server under a trainer: ``logprobs: true``) or honours
    ``top_logprobs`` alone. A few attribute reads; the list itself is read on the writer."""
    return any(
        getattr(part, "logprobs", None)
        for item in output or ()
        if getattr(item, "type", None) == "message"
        for part in item.content or ()
    )
