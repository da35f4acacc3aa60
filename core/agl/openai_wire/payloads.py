"""What the OpenAI instrumentation records: request and response objects of the ``openai`` SDK as attributes.

Everything is handed to the tracer as *deferred* attributes (``Tracer.set_deferred``): scalars go in as
they are, skipping OpenTelemetry's per-attribute validation on the caller's thread, and what costs per
token or per message (JSON, walking pydantic models, logprob lists) is only evaluated on the writer
thread: plain references (token id lists, message list snapshots) and callables the writer calls
(building a chat message from Responses items, collecting logprobs). The caller pays a few microseconds
whatever the length of the conversation. Only the finish reasons are returned for the span itself,
because a deferred list of strings would be stored as a JSON string instead of a list.

Token ids follow vLLM's ``return_token_ids``: ``prompt_token_ids`` on the response (chat: on the first
stream chunk), ``token_ids`` on each chat choice (chat stream: per chunk, for its delta), and
``prompt_token_ids``/``response_token_ids`` on a Responses API response, ``prompt_token_ids`` and
``token_ids`` on each choice of a (legacy) Completions API response (streamed: ``prompt_token_ids`` on the
first chunk's choice). agl's policy server also puts the policy version that answered in a top-level
``agl_resources_version`` (chat streams: on every chunk).
"""

from __future__ import annotations

import collections.abc
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from agl import semconv
from agl.openai_wire.apis import (
    CHAT,
    COMPLETIONS,
    LOGPROBS_INCLUDE,
    RESOURCES_VERSION_FIELD,
    RESPONSES,
    is_int,
    is_number,
)
from agl.openai_wire.chat_completions import assistant_message, tool_call
from agl.openai_wire.logprobs import carries_logprobs, chat_logprob_values, output_text_logprobs
from agl.openai_wire.sampling import TOKEN_LIMIT_NAMES
from agl.openai_wire.stops import stop_sequences
from agl.tracing.encoding import Computed

SPAN_PREFIX = {CHAT: "chat", RESPONSES: "responses", COMPLETIONS: "text_completion"}  # span name: "<prefix> <model>"
_OPERATION = {CHAT: "chat", RESPONSES: "chat", COMPLETIONS: "text_completion"}  # gen_ai.operation.name

_COMMON_NUMBERS = (("temperature", semconv.REQUEST_TEMPERATURE), ("top_p", semconv.REQUEST_TOP_P))


# --- requests ----------------------------------------------------------------------------------------------


def request_attributes(api: str, kwargs: Mapping[str, Any], stream: bool) -> Dict[str, Any]:
    """Attributes known before the call: provider, API, model and the sampling parameters given."""
    attrs: Dict[str, Any] = {
        semconv.OPERATION_NAME: _OPERATION[api],
        semconv.PROVIDER_NAME: "openai",
        semconv.LLM_API: api,
        semconv.LLM_STREAM: stream,
    }
    model = kwargs.get("model")
    if isinstance(model, str):
        attrs[semconv.REQUEST_MODEL] = model
    for key, attr in _COMMON_NUMBERS:
        value = kwargs.get(key)
        if is_number(value):
            attrs[attr] = value
    for key in TOKEN_LIMIT_NAMES[api]:
        value = kwargs.get(key)
        if is_number(value):
            attrs[semconv.REQUEST_MAX_TOKENS] = value
            break
    stop = stop_sequences(kwargs.get("stop"))
    if stop:
        attrs[semconv.REQUEST_STOP_SEQUENCES] = stop
    n = kwargs.get("n")  # the Responses API has no n
    choices = n if is_int(n) else None
    if api == COMPLETIONS:
        prompts = prompt_count(kwargs.get("prompt"))
        if prompts > 1:  # a batch (LangChain's OpenAI LLM sends one for generate/batch): n choices per prompt
            choices = prompts * (choices or 1)
    if choices is not None:
        attrs[semconv.REQUEST_CHOICE_COUNT] = choices
    return attrs


