"""Transitions from trace trees: selection by agent_match / llm_call_match, token ids, skips with reasons,
missing ids (clear error or counted re-tokenization), and the accounting property over random traces."""

from __future__ import annotations

import random
from typing import List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl import semconv
from agl.errors import MissingTokenIdsError
from agl.lightningrl.agent_match import PolicyMatcher, select_llm_calls
from agl.lightningrl.retokenize import Retokenizer
from agl.lightningrl.synthetic import TraceBuilder
from agl.lightningrl.transitions import (
    SKIP_CALL_FAILED,
    SKIP_EMPTY_PROMPT,
    SKIP_EMPTY_RESPONSE,
    SKIP_STREAM_NO_IDS,
    CallSelector,
    extract_transitions,
)
from agl.lightningrl.tree import build_tree
from agl.testing import FakeTokenizer


def team_trace() -> TraceBuilder:
    """root 'team' agent: one call of its own, then writer, checker, rewriter (one call each)."""
    b = TraceBuilder(root_agent="team")
    b.llm([1], [2], model="planner-model")
    for i, name in enumerate(["writer", "checker", "rewriter"]):
        with b.agent(name):
            b.llm([10 + i, 11], [20 + i], logprobs=[-0.5])
    b.finish()
    return b


def extract(b: TraceBuilder, agent_match=None, llm_call_match=None, **kw):
    return extract_transitions(
        build_tree(b.spans), task_id="t", selector=CallSelector(agent_match, llm_call_match), **kw
    )


def test_all_calls_by_default_with_ids_steps_and_agents() -> None:
    out = extract(team_trace())
    assert [(t.step, t.agent_name, t.policy) for t in out.transitions] == [
        (0, "team", "default"),
        (1, "writer", "default"),
        (2, "checker", "default"),
        (3, "rewriter", "default"),
    ]
    writer = out.transitions[1]
    assert (writer.prompt_ids, writer.response_ids, writer.response_logprobs) == ([10, 11], [20], [-0.5])
    assert (writer.rollout_id, writer.attempt_id, writer.task_id) == ("ro-1", "at-1", "t")
    assert out.accounted and out.llm_spans == 4


def test_regex_agent_match_uses_re_search_and_keeps_steps() -> None:
    out = extract(team_trace(), "writer")  # re.search: matches rewriter too
    assert [(t.step, t.agent_name) for t in out.transitions] == [(1, "writer"), (3, "rewriter")]
    assert out.filtered_by_agent == 2 and out.accounted
    out = extract(team_trace(), "^writer$")
    assert [t.agent_name for t in out.transitions] == ["writer"]


def test_mapping_agent_match_first_match_wins() -> None:
    out = extract(team_trace(), {"^re": "editor", "writer": "author", "check": "critic"})
    assert [(t.agent_name, t.policy) for t in out.transitions] == [
        ("writer", "author"),
        ("checker", "critic"),
        ("rewriter", "editor"),  # matches "^re" and "writer": the first pattern wins
    ]
    out = extract(team_trace(), {"writer": "author", "^re": "editor"})
    assert [t.policy for t in out.transitions] == ["author", "author"]
    assert PolicyMatcher({"a": "p", "b": "q", "c": "p"}).policies == ["p", "q"]


def test_bad_agent_match_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a valid regular expression"):
        PolicyMatcher("(")
    with pytest.raises(ValueError, match="empty mapping"):
        PolicyMatcher({})
    with pytest.raises(ValueError, match="policy names must be non-empty strings"):
        PolicyMatcher({"w": ""})
    with pytest.raises(TypeError, match="regex string"):
        PolicyMatcher(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="llm_call_match"):
        CallSelector(llm_call_match="[")


def test_llm_call_match_on_span_name_or_model() -> None:
    out = extract(team_trace(), llm_call_match="planner")
    assert [t.agent_name for t in out.transitions] == ["team"]
    assert out.filtered_by_call == 3 and out.accounted
    out = extract(team_trace(), "writer", llm_call_match="^chat m$")  # the span name "chat m"
    assert [t.agent_name for t in out.transitions] == ["writer", "rewriter"]
    assert (out.filtered_by_agent, out.filtered_by_call) == (2, 0)


