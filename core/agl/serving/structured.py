"""Structured output on the policy server: a ``response_format`` JSON schema enforced while sampling.

Agents ask for structured output through ``response_format`` (chat) or ``text.format`` (Responses): the OpenAI
Agents SDK's ``output_type``, LangChain's ``with_structured_output``, AutoGen's ``output_content_type``, CrewAI's
``response_format``. The server enforces it the way OpenAI's structured outputs and vLLM's guided decoding do:
at every step, the tokens that cannot continue a valid answer are masked out before sampling, with
llguidance (the grammar engine of vLLM and llama.cpp; a 3 MB wheel with no dependencies, in ``agl[torch]``).
The answer then always parses and matches the schema, unless it is cut at ``max_tokens``.

- ``{"type": "json_schema", "json_schema": {"schema": S}}``: an answer valid under ``S``; ``strict`` changes
  nothing (the schema is always enforced). ``{"type": "json_object"}``: any JSON object.
- Whitespace is fixed: ``", "`` between items, ``": "`` after keys, nothing else (as ``json.dumps`` writes).
  Flexible whitespace would let a weak model pad an answer with blanks until ``max_tokens``.
- With tools offered, the answer is either that JSON or one or more tool calls in the server's tool call
  format (:mod:`agl.openai_wire.chat_format`), each call naming an offered tool with arguments valid under its
  ``parameters``: an agent that has tools and an output type can still call its tools.
- ``tool_choice`` ``"required"`` or a named function forces calls the same way: the answer is one or more
  calls, arguments valid under the tool's ``parameters``; a named function gets exactly one call, as on
  OpenAI (see ``openai_api.ChatRequest``). Where a grammar is in force, ``parallel_tool_calls: false``
  allows one call only. The answer may end after any whole call.
- A schema llguidance cannot compile (an unknown ``type``, an unsupported keyword) is a 400 naming
  ``response_format`` with llguidance's reason, or the tool (``tools[i].function.parameters``) whose
  ``parameters`` it is (``PolicyServer._check_grammar``).

Logprobs follow the engine's rule (:mod:`agl.serving.engine`): those of the distribution the token was drawn
from, here renormalized over the tokens the grammar allows; greedy requests report the model's own.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import torch

from agl.openai_wire.chat_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, BadRequest

#: llguidance's JSON options: fixed whitespace, as ``json.dumps`` separates items and keys
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def answer_schema(response_format: Any, param: str = "response_format") -> Optional[Dict[str, Any]]:
    """The JSON schema a chat ``response_format`` asks for; ``None`` for plain text. Raises BadRequest."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise BadRequest(f"{param} of type json_schema needs json_schema.schema, a JSON schema object", param)
        return dict(schema)
    raise BadRequest(
        f"{param} must be {{'type': 'text'}}, {{'type': 'json_object'}} or {{'type': 'json_schema', "
        f"'json_schema': {{'name': ..., 'schema': {{...}}}}}}; got {response_format!r}",
        param,
    )


def response_grammar(
    schema: Optional[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    calls_only: bool = False,
    one_call: bool = False,
) -> Optional[str]:
    """The grammar (llguidance's Lark dialect) an answer must follow; ``None`` when it is free text.

    ``tools`` are the chat tools offered to the model: with them the answer may be tool calls instead.
    ``calls_only`` (``tool_choice`` "required" or a named function): the answer is one or more calls to
    ``tools``, whatever ``schema`` says. ``one_call`` (``parallel_tool_calls: false``): at most one call.
    """
    if calls_only:
        return "start: calls\n" + _calls_rules(tools, one_call)
    if schema is None:
        return None
    if not tools:
        return f"start: {_json(schema)}\n"
    return f"start: answer | calls\nanswer: {_json(schema)}\n" + _calls_rules(tools, one_call)


def _calls_rules(tools: Sequence[Mapping[str, Any]], one_call: bool) -> str:
    """Tool calls, one per line, as the server renders them (chat_format.render_tool_call)."""
    calls = {"anyOf": [_call_schema(tool) for tool in tools]}
    return (
        "calls: call\n" if one_call else 'calls: call ("\\n" call)*\n'
    ) + f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} {_json(calls)} {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n"


def _json(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


def _call_schema(tool: Mapping[str, Any]) -> Dict[str, Any]:
    """A tool call as the model writes it: ``{"name": NAME, "arguments": {...}}``, arguments per the tool."""
    function = tool.get("function") or {}
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function.get("name")}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


class GrammarError(RuntimeError):
    """Constrained sampling cannot go on (the grammar engine reported an error)."""


class Grammars:
    """Compiles grammars for one tokenizer and hands out one :class:`TokenMask` per request.

    llguidance's view of the tokenizer takes ~0.3 s to build (SmolLM2's 49K tokens): built on first use.
    """

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = sorted(eos_ids)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def check(self, grammar: str, param: str = "response_format") -> None:
        """Raise BadRequest (a 400 naming ``param``) when the grammar cannot be enforced."""
        llguidance = _llguidance(param)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer_info())
        if error:  # "at 1(8): failed to compile JSON schema: ...", then the grammar's text: keep the reason
            reason = re.sub(r"^at \d+\(\d+\): ", "", error.strip().splitlines()[0])
            raise BadRequest(f"{param} cannot be enforced: {reason}", param)

    def mask(self, grammar: str) -> TokenMask:
        llguidance = _llguidance("response_format")
        matcher = llguidance.LLMatcher(self._tokenizer_info(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the response format's grammar failed to compile: {matcher.get_error()}")
        return TokenMask(matcher)

    def _tokenizer_info(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                eos = self._eos_ids if len(self._eos_ids) != 1 else self._eos_ids[0]
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=eos or None)
            return self._ll_tokenizer


class TokenMask:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def apply(self, logits: Any) -> Any:
        """``logits`` with every token the grammar forbids next set to -inf (a new tensor)."""
        allowed = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        if self._matcher.is_error() or not bool(allowed.any()):
            reason = self._matcher.get_error() or "the grammar allows no token"
            raise GrammarError(f"no token can continue the structured answer: {reason}")
        allowed = allowed[: logits.shape[-1]].to(logits.device) != 0
        if allowed.shape[-1] < logits.shape[-1]:  # the model's embedding is padded past the tokenizer
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - allowed.shape[-1]))
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")


def _llguidance(param: str) -> Any:
    try:
        import llguidance
    except ImportError:
        raise BadRequest(
            f"{param} needs the llguidance package on the policy server: pip install 'agl[torch]' (or llguidance)",
            param,
        ) from None
    return llguidance
