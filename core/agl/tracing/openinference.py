"""The attributes a span carries when agl sends it over OTLP: agl's own (OpenTelemetry GenAI ``gen_ai.*`` and
``agl.*`` names, as stored) plus the OpenInference names that Phoenix and other OpenInference viewers read to show
LLM, tool and agent spans. Added at export time only: the store keeps agl's one span format.

docs/otlp.md has the table of what maps to what.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from agl import semconv
from agl._util.chat import call_function, json_attribute, message_text, tool_calls_of
from agl.types import Span

SPAN_KIND = "openinference.span.kind"
INPUT_VALUE = "input.value"
INPUT_MIME_TYPE = "input.mime_type"
OUTPUT_VALUE = "output.value"
OUTPUT_MIME_TYPE = "output.mime_type"
LLM_MODEL_NAME = "llm.model_name"
LLM_PROVIDER = "llm.provider"
LLM_INVOCATION_PARAMETERS = "llm.invocation_parameters"
LLM_INPUT_MESSAGES = "llm.input_messages"
LLM_OUTPUT_MESSAGES = "llm.output_messages"
LLM_TOOLS = "llm.tools"
TOKEN_COUNT_PROMPT = "llm.token_count.prompt"
TOKEN_COUNT_COMPLETION = "llm.token_count.completion"
TOKEN_COUNT_TOTAL = "llm.token_count.total"
TOOL_NAME = "tool.name"
TOOL_PARAMETERS = "tool.parameters"
TOOL_CALL_ID = "tool_call.id"
AGENT_NAME = "agent.name"
SESSION_ID = "session.id"

# agl's span kind -> OpenInference's (a reward judges the run: an evaluator)
KINDS = {"llm": "LLM", "tool": "TOOL", "agent": "AGENT", "chain": "CHAIN", "reward": "EVALUATOR", "annotation": "CHAIN"}

_JSON = "application/json"
_INVOCATION = {
    semconv.REQUEST_TEMPERATURE: "temperature",
    semconv.REQUEST_TOP_P: "top_p",
    semconv.REQUEST_MAX_TOKENS: "max_tokens",
    semconv.REQUEST_CHOICE_COUNT: "n",
    semconv.REQUEST_STOP_SEQUENCES: "stop",
}


def otlp_attributes(span: Span) -> Dict[str, Any]:
    """``span``'s attributes as sent over OTLP: agl's, its rollout bookkeeping (``agl.rollout.id``,
    ``agl.attempt.id``, ``agl.sequence.id``: what agl's own ``/v1/traces`` reads back), and OpenInference's."""
    a = span.attributes
    out: Dict[str, Any] = dict(a)
    out[semconv.OTLP_ROLLOUT_ID] = span.rollout_id
    out[semconv.OTLP_ATTEMPT_ID] = span.attempt_id
    out[semconv.OTLP_SEQUENCE_ID] = span.sequence_id
    out[SESSION_ID] = span.rollout_id  # Phoenix groups a session's traces: a rollout's attempts
    out[SPAN_KIND] = KINDS.get(span.kind, "CHAIN")
    if semconv.AGENT_NAME in a:
        out[AGENT_NAME] = a[semconv.AGENT_NAME]
    if span.kind == "llm":
        out.update(_llm(a))
    elif span.kind == "tool":
        out.update(_tool(a))
    elif span.kind == "reward" and semconv.REWARD_VALUE in a:
        out[OUTPUT_VALUE] = str(a[semconv.REWARD_VALUE])
    else:
        _put_value(out, INPUT_VALUE, INPUT_MIME_TYPE, a.get(semconv.OPERATION_INPUT))
        _put_value(out, OUTPUT_VALUE, OUTPUT_MIME_TYPE, a.get(semconv.OPERATION_OUTPUT))
    return out


def _llm(a: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    model = a.get(semconv.RESPONSE_MODEL) or a.get(semconv.REQUEST_MODEL)
    if model is not None:
        out[LLM_MODEL_NAME] = model
    if semconv.PROVIDER_NAME in a:
        out[LLM_PROVIDER] = a[semconv.PROVIDER_NAME]
    parameters = {name: a[key] for key, name in _INVOCATION.items() if key in a}
    if parameters:
        out[LLM_INVOCATION_PARAMETERS] = json.dumps(parameters)
    inputs = json_attribute(a.get(semconv.INPUT_MESSAGES))
    if isinstance(inputs, list):
        out.update(_messages(LLM_INPUT_MESSAGES, inputs))
    if semconv.INPUT_MESSAGES in a:
        _put_value(out, INPUT_VALUE, INPUT_MIME_TYPE, a[semconv.INPUT_MESSAGES], is_json=inputs is not None)
    else:
        _put_value(out, INPUT_VALUE, INPUT_MIME_TYPE, a.get(semconv.LLM_PROMPT))
    outputs = json_attribute(a.get(semconv.OUTPUT_MESSAGES))
    if isinstance(outputs, list):
        out.update(_messages(LLM_OUTPUT_MESSAGES, outputs))
    _put_value(out, OUTPUT_VALUE, OUTPUT_MIME_TYPE, a.get(semconv.OUTPUT_MESSAGES), is_json=outputs is not None)
    tools = json_attribute(a.get(semconv.TOOL_DEFINITIONS))
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            out[f"{LLM_TOOLS}.{i}.tool.json_schema"] = json.dumps(tool)
    out.update(_token_counts(a))
    return out


def _token_counts(a: Dict[str, Any]) -> Dict[str, int]:
    """Usage as the server reported it; else the number of token ids recorded."""
    prompt = _count(a.get(semconv.USAGE_INPUT_TOKENS), a.get(semconv.PROMPT_TOKEN_IDS))
    completion = _count(a.get(semconv.USAGE_OUTPUT_TOKENS), a.get(semconv.RESPONSE_TOKEN_IDS))
    out: Dict[str, int] = {}
    if prompt is not None:
        out[TOKEN_COUNT_PROMPT] = prompt
    if completion is not None:
        out[TOKEN_COUNT_COMPLETION] = completion
    if prompt is not None and completion is not None:
        out[TOKEN_COUNT_TOTAL] = prompt + completion
    return out


def _count(usage: Any, ids: Any) -> Optional[int]:
    if isinstance(usage, int) and not isinstance(usage, bool):
        return usage
    return len(ids) if isinstance(ids, (list, tuple)) else None


def _messages(prefix: str, messages: List[Any]) -> Dict[str, Any]:
    """Chat messages as OpenInference's flattened ``prefix.N.message.*`` attributes, tool calls included."""
    out: Dict[str, Any] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        at = f"{prefix}.{i}.message"
        if "role" in message:
            out[f"{at}.role"] = str(message["role"])
        text = message_text(message.get("content"))
        if text:
            out[f"{at}.content"] = text
        if message.get("tool_call_id") is not None:
            out[f"{at}.tool_call_id"] = str(message["tool_call_id"])
        for j, call in enumerate(tool_calls_of(message)):
            function = call_function(call)
            call_at = f"{at}.tool_calls.{j}.tool_call"
            if call.get("id") is not None:
                out[f"{call_at}.id"] = str(call["id"])
            out[f"{call_at}.function.name"] = str(function.get("name", ""))
            arguments = function.get("arguments")
            out[f"{call_at}.function.arguments"] = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return out


def _tool(a: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if semconv.TOOL_NAME in a:
        out[TOOL_NAME] = a[semconv.TOOL_NAME]
    if semconv.TOOL_CALL_ID in a:
        out[TOOL_CALL_ID] = a[semconv.TOOL_CALL_ID]
    arguments = a.get(semconv.TOOL_CALL_ARGUMENTS)
    if arguments is not None:
        out[TOOL_PARAMETERS] = arguments if isinstance(arguments, str) else json.dumps(arguments)
    _put_value(out, INPUT_VALUE, INPUT_MIME_TYPE, arguments)
    _put_value(out, OUTPUT_VALUE, OUTPUT_MIME_TYPE, a.get(semconv.TOOL_CALL_RESULT))
    return out


def _put_value(out: Dict[str, Any], key: str, mime_key: str, value: Any, is_json: Optional[bool] = None) -> None:
    """``input.value`` / ``output.value`` and their MIME type: JSON objects and lists are marked as JSON, so viewers
    format them (``is_json``: already known, the text is not decoded again)."""
    if value is None:
        return
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    out[key] = text
    structured = text.lstrip()[:1] in ("{", "[")
    if structured and is_json is None:
        is_json = json_attribute(text) is not None
    out[mime_key] = _JSON if structured and is_json else "text/plain"