def prompt_count(prompt: Any) -> int:
    """How many prompts a Completions API request holds: text or token ids are one, a list of them several."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple)):
        return len(prompt)
    return 1


def add_request_payloads(api: str, call_kwargs: Dict[str, Any], deferred: Dict[str, Any]) -> None:
    """Input messages and tool definitions, snapshotted as they are at call time.

    Agents append to their message list after the call returns; a shallow copy keeps what was sent. A
    one-shot iterable (generator) is materialized and the list sent instead, so the SDK still sees it all.
    Responses API input is recorded as ``{"instructions", "input"}`` (see docs/semconv.md); a Completions
    API prompt (text, or token ids: a tuple, which the garbage collector stops tracking) as ``agl.llm.prompt``.
    """
    if api == CHAT:
        messages = _snapshot(call_kwargs, "messages")
        if messages is not None:
            deferred[semconv.INPUT_MESSAGES] = messages
    elif api == COMPLETIONS:
        prompt = one_prompt(call_kwargs.get("prompt"))
        if isinstance(prompt, str):
            deferred[semconv.LLM_PROMPT] = prompt
        elif isinstance(prompt, (list, tuple)) and prompt and is_int(prompt[0]) and is_int(prompt[-1]):
            deferred[semconv.LLM_PROMPT] = tuple(prompt)  # the ends stand for the whole (no per-id work here)
        return
    else:
        source = call_kwargs.get("input")
        instructions = call_kwargs.get("instructions")
        deferred[semconv.INPUT_MESSAGES] = {
            "instructions": instructions if isinstance(instructions, str) else None,
            "input": source if isinstance(source, str) else _snapshot(call_kwargs, "input"),
        }
    tools = _snapshot(call_kwargs, "tools")
    if tools:
        deferred[semconv.TOOL_DEFINITIONS] = tools


def one_prompt(prompt: Any) -> Any:
    """A Completions API prompt without the one-element batch around it (LangChain's ``OpenAI`` LLM sends
    ``[text]``); several prompts stay a list (a batch: only choice 0's ids are recorded, and the request's
    choice count says so, as for ``n > 1``)."""
    if isinstance(prompt, (list, tuple)) and len(prompt) == 1 and isinstance(prompt[0], (str, list, tuple)):
        return prompt[0]
    return prompt


def logprobs_requested(api: str, kwargs: Mapping[str, Any]) -> bool:
    """Whether the response will carry logprobs worth recording (decided once, before the call)."""
    if api == CHAT:
        return kwargs.get("logprobs") is True
    if api == COMPLETIONS:  # an int (0: the sampled tokens only); true is how agl's server reads the chat spelling
        logprobs = kwargs.get("logprobs")
        return logprobs is True or is_int(logprobs)
    include = kwargs.get("include")
    return isinstance(include, (list, tuple)) and LOGPROBS_INCLUDE in include


def _snapshot(call_kwargs: Dict[str, Any], key: str) -> Optional[List[Any]]:
    value = call_kwargs.get(key)
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, collections.abc.Iterable) and not isinstance(value, (str, bytes, collections.abc.Mapping)):
        materialized = list(value)
        call_kwargs[key] = materialized
        return list(materialized)
    return None


# --- responses ---------------------------------------------------------------------------------------------


def chat_completion_attributes(completion: Any, deferred: Dict[str, Any]) -> List[str]:
    """Record a non-streamed ``ChatCompletion`` (token ids and logprobs of its first choice).

    Logprobs are recorded whenever the response has them, as from a stream: also when a proxy asked for them
    rather than the agent (agl's LLM proxy in front of vLLM does), so the trainer gets the server's logprobs
    whichever side records the call. Returns the finish reasons.
    """
    choices = completion.choices
    first = choices[0] if choices else None
    ids = (_extra(completion, "prompt_token_ids"), _extra(first, "token_ids"))
    _record_completion(completion, deferred, [choice.message for choice in choices], record_token_ids, ids)
    if first is not None and first.logprobs is not None and first.logprobs.content:
        # read now (~5 us for 200 tokens): deferred, the answer's logprob objects stayed alive until the writer
        # ran, and the collector walked them again and again meanwhile (a full collection more per 200 calls)
        deferred[semconv.RESPONSE_LOGPROBS] = tuple(chat_logprob_values(first.logprobs.content))
    return [c.finish_reason for c in choices if c.finish_reason]


def completion_attributes(completion: Any, deferred: Dict[str, Any]) -> List[str]:
    """Record a non-streamed (legacy) ``Completion``: choice texts as assistant messages, choice 0's token ids
    and logprobs (whenever it has them, as for chat). A prompt sent as token ids is the prompt, whether or not
    the server echoes it back.

    Returns the finish reasons.
    """
    choices = completion.choices
    first = choices[0] if choices else None
    messages = [{"role": "assistant", "content": choice.text} for choice in choices]
    ids = (_extra(first, "prompt_token_ids"), _extra(first, "token_ids"))
    _record_completion(completion, deferred, messages, record_completion_token_ids, ids)
    if first is not None and first.logprobs is not None and first.logprobs.token_logprobs:
        deferred[semconv.RESPONSE_LOGPROBS] = list(first.logprobs.token_logprobs)
    return [c.finish_reason for c in choices if c.finish_reason]


def _record_completion(
    completion: Any,
    deferred: Dict[str, Any],
    messages: List[Any],
    record_ids: Callable[..., None],
    ids: Tuple[Any, Any],
) -> None:
    """What a chat and a text completion record alike: id, model and usage (the Responses API names its usage
    fields apart), the output ``messages``, the token ``ids`` (prompt, response) as ``record_ids`` records
    them, and the policy version."""
    record_completion_header(completion.id, completion.model, completion.usage, deferred)
    deferred[semconv.OUTPUT_MESSAGES] = messages
    record_ids(*ids, deferred)
    record_resources_version(_extra(completion, RESOURCES_VERSION_FIELD), deferred)


def record_completion_token_ids(
    prompt_ids: Any, response_ids: Any, deferred: Dict[str, Any], complete: bool = True
) -> None:
    """``record_token_ids``, the request's own prompt ids standing in for those a server that sent the response
    ids left out (the source then stays ``absent`` for a server that sends no ids at all)."""
    if prompt_ids is None and response_ids is not None:
        prompt = deferred.get(semconv.LLM_PROMPT)
        if isinstance(prompt, tuple):
            prompt_ids = prompt
    record_token_ids(prompt_ids, response_ids, deferred, complete)


def record_response(api: str, response: Any, deferred: Dict[str, Any], with_logprobs: bool) -> List[str]:
    """Record a parsed, non-streamed response of ``api``; returns the finish reasons."""
    if api == CHAT:
        return chat_completion_attributes(response, deferred)
    if api == COMPLETIONS:
        return completion_attributes(response, deferred)
    return response_attributes(response, deferred, with_logprobs)


def response_attributes(response: Any, deferred: Dict[str, Any], with_logprobs: bool) -> List[str]:
    """Record a Responses API ``Response`` (also the final one of a stream). Returns the finish reasons.

    The Responses API has no finish reason: the status (``completed``) or why it is incomplete
    (``max_output_tokens``) stands in for it.
    """
    record_response_ids(response.id, response.model, deferred)
    usage = response.usage
    if usage is not None:
        record_usage(usage.input_tokens, usage.output_tokens, deferred)
    output = response.output
    deferred[semconv.OUTPUT_MESSAGES] = Computed(functools.partial(_responses_output_messages, output))
    record_token_ids(_extra(response, "prompt_token_ids"), _extra(response, "response_token_ids"), deferred)
    record_resources_version(_extra(response, RESOURCES_VERSION_FIELD), deferred)
    if with_logprobs or carries_logprobs(output):
        deferred[semconv.RESPONSE_LOGPROBS] = Computed(functools.partial(output_text_logprobs, output))
    incomplete = response.incomplete_details
    reason = getattr(incomplete, "reason", None) if incomplete is not None else response.status
    return [reason] if reason else []


def _extra(obj: Any, key: str) -> Any:
    """A field the SDK does not model (vLLM's token ids), kept by its pydantic models as an extra."""
    extra = getattr(obj, "model_extra", None)
    return extra.get(key) if extra else None


def record_response_ids(response_id: Optional[str], model: Optional[str], deferred: Dict[str, Any]) -> None:
    """Set when the server sent them (a deferred None would be stored as the string ``null``)."""
    if response_id is not None:
        deferred[semconv.RESPONSE_ID] = response_id
    if model is not None:
        deferred[semconv.RESPONSE_MODEL] = model


def record_completion_header(
    response_id: Optional[str], model: Optional[str], usage: Any, deferred: Dict[str, Any]
) -> None:
    """Id, model and usage of a chat or text completion, whole or streamed (the Responses API names its usage
    fields apart)."""
    record_response_ids(response_id, model, deferred)
    if usage is not None:
        record_usage(usage.prompt_tokens, usage.completion_tokens, deferred)


def record_usage(input_tokens: Optional[int], output_tokens: Optional[int], deferred: Dict[str, Any]) -> None:
    if input_tokens is not None:
        deferred[semconv.USAGE_INPUT_TOKENS] = input_tokens
    if output_tokens is not None:
        deferred[semconv.USAGE_OUTPUT_TOKENS] = output_tokens


def record_token_ids(prompt_ids: Any, response_ids: Any, deferred: Dict[str, Any], complete: bool = True) -> None:
    """Token ids go to the writer as tuples; the source says whether the server sent them.

    ``complete``: the server finished its answer. A stream that ended before (abandoned by the agent, cut by
    the server) may just not have reached its ids (a Responses stream sends them with its last event, a chat
    stream closed unread has none yet): whether the server returns ids is then unknown, so without ids no
    source is recorded rather than ``absent``, which LightningRL reads as a server that never returns them.

    A tuple of ints is dropped from the garbage collector's tracking, a list is not: thousands of queued
    lists of token ids would make every full collection on the agent's thread walk each id.
    """
    if prompt_ids is not None:
        deferred[semconv.PROMPT_TOKEN_IDS] = tuple(prompt_ids)
    if response_ids is not None:
        deferred[semconv.RESPONSE_TOKEN_IDS] = tuple(response_ids)
    if prompt_ids is not None or response_ids is not None:
        deferred[semconv.TOKEN_IDS_SOURCE] = "server"
    elif complete:
        deferred[semconv.TOKEN_IDS_SOURCE] = "absent"


def record_resources_version(version: Any, deferred: Dict[str, Any]) -> None:
    """The policy version an agl server reported (other servers send none and nothing is recorded)."""
    if is_int(version):
        deferred[semconv.RESOURCES_VERSION] = version


def _responses_output_messages(output: Sequence[Any]) -> List[Dict[str, Any]]:
    """Responses output items as one assistant message in the chat format, like the chat API records.

    Only text and function calls are kept (reasoning and hosted-tool items have no chat equivalent).
    """
    texts: List[str] = []
    calls: List[Dict[str, Any]] = []
    for item in output or ():
        kind = getattr(item, "type", None)
        if kind == "message":
            texts.extend(part.text for part in item.content if getattr(part, "type", None) == "output_text")
        elif kind == "function_call":
            calls.append(tool_call(item.call_id, item.name, item.arguments))
    return [assistant_message("".join(texts) if texts else None, calls)]


def sdk_response(api: str, data: Dict[str, Any]) -> Any:
    """A non-streamed answer's JSON as the SDK object the recording reads (built without validation: a proxy
    relays the answer as sent, whatever the SDK would think of it)."""
    if api == CHAT:
        from openai.types.chat import ChatCompletion

        return ChatCompletion.construct(**data)
    if api == COMPLETIONS:
        from openai.types import Completion

        return Completion.construct(**data)
    from openai.types.responses import Response as ResponsesResponse

    return ResponsesResponse.construct(**data)
