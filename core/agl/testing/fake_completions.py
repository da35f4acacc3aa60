"""Legacy Completions API wire format (``POST /v1/completions``) for the fake OpenAI server.

Token-in agents send a raw prompt (text, or the token ids of a template they applied themselves) and get
text back; there is no chat template and no tool-call parsing. The fake model answers the prompt text as
if a user had said it (``FAKE: <prompt>`` by default); a scripted reply's tool calls come back as the text
the model would have written for them. Token ids follow vLLM's ``return_token_ids`` for this API: both
``prompt_token_ids`` and ``token_ids`` sit on the choice (streamed: the prompt ids on the first chunk's).

A batch of prompts (a list of texts or of id lists; not streamed) is answered as vLLM does, one choice per
prompt in order: the first by the script (or the default policy), the others by the default policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from agl.openai_wire import chat_completions
from agl.openai_wire.apis import response_header
from agl.openai_wire.logprobs import completion_logprobs
from agl.openai_wire.sse import DONE, data_event
from agl.testing.fake_policy import (
    ChatTool,
    FakeReply,
    FakeTokenizer,
    Generation,
    ToolChoice,
    default_policy,
    fake_logprob,
    render_assistant,
    tool_call_from_spec,
)

Body = Mapping[str, Any]


def missing_field(body: Body) -> str | None:
    """``prompt`` unless it holds prompts: text or token ids, bare or in a list (a batch is not streamed)."""
    prompts = _prompts(body.get("prompt"))
    if not prompts or (len(prompts) > 1 and body.get("stream")):
        return "prompt"
    return None


def _prompts(prompt: Any) -> list[Any]:
    """The request's prompts (each text or a list of ids); empty if it holds none."""
    if _is_one_prompt(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_one_prompt(p) for p in prompt):
        return list(prompt)
    return []


def _is_one_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)
    )


def conversation(body: Body) -> tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice]:
    """The (first) prompt as the one user message the default policy answers (no tools: a text API)."""
    return [{"role": "user", "content": _prompt_text(_prompts(body["prompt"])[0])}], [], None


def answer(
    reply: FakeReply | None,
    conversation: tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice],
    body: Body,
    tokenizer: FakeTokenizer,
) -> Generation:
    """The text answer to the (first) prompt, its prompt ids being the prompt's own (given ids, or the
    text's bytes)."""
    if reply is not None and reply.chooses_message:
        text = render_assistant(reply.content, [tool_call_from_spec(spec) for spec in reply.tool_calls or []])
    else:
        text = default_policy(conversation[0], [], None)[0] or ""
    return _generation(_prompts(body["prompt"])[0], text, tokenizer)


def _generation(prompt: Any, text: str, tokenizer: FakeTokenizer) -> Generation:
    prompt_ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    return Generation(
        content=text, tool_calls=[], prompt_ids=prompt_ids, response_ids=tokenizer.encode(text), tokenizer=tokenizer
    )


def completion(gen: Generation, body: Body, token_ids: bool) -> dict[str, Any]:
    """The non-streamed ``text_completion`` object: one choice per prompt, ``gen`` the first prompt's."""
    gens = [gen] + [
        _generation(
            prompt,
            default_policy([{"role": "user", "content": _prompt_text(prompt)}], [], None)[0] or "",
            gen.tokenizer,
        )
        for prompt in _prompts(body["prompt"])[1:]
    ]
    choices = []
    for index, one in enumerate(gens):
        choice = {**_choice(one, body, one.content or "", one.response_ids, (0, 0), "stop"), "index": index}
        if token_ids:
            choice["prompt_token_ids"] = one.prompt_ids
            choice["token_ids"] = one.response_ids
        choices.append(choice)
    return {**_header(body), "choices": choices, "usage": _usage(*gens)}


def sse_events(gen: Generation, body: Body, token_ids: bool) -> Iterator[str]:
    """One chunk per word (its ``token_ids`` the word's), the finish reason last, ``data: [DONE]`` at the end."""
    header = _header(body)
    pieces = gen.text_pieces() or [""]
    tokens = characters = 0
    for index, piece in enumerate(pieces):
        ids = gen.tokenizer.encode(piece)
        last = index == len(pieces) - 1
        choice = _choice(gen, body, piece, ids, (tokens, characters), "stop" if last else None)
        if token_ids:
            if index == 0:
                choice["prompt_token_ids"] = gen.prompt_ids
            choice["token_ids"] = ids
        tokens += len(ids)
        characters += len(piece)
        yield data_event({**header, "choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        yield data_event({**header, "choices": [], "usage": _usage(gen)})
    yield DONE


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return FakeTokenizer().decode([t for t in prompt if 0 <= t < 256])  # a real tokenizer's ids read as bytes


def _choice(
    gen: Generation, body: Body, text: str, ids: list[int], start: tuple[int, int], finish_reason: str | None
) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": _logprobs(gen, body, ids, start), "finish_reason": finish_reason}


def _logprobs(gen: Generation, body: Body, ids: list[int], start: tuple[int, int]) -> dict[str, Any] | None:
    """The legacy logprobs object when the request asked (``logprobs``: an int, 0 for the chosen tokens only).

    ``start``: the response token and character positions ``ids`` begin at.
    """
    if body.get("logprobs") is None or body.get("logprobs") is False:
        return None
    first, offset = start
    tokens = [gen.tokenizer.token_text(token_id) for token_id in ids]
    logprobs = [fake_logprob(first + i) for i in range(len(ids))]
    top = [{token: fake_logprob(first + i)} for i, token in enumerate(tokens)]
    return completion_logprobs(tokens, logprobs, top, offset)[0]  # type: ignore[arg-type]  # list is invariant; no entry is None here


def _header(body: Body) -> dict[str, Any]:
    return response_header("cmpl-", body.get("model") or "fake-model", "text_completion")


def _usage(*gens: Generation) -> dict[str, Any]:
    return chat_completions.usage(sum(len(gen.prompt_ids) for gen in gens), sum(len(gen.response_ids) for gen in gens))
