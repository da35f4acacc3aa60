"""The legacy Completions API (``POST /v1/completions``) of the policy server, in vLLM's format.

Token-in/token-out agents (rLLM- and verl-style agent loops, LangChain's ``langchain_openai.OpenAI``) apply
their own chat template and send the raw prompt, as text or as token ids. The server runs exactly that
prompt (token ids as given; text tokenized with the tokenizer's special tokens, as vLLM does for this API,
and no chat template) and answers with exactly the ids it sampled, so a trainer learns from what the model
wrote. The text is the model's own: not stripped, no tool calls parsed out of it.

The sampling parameters both APIs share are checked by the chat path itself, on the chat request they
stand for (as the Responses API does), so a parameter is accepted or refused the same way on both. The
answer is a ``text_completion`` object with vLLM's ``return_token_ids`` fields on the choice
(``prompt_token_ids``, ``token_ids``; streamed: ``prompt_token_ids`` on the first chunk's choice, each
chunk's ``token_ids`` behind its text) and agl's ``agl_resources_version`` on every object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Union

from agl.openai_wire.apis import RESOURCES_VERSION_FIELD as VERSION_FIELD
from agl.openai_wire.apis import (
    TOKEN_IDS_REQUEST,
    is_int,
    refuse_unknown,
    require,
    require_object,
    response_header,
)
from agl.openai_wire.chat_format import ParsedOutput
from agl.openai_wire.logprobs import completion_logprobs, token_logprobs, top_by_text
from agl.openai_wire.sse import DONE, data_event
from agl.openai_wire.stops import streamable_text
from agl.serving.generation import Generation, Token
from agl.serving.openai_api import MAX_TOP_LOGPROBS, ChatRequest, optional_bool, parse_request, usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for this API

# Accepted and ignored: token ids are always returned, and the user changes nothing about the answer.
_IGNORED = frozenset({"user", TOKEN_IDS_REQUEST})
# Checked by the chat path under the same names (``parse_request``).
_SHARED = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)
_SUPPORTED = frozenset(_SHARED) | {"prompt", "logprobs", "echo", "suffix", "best_of"} | _IGNORED
# The chat checks need a conversation; this one is never rendered (the prompt is the request's own).
_NO_CONVERSATION = [{"role": "user", "content": ""}]


@dataclasses.dataclass
class CompletionRequest:
    """A checked request: the prompt as sent, the logprobs asked for, and the chat request it stands for
    (whose ``sampling`` gives the engine's parameters; its ``max_tokens`` is None when none was sent)."""

    prompt: Union[str, List[int]]
    logprobs: Optional[int]  # None: none; n: the sampled tokens' logprobs and the n most likely alternatives
    # (``true`` / ``false``, the chat API's spelling, stand for 0 / none)
    chat: ChatRequest


def parse_completion_request(body: Any) -> CompletionRequest:
    """Check a ``/v1/completions`` body; raises :class:`BadRequest` naming the parameter."""
    require_object(body)
    require(
        "response_format" not in body,
        "response_format",
        "response_format is not part of the Completions API: use /v1/chat/completions for structured output",
    )
    refuse_unknown(body, _SUPPORTED, _IGNORED, "agl's policy server's /v1/completions")
    require(
        not optional_bool(body, "echo"),
        "echo",
        "echo is not supported: leave it out (the prompt's token ids come back as choices[0].prompt_token_ids)",
    )
    require(body.get("suffix") is None, "suffix", "suffix is not supported: leave it out")
    best_of = body.get("best_of")
    require(
        best_of is None or (is_int(best_of) and best_of == 1),
        "best_of",
        "only best_of=1 is supported: send one request per sample",
    )
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):  # the chat API's spelling, e.g. a trainer's published sampling parameters
        logprobs = 0 if logprobs else None
    require(
        logprobs is None or (is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS),
        "logprobs",
        f"logprobs must be null or an integer from 0 to {MAX_TOP_LOGPROBS} (the alternatives to return per token)",
    )
    prompt = _prompt(body.get("prompt"))
    chat_body = {key: body[key] for key in _SHARED if key in body}
    chat_body.update(messages=_NO_CONVERSATION, logprobs=logprobs is not None, top_logprobs=logprobs or 0)
    return CompletionRequest(prompt=prompt, logprobs=logprobs, chat=parse_request(chat_body))


