"""`agl inspect --text` (each LLM call's prompt and response, each tool's arguments and result) and `agl inspect
--agent-match` (which calls LightningRL would train), on a real SQLite store filled by Trainer.dev of the planner /
solver agent of tests/ui_run.py against the fake OpenAI server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Tuple

import pytest
from ui_run import TASKS, solver

from agl import semconv
from agl.cli import main as agl_main
from agl.cli.inspection import span_tree
from agl.lightningrl import LightningRL
from agl.store import SqliteLightningStore
from agl.testing import FakeOpenAIServer
from agl.types import Rollout, Span


@pytest.fixture
def stored(fake_openai: FakeOpenAIServer, fake_trainer: Any, instrumented: None, tmp_path: Path) -> Tuple[str, Rollout]:
    """The store's path and its one rollout (task t0: a planner call, then the solver's call, tool, answer)."""
    fake_openai.always_token_ids = True
    trainer = fake_trainer(str(tmp_path / "store.db"), model="fake-model")
    trainer.dev(solver, TASKS[:1], print_table=False)
    rollout = trainer.store.query_rollouts()[0]
    trainer.store.close()
    return str(tmp_path / "store.db"), rollout


def inspect(capsys: Any, path: str, rollout_id: str, *options: str) -> List[str]:
    assert agl_main(["inspect", rollout_id, "--store", path, *options]) == 0
    return capsys.readouterr().out.splitlines()


def spans_of(path: str, rollout_id: str) -> List[Span]:
    store = SqliteLightningStore(path)
    try:
        return store.query_spans(rollout_id)
    finally:
        store.close()


def test_inspect_text_prints_prompts_responses_and_tool_results(stored: Tuple[str, Rollout], capsys: Any) -> None:
    path, rollout = stored
    plain = inspect(capsys, path, rollout.rollout_id)
    assert not any(line.strip() == "prompt:" for line in plain)  # the tree alone without --text
    out = inspect(capsys, path, rollout.rollout_id, "--text")
    assert out[: len(plain)] == plain  # the tree first, as before
    text = "\n".join(out[len(plain) :])
    spans = spans_of(path, rollout.rollout_id)
    calls = [s for s in spans if s.kind == "llm"]
    assert text.count("  prompt:") == len(calls) == 3
    for call in calls:
        for message in json.loads(call.attributes[semconv.INPUT_MESSAGES]):
            if isinstance(message.get("content"), str) and message["content"]:
                assert f"{message['role']}: {message['content']}" in text
        answer = json.loads(call.attributes[semconv.OUTPUT_MESSAGES])[0]
        if answer.get("content"):
            assert f"assistant: {answer['content']}" in text
    (tool,) = [s for s in spans if s.kind == "tool"]
    call_of_tool = json.loads(calls[1].attributes[semconv.OUTPUT_MESSAGES])[0]["tool_calls"][0]["function"]
    assert f"tool call add({call_of_tool['arguments']})" in text
    assert f"    {tool.attributes[semconv.TOOL_CALL_ARGUMENTS]}" in out
    assert f"    {tool.attributes[semconv.TOOL_CALL_RESULT]}" in out
    assert f"    tool: {tool.attributes[semconv.TOOL_CALL_RESULT]}" in out  # the result, as the next call's prompt


@pytest.mark.parametrize("agent_match", ["^solver$", "^planner$", "nobody"])
def test_inspect_agent_match_marks_the_calls_lightningrl_trains(
    stored: Tuple[str, Rollout], capsys: Any, agent_match: str
) -> None:
    path, rollout = stored
    out = inspect(capsys, path, rollout.rollout_id, "--agent-match", agent_match)
    spans = spans_of(path, rollout.rollout_id)
    reward = rollout.final_reward
    assert reward is not None
    extraction, _, _ = LightningRL(agent_match=agent_match).attempt_transitions(rollout, spans, reward)
    trained = {t.span_id for t in extraction.transitions}
    expected = [s.span_id in trained for _, s in span_tree(spans) if s.kind == "llm"]
    marks = [line.endswith(f"<< TRAINS (reward {reward:g})") for line in out if "[llm]" in line]
    assert marks == expected
    assert sum(line.endswith("(not trained)") for line in out) == len(expected) - len(trained)
    assert f"agent_match {agent_match!r}: {len(trained)} of {len(expected)} LLM calls become samples" in out[-1]
    if len(trained) < len(expected):
        assert "agent_match leaves out their agent" in out[-1]


def test_inspect_text_and_agent_match_together_for_every_attempt(stored: Tuple[str, Rollout], capsys: Any) -> None:
    path, rollout = stored
    out = inspect(capsys, path, rollout.rollout_id, "--attempt", "all", "--text", "--agent-match", "^solver$")
    assert out[1].startswith(f"attempt {rollout.attempt.attempt_id if rollout.attempt else '?'} (1 of 1)")
    headers = [line for line in out if line.startswith("[llm]")]  # the --text section's call headers
    assert len(headers) == 3 and sum("<< TRAINS" in line for line in headers) == 2


def test_inspect_agent_match_that_is_not_a_regex_is_one_line(stored: Tuple[str, Rollout]) -> None:
    path, rollout = stored
    with pytest.raises(SystemExit) as exc:
        agl_main(["inspect", rollout.rollout_id, "--store", path, "--agent-match", "(solver"])
    assert str(exc.value.code).startswith("agl: --agent-match '(solver' is not a regular expression: missing )")
