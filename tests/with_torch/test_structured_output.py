"""Structured output's grammar (agl.serving.structured) checked string by string with llguidance and
SmolLM2's real tokenizer, and a failing grammar in the engine failing only its own request.

The policy server's answers under a response_format are tested over HTTP in test_serving.py."""

from __future__ import annotations

import threading
from typing import Any, List, Tuple

import pytest

from agl.openai_wire.chat_format import BadRequest
from agl.serving.engine import Failed, Finished, GenerationEngine, SamplingParams
from agl.serving.openai_api import parse_request
from agl.serving.structured import GrammarError, Grammars, TokenMask, answer_schema, response_grammar

VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'


def accepts(tiny: Tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether ``text`` followed by end-of-sequence is a whole answer under ``grammar``."""
    _, tokenizer = tiny
    mask = Grammars(tokenizer, [tokenizer.eos_token_id]).mask(grammar)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    try:
        for token_id in ids:
            mask.advance(token_id)
    except GrammarError:
        return False
    return True


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"answer": "yes", "sure": true}', True),
        ('{"answer": "no", "sure": false}', True),
        ('{"answer": "maybe", "sure": true}', False),  # not in the enum
        ('{"answer": "yes"}', False),  # a required key missing
        ('{"answer": "yes", "sure": true, "why": 1}', False),  # additionalProperties: false
        ('{"answer":"yes","sure":true}', False),  # whitespace is fixed: ", " and ": "
        ('{"answer": "yes", "sure": true}  ', False),
        ("yes", False),
        (CALL, False),  # no tools offered
    ],
)
def test_a_schema_grammar_takes_exactly_the_schemas_answers(tiny, text, ok):
    assert accepts(tiny, response_grammar(VERDICT), text) is ok


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"answer": "yes", "sure": true}', True),
        (CALL, True),
        (CALL + "\n" + CALL.replace("2", "7"), True),  # several calls, one per line, as the server renders them
        (CALL.replace('"add"', '"sub"'), False),  # not an offered tool
        (CALL.replace("2", '"two"'), False),  # arguments not valid under the tool's parameters
        ("Let me add.\n" + CALL, False),  # text besides calls is neither the JSON nor calls
        (CALL + '{"answer": "yes", "sure": true}', False),
    ],
)
def test_with_tools_the_grammar_takes_the_json_or_tool_calls(tiny, text, ok):
    assert accepts(tiny, response_grammar(VERDICT, [ADD]), text) is ok


@pytest.mark.parametrize(
    "one_call, text, ok",
    [
        (False, CALL, True),
        (False, CALL + "\n" + CALL, True),
        (True, CALL, True),
        (True, CALL + "\n" + CALL, False),  # parallel_tool_calls: false
        (False, '{"answer": "yes", "sure": true}', False),  # a call is required: no other answer
        (False, "", False),
    ],
)
def test_forced_calls_take_only_calls(tiny, one_call, text, ok):
    assert accepts(tiny, response_grammar(VERDICT, [ADD], calls_only=True, one_call=one_call), text) is ok


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    "change, several",
    [
        ({"tool_choice": NAMED}, False),  # a named function: exactly one call, as with OpenAI
        ({"tool_choice": NAMED, "parallel_tool_calls": True}, False),
        ({"tool_choice": "required"}, True),
        ({"tool_choice": "required", "parallel_tool_calls": False}, False),
    ],
)
def test_a_named_tool_choice_takes_one_call_and_required_may_end_after_any(tiny, change, several):
    """Allowed more than one call, SmolLM2 writes its forced call again until max_tokens: the tool runs twice."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "tools": [ADD], **change}
    grammar = parse_request(body).sampling(64).grammar
    assert accepts(tiny, grammar, CALL)  # (``accepts`` ends the answer there)
    assert accepts(tiny, grammar, CALL + "\n" + CALL) is several
    assert accepts(tiny, grammar, CALL + "\n" + CALL + "\n" + CALL) is several


def test_response_formats_map_to_schemas():
    assert answer_schema(None) is None and answer_schema({"type": "text"}) is None
    assert answer_schema({"type": "json_object"}) == {"type": "object"}
    assert answer_schema({"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}) == VERDICT
    assert response_grammar(None, [ADD]) is None
    with pytest.raises(BadRequest, match="json_schema.schema") as raised:
        answer_schema({"type": "json_schema", "json_schema": {"name": "v"}})
    assert raised.value.param == "response_format"
    with pytest.raises(BadRequest, match="must be"):
        answer_schema("json")


def test_a_grammar_that_fails_mid_answer_fails_only_its_own_request(tiny, monkeypatch):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer, max_batch_size=4, batch_wait_s=0.2)  # both join one batch
    original = TokenMask.apply
    calls = {"n": 0}

    def failing_apply(self: TokenMask, logits: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise GrammarError("the grammar engine gave up")
        return original(self, logits)

    monkeypatch.setattr(TokenMask, "apply", failing_apply)
    prompt = tokenizer("hello", add_special_tokens=False)["input_ids"]
    events: List[Any] = [None, None]
    done = [threading.Event(), threading.Event()]

    def listener(index: int) -> Any:
        def listen(event: Any) -> None:
            if isinstance(event, (Finished, Failed)):
                events[index] = event
                done[index].set()

        return listen

    try:
        engine.submit(prompt, SamplingParams(max_tokens=30, grammar=response_grammar(VERDICT)), listener(0))
        engine.submit(prompt, SamplingParams(max_tokens=8, temperature=0), listener(1))
        assert done[0].wait(60) and done[1].wait(60)
    finally:
        engine.close()
    assert isinstance(events[0], Failed) and "gave up" in str(events[0].error)
    assert isinstance(events[1], Finished) and len(events[1].generation.response_ids) == 8
    assert engine.stats.max_batch == 2