def _prompt(prompt: Any) -> Union[str, List[int]]:
    """The one prompt sent: text or token ids; a batch of one (``["text"]``, ``[[ids]]``) is that prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        require(
            len(prompt) == 1,
            "prompt",
            f"'prompt' holds {len(prompt)} prompts: agl's policy server answers one prompt per request; "
            "send one request per prompt",
        )
        prompt = prompt[0]
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(is_int(t) for t in prompt))
    require(ok, "prompt", "'prompt' must be a string or a list of token ids (integers)")
    require(len(prompt) > 0, "prompt", "'prompt' is empty: send text or at least one token id")
    return prompt


def prompt_token_ids(tokenizer: Any, prompt: Union[str, List[int]], vocab_size: int) -> List[int]:
    """The ids the model runs on: token ids exactly as sent, or the text tokenized as vLLM does for this API
    (``add_special_tokens=True``: a BOS token where the tokenizer adds one; no chat template).

    Ids outside ``0 .. vocab_size - 1`` are refused here: the model's embedding lookup would fail on them and
    take every request batched with this one down too.
    """
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        require(bool(ids), "prompt", "'prompt' tokenizes to no tokens: send some text or token ids")
        return ids
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    require(bad is None, "prompt", f"token id {bad} in 'prompt' is out of the vocabulary (0 to {vocab_size - 1})")
    return list(prompt)


class CompletionWriter:
    """The ``text_completion`` object, or its chunks, for one request (the server's ``AnswerWriter``).

    The text is the generation's own (``Generation.text``: without a final end-of-sequence token, cut before
    a stop string), so the parsed chat output the server hands over is not used.
    """

    def __init__(self, request: CompletionRequest, model_name: str, tokenizer: Any, version: int) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.version = version
        self.header = response_header("cmpl-", model_name, "text_completion", system_fingerprint=False)
        self._offset = 0  # text_offset of the next token: a stream's chunks continue each other's offsets

    def final(self, gen: Generation, parsed: ParsedOutput) -> Dict[str, Any]:
        """The finished ``text_completion`` object."""
        choice = self._choice(gen.text, gen.tokens, gen.finish_reason, gen.prompt_ids)
        return {**self.header, "choices": [choice], "usage": usage(gen), VERSION_FIELD: self.version}

    # --- the stream, as the server's streaming loop drives it (``AnswerWriter``) ---------------------------

    def stream_start(self, prompt_ids: List[int]) -> List[str]:
        """A first chunk with no text: the prompt's ids reach the client before the first token."""
        return [self._chunk("", (), prompt_ids=prompt_ids)]

    def stream_text(self, text: str, tokens: Sequence[Token], first: bool) -> List[str]:
        return [self._chunk(text, tokens)]

    def stream_finish(self, gen: Generation, parsed: ParsedOutput, sent: str, pending: Sequence[Token]) -> List[str]:
        """The rest of the text with the tokens not yet sent and the finish reason; the usage chunk if asked
        for; ``[DONE]``. ``sent`` (the text streamed so far) is a prefix of the final text."""
        rest = gen.text[len(sent) :] if gen.text.startswith(sent) else ""
        lines = [self._chunk(rest, pending, finish=gen.finish_reason)]
        if self.request.chat.include_usage:
            lines.append(data_event({**self.header, "choices": [], "usage": usage(gen), VERSION_FIELD: self.version}))
        return lines + [DONE]

    def stream_error(self, error: Dict[str, Any]) -> str:
        return data_event(error)

    # --- parts -------------------------------------------------------------------------------------------

    def _chunk(
        self, text: str, tokens: Sequence[Token], finish: Optional[str] = None, prompt_ids: Optional[List[int]] = None
    ) -> str:
        chunk: Dict[str, Any] = {**self.header, "choices": [self._choice(text, tokens, finish, prompt_ids)]}
        if self.request.chat.include_usage:
            chunk["usage"] = None  # as OpenAI sends it: only the last chunk has the usage
        chunk[VERSION_FIELD] = self.version
        return data_event(chunk)

    def _choice(
        self, text: str, tokens: Sequence[Token], finish: Optional[str], prompt_ids: Optional[List[int]]
    ) -> Dict[str, Any]:
        choice: Dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(tokens),
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": [t.token_id for t in tokens],
        }
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
        return choice

    def _logprobs(self, tokens: Sequence[Token]) -> Optional[Dict[str, Any]]:
        """The legacy logprobs object: parallel lists over the tokens; ``top_logprobs`` maps each alternative's
        text to its logprob (null per token when ``logprobs`` was 0); ``text_offset`` counts the characters of
        the tokens before (each token's own decoded text, as ``tokens`` shows it)."""
        if self.request.logprobs is None:
            return None
        entries = token_logprobs(self.tokenizer, tokens)
        tokens_text = [entry["token"] for entry in entries]
        values = [entry["logprob"] for entry in entries]
        top = [top_by_text(entry["top_logprobs"]) if self.request.logprobs else None for entry in entries]
        logprobs, self._offset = completion_logprobs(tokens_text, values, top, self._offset)
        return logprobs


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "CompletionRequest",
    "CompletionWriter",
    "parse_completion_request",
    "prompt_token_ids",
    "streamable_text",
]
