"""Reading chat messages as spans record them (``gen_ai.input.messages`` / ``gen_ai.output.messages``: JSON text of
OpenAI-style messages): shared by LightningRL, the OTLP export's attribute mapping and ``agl inspect --text``."""

from __future__ import annotations

import json
from typing import Any, Dict, List


def json_attribute(value: Any) -> Any:
    """A span attribute that holds JSON text, decoded (None if it is not JSON); any other value as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def tool_calls_of(message: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The tool calls of an assistant message in the chat format (``[{"id", "function": {...}}]``)."""
    calls = message.get("tool_calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def call_function(call: Dict[str, Any]) -> Dict[str, Any]:
    """A chat tool call's ``function`` (name, arguments); {} when it has none."""
    function = call.get("function")
    return function if isinstance(function, dict) else {}


def message_text(content: Any) -> str:
    """A message's content as text: a string as it is, the text parts of a list of parts joined, anything
    else (an image part, say) as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [str(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts and len(texts) == len(content):
            return "\n".join(texts)
    return json.dumps(content, default=str)
