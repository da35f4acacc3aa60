"""Call order across sources: agl's own spans (sequence ids 1, 2, 3 per attempt) and spans sent over OTLP
without agl.sequence.id (sequence id = start time in ns) are ordered by start time, then sequence id.

Ordering by sequence id first put every OTLP call after every native call, whatever the real order. Also
which agent a call belongs to when spans come from several sources (an unnamed agent span)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import httpx

from agl import semconv
from agl.cli.inspection import span_tree
from agl.lightningrl import LightningRL
from agl.lightningrl.agent_match import select_llm_calls
from agl.lightningrl.links import CallLinks
from agl.lightningrl.tree import build_tree
from agl.store import SqliteLightningStore
from agl.store.http.server import ServerThread, TokenSet, create_app
from agl.types import Span

TOKEN = "order-token"
TRACE = "f" * 32
ROOT, NATIVE_LLM, TOOL = "a" * 16, "b" * 16, "c" * 16
OTLP_LLM = "d" * 16


def span(seq: int, span_id: str, parent_id: Optional[str], name: str, kind: str, start: int, end: int, **kw) -> Span:
    """A span of attempt at-1 of ro-1 (``kw``: other fields) in the trace TRACE."""
    ids = {"rollout_id": "ro-1", "attempt_id": "at-1", "trace_id": TRACE}
    fields = {"sequence_id": seq, "span_id": span_id, "parent_id": parent_id, "name": name, "kind": kind}
    return Span(**{**ids, **fields, "start_time": start, "end_time": end, **kw})


def native(rollout_id: str, attempt_id: str, seq: int, span_id: str, kind: str, start: int, end: int, **attrs) -> Span:
    parent_id = None if span_id == ROOT else ROOT
    attributes = {semconv.AGENT_NAME: "solver", **attrs} if span_id == ROOT else attrs
    ids = {"rollout_id": rollout_id, "attempt_id": attempt_id}
    return span(seq, span_id, parent_id, f"{kind} {seq}", kind, start, end, **ids, attributes=attributes)


def ints(values):
    return {"arrayValue": {"values": [{"intValue": str(v)} for v in values]}}


def test_an_otlp_call_made_first_is_step_0_between_native_spans(tmp_path: Path) -> None:
    store = SqliteLightningStore(tmp_path / "order.db")
    server = ServerThread(create_app(store, tokens=TokenSet({"t": TOKEN}))).start()
    try:
        store.enqueue_rollout({"q": 1})
        rollout = store.dequeue_rollout("runner")
        assert rollout is not None and rollout.attempt is not None
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        t0 = 1_795_771_000_000_000_000
        # agl's own spans: the rollout root, then (after the OTLP call) a tool and an llm call
        store.add_spans(
            [
                native(rid, aid, 1, ROOT, "agent", t0, t0 + 10_000_000),
                native(rid, aid, 2, TOOL, "tool", t0 + 3_000_000, t0 + 3_500_000),
                native(
                    rid,
                    aid,
                    3,
                    NATIVE_LLM,
                    "llm",
                    t0 + 5_000_000,
                    t0 + 6_000_000,
                    **{semconv.PROMPT_TOKEN_IDS: [60, 124], semconv.RESPONSE_TOKEN_IDS: [105]},
                ),
            ]
        )
        # another SDK's call, made first, exported over OTLP without agl.sequence.id
        otlp_span = {
            "traceId": TRACE,
            "spanId": OTLP_LLM,
            "parentSpanId": ROOT,
            "name": "chat other-sdk",
            "startTimeUnixNano": str(t0 + 1_000_000),
            "endTimeUnixNano": str(t0 + 2_000_000),
            "attributes": [
                {"key": "agl.rollout.id", "value": {"stringValue": rid}},
                {"key": "agl.attempt.id", "value": {"stringValue": aid}},
                {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                {"key": "agl.llm.prompt_token_ids", "value": ints([101, 102])},
                {"key": "agl.llm.response_token_ids", "value": ints([103])},
            ],
        }
        response = httpx.post(
            server.url + "/v1/traces",
            json={"resourceSpans": [{"scopeSpans": [{"spans": [otlp_span]}]}]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert response.status_code == 200 and response.content == b"{}"
        store.complete_attempt(rid, aid, "succeeded", reward=1.0)

        spans = store.query_spans(rid)
        assert {s.span_id: s.sequence_id for s in spans}[OTLP_LLM] == t0 + 1_000_000  # sorts last by sequence id
        tree = build_tree(spans)
        assert [s.span_id for s in tree.llm_spans()] == [OTLP_LLM, NATIVE_LLM]
        assert [s.span_id for s in select_llm_calls(spans)] == [OTLP_LLM, NATIVE_LLM]  # agl.select_llm_calls too
        links = CallLinks(tree)
        assert [s.span_id for s in links.ordered] == [ROOT, OTLP_LLM, TOOL, NATIVE_LLM]
        tool = next(s for s in spans if s.span_id == TOOL)
        assert links.caller_of_tool(tool) == OTLP_LLM, "the tool ran after the OTLP call, before the native one"
        assert [s.span_id for _, s in span_tree(spans)] == [ROOT, OTLP_LLM, TOOL, NATIVE_LLM], "agl inspect's order"

        batch = LightningRL.from_config({"agent_match": None, "aggregate": False}).build_batch(
            store, store.query_rollouts(), progress=False
        )
        steps = sorted(batch.transitions, key=lambda t: t.step)
        assert [(t.step, t.prompt_ids) for t in steps] == [(0, [101, 102]), (1, [60, 124])]
    finally:
        server.stop()
        store.close()


def test_native_spans_that_start_at_the_same_time_keep_their_sequence_order() -> None:
    spans = [native("ro-1", "at-1", 1, ROOT, "agent", 0, 100)] + [
        native("ro-1", "at-1", seq, span_id, "llm", 10, 20)
        for seq, span_id in [(3, "1" * 16), (2, "2" * 16), (4, "0" * 16)]
    ]
    assert [s.sequence_id for s in build_tree(spans).llm_spans()] == [2, 3, 4]
    assert [s.sequence_id for s in CallLinks(build_tree(spans)).ordered] == [1, 2, 3, 4]


def test_an_unnamed_agent_span_does_not_hide_the_named_agent_around_it() -> None:
    """A hand-made or third-party agent span without gen_ai.agent.name inside the named root agent: its calls
    had agent name None, which no agent_match could select (found by the LightningRL probe)."""
    unnamed = "9" * 16
    token_ids = {semconv.PROMPT_TOKEN_IDS: [1, 2], semconv.RESPONSE_TOKEN_IDS: [3]}
    spans = [
        native("ro-1", "at-1", 1, ROOT, "agent", 0, 100),  # named "solver"
        span(2, unnamed, ROOT, "agent step", "agent", 5, 50),
        span(3, NATIVE_LLM, unnamed, "chat", "llm", 10, 20, attributes=token_ids),
    ]
    tree = build_tree(spans)
    assert tree.enclosing_agent(NATIVE_LLM).span_id == ROOT
    assert [s.span_id for s in select_llm_calls(spans, "^solver$")] == [NATIVE_LLM]
