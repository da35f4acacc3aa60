"""The Chat Completions API's objects: a message's text, tool calls, the assistant message, a choice and a
stream chunk's choice, usage. Shared by what serves them (the policy server, the fake server) and what
records them (the client hook and the proxy, through :mod:`agl.openai_wire.payloads` and
:mod:`~agl.openai_wire.streams`)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional


def message_text(content: Any) -> str:
    """The text of a chat/responses message content, which is a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def tool_call(call_id: Optional[str], name: Optional[str], arguments: Optional[str]) -> Dict[str, Any]:
    """A chat tool call (``arguments``: the JSON text as the model wrote it)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(content: Optional[str], tool_calls: List[Dict[str, Any]], **fields: Any) -> Dict[str, Any]:
    """An assistant message: ``content``, then ``fields`` (what a server adds: ``refusal``...), then the tool
    calls if there are any."""
    message: Dict[str, Any] = {"role": "assistant", "content": content, **fields}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def choice(message: Dict[str, Any], logprobs: Any, finish_reason: Optional[str], **fields: Any) -> Dict[str, Any]:
    """Choice 0 of a ``chat.completion`` (``fields``: vLLM's ``token_ids``...)."""
    return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason, **fields}


def chunk_choice(delta: Dict[str, Any], logprobs: Any, finish_reason: Optional[str], **fields: Any) -> Dict[str, Any]:
    """Choice 0 of a ``chat.completion.chunk``."""
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **fields}


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, Any]:
    """The usage of a chat or (legacy) text completion."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