def test_select_llm_calls_accepts_a_mapping() -> None:
    spans = team_trace().spans
    assert len(select_llm_calls(spans, {"^check": "critic", "^write": "author"})) == 2


def test_skips_have_reasons_and_never_make_empty_samples() -> None:
    b = TraceBuilder()
    b.llm([1], [2], status="error")
    b.llm([1], [])
    b.llm([], [2])
    b.llm([1, 2], [3], logprobs=[-1.0, -2.0])  # logprobs not one per token: dropped
    b.llm([1, 2], [3, 4], logprobs=[-1.0, float("-inf")])  # not finite: the PPO ratio would be infinite
    b.llm([1, 2], [3, 4], logprobs=[-1.0, -0.5])  # kept
    b.finish()
    out = extract(b)
    assert dict(out.skipped) == {SKIP_CALL_FAILED: 1, SKIP_EMPTY_RESPONSE: 1, SKIP_EMPTY_PROMPT: 1}
    assert [t.response_logprobs for t in out.transitions] == [None, None, [-1.0, -0.5]]
    assert out.logprobs_dropped == 2
    assert out.accounted


def test_ids_stored_as_json_strings_are_read() -> None:
    b = TraceBuilder()
    span = b.llm([1], [2])
    span.attributes[semconv.PROMPT_TOKEN_IDS] = "[5, 6]"
    span.attributes[semconv.RESPONSE_TOKEN_IDS] = "[7]"
    b.finish()
    [t] = extract(b).transitions
    assert (t.prompt_ids, t.response_ids) == ([5, 6], [7])


def test_missing_token_ids_raise_a_clear_error() -> None:
    b = TraceBuilder(root_agent="team")
    with b.agent("writer"):
        span = b.llm(None, None)
    b.finish()
    with pytest.raises(MissingTokenIdsError) as info:
        extract(b)
    message = str(info.value)
    for part in ("ro-1", span.span_id, "'writer'", "'absent'", "return_token_ids", "tokenizer="):
        assert part in message
    assert info.value.span_id == span.span_id and info.value.agent_name == "writer"
    # a filtered-out agent's calls do not need ids
    assert extract(b, "^team$").transitions == []


def test_missing_only_response_ids_names_what_is_missing() -> None:
    b = TraceBuilder()
    span = b.llm([1], [2])
    del span.attributes[semconv.RESPONSE_TOKEN_IDS]
    b.finish()
    with pytest.raises(MissingTokenIdsError, match=f"no {semconv.RESPONSE_TOKEN_IDS} .*'server'"):
        extract(b)


def test_a_call_without_ids_and_without_an_answer_or_cut_mid_stream_is_skipped_not_raised() -> None:
    """MissingTokenIdsError is for a server that never returns ids. A stream closed before anything arrived
    (no output, no finish reason) and a stream abandoned or truncated before its ids (a Responses stream
    sends them last) say nothing about the server: each raised for the whole batch. Now skipped, counted."""
    b = TraceBuilder()
    nothing = b.llm(None, None, content=None)
    abandoned = b.llm(None, None, content="half an ans")
    truncated = b.llm(None, None, content="half an ans")
    b.llm([1], [2])
    for span in (nothing, abandoned, truncated):
        del span.attributes[semconv.TOKEN_IDS_SOURCE]  # as recorded: the source of an unfinished stream is unknown
    nothing.attributes[semconv.STREAM_ABANDONED] = True
    abandoned.attributes[semconv.STREAM_ABANDONED] = True
    truncated.attributes[semconv.STREAM_TRUNCATED] = True
    b.finish()
    out = extract(b)
    assert out.skipped == {SKIP_EMPTY_RESPONSE: 1, SKIP_STREAM_NO_IDS: 2} and len(out.transitions) == 1
    assert out.accounted
    # a complete answer from a server without ids still raises
    b.llm(None, None, content="a whole answer").attributes[semconv.RESPONSE_FINISH_REASONS] = ["stop"]
    with pytest.raises(MissingTokenIdsError):
        extract(b)


