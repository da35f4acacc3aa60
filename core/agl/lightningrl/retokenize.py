"""Re-tokenizing an LLM call from its recorded messages, for servers that return no token ids.

Opt-in only (``LightningRL(tokenizer=...)``) and counted in the batch report, because the ids are a
reconstruction: a chat template or tokenizer that differs from the server's by one token gives a sample
the model never produced. Exact ids come from the server (``agl serve``, vLLM with ``return_token_ids``).

What is encoded:

- prompt: the chat template applied to ``gen_ai.input.messages`` (and ``gen_ai.tool.definitions``) with
  the generation prompt;
- response, with a Hugging Face tokenizer (its ``apply_chat_template`` takes ``add_generation_prompt``):
  the text the template adds for the recorded assistant message, i.e. ``template(messages + [answer])``
  minus the prompt text, up to the template's end-of-turn token (its last special token): kept only when
  the model sampled it (:func:`sampled_end_token`), as the model must learn to stop and a server's ids end
  with it then; dropped when the call was cut (finish reason ``length``), ended on one of the request's
  ``stop`` strings (the server's ids end with the tokens of the stop string, not an end token: training one
  would teach a token the model never produced), or is a stream abandoned or truncated mid-answer. What the
  template writes after it (the newline between turns) is never sampled, so it is never a response token;
- response, with any other tokenizer (only ``apply_chat_template(messages, tools)`` and ``encode(text)``,
  like :class:`agl.testing.FakeTokenizer`): the answer's content, then one line per tool call
  ``{"name": <name>, "arguments": <arguments as sent>}``.

Responses API input (``{"instructions", "input"}``) and its flat function tools become chat messages and
chat tools by the policy server's own mapping (:mod:`agl.openai_wire.responses`), so a conversation renders
the same whichever API carried it: instructions as a system message, message items by role, a turn's
function calls joined to its assistant message, their outputs as tool messages.

A (legacy) Completions API call has no template: the prompt is ``agl.llm.prompt`` as sent (token ids as
they are; text through the tokenizer with its special tokens, as vLLM does), the response the text, plus
the tokenizer's end-of-sequence token when the call finished with ``stop`` and the request had no ``stop``
strings (with them, a stop string cannot be told from EOS afterwards, and an EOS the model did not sample
is worse for training than a missing one).

Messages are normalised before a Hugging Face template sees them, as vLLM does: a missing or null
``content`` becomes ``""`` (an assistant turn with only tool calls has none, and templates concatenate it),
null fields are dropped, and tool call arguments that parse as a JSON object are passed as that object.

A span that cannot be re-tokenized raises :class:`RetokenizeError` with a ``reason``, and LightningRL skips
it under that reason (one warning per span), so one span never sinks a batch:

- :data:`SKIP_RETOKENIZE_FAILED`: no recorded input messages or prompt, or the chat template or tokenizer
  raised on them;
- :data:`SKIP_TOOL_CALLS_NOT_RENDERED`: the answer has tool calls and the chat template writes the same text
  with and without them (SmolLM2's template only writes ``content``), so the response would be empty or
  the text alone, not what the model produced.

A prompt whose history holds tool calls that the template drops is still encoded (it is what such a
template gives), with one warning per Retokenizer.

agl's own server renders tools and tool calls in its own format (:mod:`agl.openai_wire.chat_format`), not the
tokenizer's template, and always returns token ids, so its calls never need re-tokenizing; the
re-tokenizer follows the tokenizer's template, which is what a server that returns no ids (vLLM without
``return_token_ids``, llama.cpp, Ollama) applies.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agl import semconv
from agl.lightningrl.links import json_attribute, output_message, tool_calls_of
from agl.openai_wire import responses
from agl.openai_wire.apis import COMPLETIONS, RESPONSES, BadRequest
from agl.openai_wire.chat_completions import message_text
from agl.openai_wire.chat_format import assistant_text, call_text
from agl.types import Span

logger = logging.getLogger("agl.lightningrl")

#: skip reason: the span lacks what re-tokenization needs, or the template / tokenizer failed on it
SKIP_RETOKENIZE_FAILED = "cannot re-tokenize"
#: skip reason: the answer's tool calls are not written by the tokenizer's chat template
SKIP_TOOL_CALLS_NOT_RENDERED = "tool calls the chat template does not render"
TOOL_CALLS_NOT_RENDERED_ADVICE = (
    "the tokenizer's chat template does not render tool calls: pass token ids from the server, "
    "or a tokenizer whose template does"
)


class RetokenizeError(ValueError):
    """The span cannot be re-tokenized; ``reason`` is the skip reason the batch report counts it under."""

    def __init__(self, message: str, reason: str = SKIP_RETOKENIZE_FAILED) -> None:
        super().__init__(message)
        self.reason = reason


class Retokenizer:
    """Wraps a tokenizer with ``apply_chat_template`` and ``encode`` (a HF tokenizer, FakeTokenizer, ...)."""

    def __init__(self, tokenizer: Any) -> None:
        for method in ("apply_chat_template", "encode"):
            if not callable(getattr(tokenizer, method, None)):
                raise TypeError(
                    f"tokenizer must have apply_chat_template() and encode() (e.g. a Hugging Face tokenizer); "
                    f"{type(tokenizer).__name__} has no {method}()"
                )
        self.tokenizer = tokenizer
        self._hf_template = "add_generation_prompt" in _parameters(tokenizer.apply_chat_template)
        eos = getattr(tokenizer, "eos_token_id", None)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or ()) | (
            {eos} if isinstance(eos, int) else set()
        )
        self._encode_kwargs = (
            {"add_special_tokens": False} if "add_special_tokens" in _parameters(tokenizer.encode) else {}
        )
        self._renders_history_calls: Optional[bool] = None  # unknown until a prompt's history has tool calls

    def ids(self, span: Span) -> Tuple[List[int], List[int]]:
        """(prompt ids, response ids) of the llm span, from its recorded messages.

        Raises :class:`RetokenizeError` (with the skip ``reason``) for a span that cannot be re-tokenized,
        whatever failed: the template or tokenizer raising is wrapped, never passed on as it is."""
        try:
            if span.attributes.get(semconv.LLM_API) == COMPLETIONS:
                return self._completion_ids(span)
            return self._chat_ids(span)
        except RetokenizeError:
            raise
        except Exception as exc:  # a template's jinja2 error, a tokenizer's TypeError, ...: this span only
            raise RetokenizeError(
                f"span {span.span_id}: {type(exc).__name__} from the tokenizer or its chat template: {exc}"
            ) from exc

    def _chat_ids(self, span: Span) -> Tuple[List[int], List[int]]:
        messages = chat_messages(span)
        tools = json_attribute(span.attributes.get(semconv.TOOL_DEFINITIONS)) or None
        if tools and span.attributes.get(semconv.LLM_API) == RESPONSES:
            tools = responses.chat_tools(tools) or None
        answer = output_message(span)
        if self._hf_template:
            messages = [_normalised(m) for m in messages]
        prompt_text = self._template(messages, tools, generation_prompt=True)
        if self._hf_template:
            self._check_history_calls(span, messages, tools, prompt_text)
        if self._hf_template and answer:
            answer = _normalised(answer)
            full_text = self._template(messages + [answer], tools, generation_prompt=False)
            if tool_calls_of(answer):
                without = {k: v for k, v in answer.items() if k != "tool_calls"}
                if self._template(messages + [without], tools, generation_prompt=False) == full_text:
                    raise RetokenizeError(
                        f"span {span.span_id}: its answer has tool calls, and {TOOL_CALLS_NOT_RENDERED_ADVICE}",
                        SKIP_TOOL_CALLS_NOT_RENDERED,
                    )
            if full_text.startswith(prompt_text):
                answer_ids = self._encode(full_text[len(prompt_text) :])
                return self._encode(prompt_text), self._end_of_turn(answer_ids, sampled_end_token(span))
        return self._encode(prompt_text), self._encode(render_answer(answer))

    def _check_history_calls(
        self, span: Span, messages: List[Dict[str, Any]], tools: Optional[List[Any]], prompt_text: str
    ) -> None:
        """Warn once if the template drops the tool calls of the prompt's history (checked until it is known
        whether this template writes them: a property of the template, not of the span)."""
        if self._renders_history_calls is not None or not any(tool_calls_of(m) for m in messages):
            return
        without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        self._renders_history_calls = self._template(without, tools, generation_prompt=True) != prompt_text
        if not self._renders_history_calls:
            logger.warning(
                "LightningRL re-tokenization: the history of llm span %s holds tool calls that the tokenizer's "
                "chat template does not write, so re-tokenized prompts after a tool call lack them (%s)",
                span.span_id,
                TOOL_CALLS_NOT_RENDERED_ADVICE,
            )

    def _end_of_turn(self, ids: List[int], stopped: bool) -> List[int]:
        """A templated answer's ids up to its end-of-turn token (the last special token, followed only by
        whitespace): with it when the model sampled it (``stopped``), else without it."""
        for end in range(len(ids) - 1, -1, -1):
            if ids[end] in self._special_ids:
                if self.tokenizer.decode(ids[end + 1 :]).strip():
                    return ids  # text after it: not an end of turn this rule knows
                return ids[: end + 1] if stopped else ids[:end]
        return ids

    def _completion_ids(self, span: Span) -> Tuple[List[int], List[int]]:
        prompt = span.attributes.get(semconv.LLM_PROMPT)  # text as it is, token ids a list
        if isinstance(prompt, list):
            prompt_ids = [int(token) for token in prompt]
        elif isinstance(prompt, str):
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            raise RetokenizeError(f"span {span.span_id} has no {semconv.LLM_PROMPT} to re-tokenize")
        response_ids = self._encode(render_answer(output_message(span)))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        stopped = "stop" in (span.attributes.get(semconv.RESPONSE_FINISH_REASONS) or ()) and sampled_end_token(span)
        if isinstance(eos, int) and stopped:
            response_ids.append(eos)
        return prompt_ids, response_ids

    def _template(self, messages: List[Dict[str, Any]], tools: Optional[List[Any]], generation_prompt: bool) -> str:
        if self._hf_template:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        return self.tokenizer.apply_chat_template(messages, tools)

    def _encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text, **self._encode_kwargs))


_CUT_REASONS = frozenset({"length", "max_output_tokens", "content_filter"})  # the server ended the answer


def sampled_end_token(span: Span) -> bool:
    """Whether the model itself sampled the end token of its answer: not a stream that ended mid-answer
    (abandoned by the agent, truncated by the server), no finish reason that says the server cut it, and
    not finish reason ``stop`` from a request with ``stop`` strings (ending on one gives ``stop`` too, with
    no end token sampled). A span with no finish reason recorded (some frameworks record none) stopped."""
    if span.attributes.get(semconv.STREAM_ABANDONED) or span.attributes.get(semconv.STREAM_TRUNCATED):
        return False
    reasons = span.attributes.get(semconv.RESPONSE_FINISH_REASONS) or ()
    if _CUT_REASONS.intersection(reasons):
        return False
    return not ("stop" in reasons and json_attribute(span.attributes.get(semconv.REQUEST_STOP_SEQUENCES)))


def render_answer(message: Mapping[str, Any]) -> str:
    """The answer as text: content, then one ``{"name": ..., "arguments": ...}`` line per tool call."""
    content = message.get("content")
    if isinstance(content, list):
        content = message_text(content)
    lines = []
    for call in tool_calls_of(dict(message)):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {})
        lines.append(call_text(function.get("name", ""), arguments))
    return assistant_text(content, lines)


def chat_messages(span: Span) -> List[Dict[str, Any]]:
    """The span's input as chat messages (Responses API input converted); RetokenizeError if not recorded."""
    recorded = json_attribute(span.attributes.get(semconv.INPUT_MESSAGES))
    if isinstance(recorded, list):
        return [dict(m) for m in recorded if isinstance(m, Mapping)]
    if isinstance(recorded, Mapping) and "input" in recorded:
        try:
            return responses.conversation(recorded)
        except (BadRequest, KeyError, TypeError, AttributeError) as exc:
            raise RetokenizeError(f"span {span.span_id}: its Responses API input has no chat form: {exc}") from None
    raise RetokenizeError(f"span {span.span_id} has no {semconv.INPUT_MESSAGES} to re-tokenize")


def _normalised(message: Mapping[str, Any]) -> Dict[str, Any]:
    """A chat message as templates expect it (and vLLM passes it): ``content`` a string where it was missing
    or null, no null fields, tool call arguments as the JSON object they encode (kept as sent otherwise)."""
    out = {k: v for k, v in message.items() if v is not None}
    out.setdefault("content", "")
    calls = out.get("tool_calls")
    if calls == []:
        del out["tool_calls"]  # an empty list would put some templates on their tool-call path
    elif isinstance(calls, list):
        out["tool_calls"] = [_call_with_object_arguments(c) if isinstance(c, Mapping) else c for c in calls]
    return out


def _call_with_object_arguments(call: Mapping[str, Any]) -> Dict[str, Any]:
    call = dict(call)
    function = call.get("function")
    if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            call["function"] = {**function, "arguments": arguments}
    return call


def _parameters(fn: Any) -> Mapping[str, Any]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