def test_retokenize_opt_in_is_counted() -> None:
    b = TraceBuilder()
    b.llm(None, None, content="hello", messages=[{"role": "user", "content": "hi"}])
    b.finish()
    out = extract(b, retokenizer=Retokenizer(FakeTokenizer()))
    [t] = out.transitions
    tok = FakeTokenizer()
    assert t.prompt_ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert t.response_ids == tok.encode("hello")
    assert t.response_logprobs is None and out.retokenized == 1


def test_retokenizer_needs_a_tokenizer_like_object() -> None:
    with pytest.raises(TypeError, match="apply_chat_template"):
        Retokenizer(object())


# --- properties: every llm span is accounted for ----------------------------------------------------------

AGENTS = ["writer", "checker", "rewriter", "tools"]
PATTERNS = st.one_of(
    st.none(),
    st.sampled_from(["writer", "^check", "er$", "zzz"]),
    st.dictionaries(st.sampled_from(["writer", "^re", "check", "tool", "x"]), st.sampled_from(["a", "b"]), min_size=1),
)


@st.composite
def random_traces(draw) -> List:
    """Random nesting of agents, operations and chains with llm calls of every kind, some lost parents."""
    b = TraceBuilder(root_agent=draw(st.sampled_from(["team", None])))
    events = draw(st.lists(st.tuples(st.integers(0, 6), st.sampled_from(AGENTS)), min_size=1, max_size=25))
    depth = 0
    stack = []
    for action, name in events:
        if action == 0 and depth < 4:
            cm = b.agent(name)
        elif action == 1 and depth < 4:
            cm = b.chain(name)
        elif action == 2 and stack:
            stack.pop().__exit__(None, None, None)
            depth -= 1
            continue
        else:
            kind = draw(st.sampled_from(["ok", "ok", "ok", "failed", "empty", "no_prompt"]))
            b.llm(
                [] if kind == "no_prompt" else [1, 2],
                [] if kind == "empty" else [3],
                status="error" if kind == "failed" else "unset",
            )
            continue
        cm.__enter__()
        stack.append(cm)
        depth += 1
    while stack:
        stack.pop().__exit__(None, None, None)
    return b.finish()


def expected_agent(span, by_id) -> Optional[str]:
    parent = span.parent_id
    while parent is not None:
        p = by_id[parent]
        if p.kind == "agent":
            return p.attributes.get(semconv.AGENT_NAME)
        parent = p.parent_id
    return None


@settings(max_examples=200, deadline=None)
@given(
    spans=random_traces(), agent_match=PATTERNS, call_match=st.sampled_from([None, "chat", "nomatch"]), data=st.data()
)
def test_every_llm_span_is_accounted_for(spans, agent_match, call_match, data) -> None:
    rng = random.Random(data.draw(st.integers(0, 1000)))
    # damage: drop some chain spans (their children are re-parented by time), shuffle the rest
    damaged = [s for s in spans if not (s.kind == "chain" and rng.random() < 0.3)]
    rng.shuffle(damaged)
    tree = build_tree(damaged)
    out = extract_transitions(tree, task_id="t", selector=CallSelector(agent_match, call_match))

    llm = sorted((s for s in spans if s.kind == "llm"), key=lambda s: s.sequence_id)
    assert out.llm_spans == len(llm)
    assert out.accounted
    # independently: which calls should be transitions, and with which policy
    by_id = {s.span_id: s for s in spans}
    matcher = PolicyMatcher(agent_match)
    expected = []
    for step, s in enumerate(llm):
        policy = matcher.policy_for(expected_agent(s, by_id))
        if policy is None or call_match == "nomatch":
            continue
        if (
            s.status == "error"
            or not s.attributes[semconv.RESPONSE_TOKEN_IDS]
            or not s.attributes[semconv.PROMPT_TOKEN_IDS]
        ):
            continue
        expected.append((s.span_id, step, policy))
    assert [(t.span_id, t.step, t.policy) for t in out.transitions] == expected
    assert all(t.prompt_ids and t.response_ids for t in out.transitions)
    if call_match == "nomatch":
        assert out.filtered_by_call == len(llm) - out.filtered_by_agent
