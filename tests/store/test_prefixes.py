"""Prompt ids a trajectory's LLM spans share are stored once (agl.store.prefixes), and read back whole."""

from __future__ import annotations

import logging
import random
import sqlite3
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest

from agl import semconv
from agl.errors import UnknownAttemptError
from agl.store import LightningStore, SqliteLightningStore
from agl.store.prefixes import MIN_SHARED, shared_length
from agl.store.span_codec import SPANS_MEDIA_TYPE, encode_attributes, span_frame
from agl.store.sqlite.schema import storable_row

PROMPT, RESPONSE = semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS


def turns(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    """The token ids of an ``n``-turn conversation: each prompt is the last prompt, its response, a few ids the
    chat template adds and the next user message."""
    rng = random.Random(seed)
    prompt = [rng.randrange(50_000) for _ in range(100)]
    out = []
    for _ in range(n):
        response = [rng.randrange(50_000) for _ in range(40)]
        out.append({PROMPT: prompt, RESPONSE: response, "gen_ai.request.model": "m"})
        prompt = prompt + response + [2, 1] + [rng.randrange(50_000) for _ in range(30)]
    return out


def running(store: LightningStore) -> Any:
    store.enqueue_rollout({"q": 1})
    rollout = store.dequeue_rollout("r")
    assert rollout is not None
    return rollout


def test_shared_length() -> None:
    assert shared_length([1, 2, 3, 4], [1, 2, 3]) == 3
    assert shared_length([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert shared_length([7], [1]) == 0
    assert shared_length(list(range(5000)) + [1], list(range(4000)) + [0]) == 4000


def test_a_conversation_reads_back_whole_on_every_backend(store: LightningStore, make_span: Any) -> None:
    rollout = running(store)
    attrs = turns(6)
    store.add_spans([make_span(rollout, i, attributes=a) for i, a in enumerate(attrs[:2])])
    store.add_spans([make_span(rollout, i + 2, attributes=a) for i, a in enumerate(attrs[2:])])  # refers back
    assert [s.attributes for s in store.query_spans(rollout.rollout_id)] == attrs


def test_shared_ids_are_stored_once(tmp_path: Path, make_span: Any) -> None:
    store = SqliteLightningStore(tmp_path / "s.db")
    rollout = running(store)
    attrs = turns(8)
    for i, a in enumerate(attrs):
        store.add_spans([make_span(rollout, i, attributes=a)])
    with sqlite3.connect(tmp_path / "s.db") as conn:
        stored = sum(len(row[0]) for row in conn.execute("SELECT attributes FROM spans"))
    full = sum(len(encode_attributes(a)) for a in attrs)
    last_prompt = len(attrs[-1][PROMPT])
    assert stored < full / 2 and stored < 2 * (last_prompt + 8 * 40) + 8 * 120  # ~2 bytes an id, once
    assert [s.attributes for s in store.query_spans(rollout.rollout_id)] == attrs
    store.close()


def test_a_batch_that_was_refused_is_never_referred_to(tmp_path: Path, make_span: Any) -> None:
    store = SqliteLightningStore(tmp_path / "s.db")
    rollout = running(store)
    attrs = turns(2)
    with pytest.raises(UnknownAttemptError):  # same rollout, an attempt that does not exist
        store.add_spans([make_span(rollout, 0, attempt_id="at-missing", attributes=attrs[0])])
    first = make_span(rollout, 1, attributes=attrs[0])
    store.add_spans([first, make_span(rollout, 2, attributes=attrs[1])])
    assert [s.attributes for s in store.query_spans(rollout.rollout_id)] == attrs
    store.close()


def test_spans_read_back_whatever_their_order(store: LightningStore, make_span: Any) -> None:
    """Parallel calls: a later prompt may carry an earlier sequence id than the span it shares ids with."""
    rollout = running(store)
    attrs = turns(4)
    spans = [make_span(rollout, 10 - i, attributes=a) for i, a in enumerate(attrs)]  # sequence ids descending
    for span in spans:
        store.add_spans([span])
    back = {s.span_id: s.attributes for s in store.query_spans(rollout.rollout_id)}
    assert [back[s.span_id] for s in spans] == attrs


def test_a_prompt_whose_shared_span_is_gone_says_how_many_ids_are_missing(
    tmp_path: Path, make_span: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteLightningStore(tmp_path / "s.db")
    rollout = running(store)
    attrs = turns(2)
    spans = [make_span(rollout, i, attributes=a) for i, a in enumerate(attrs)]
    store.add_spans(spans[:1])
    store.add_spans(spans[1:])
    with sqlite3.connect(tmp_path / "s.db") as conn:  # as if another process had deleted it
        conn.execute("DELETE FROM spans WHERE span_id = ?", (spans[0].span_id,))
    with caplog.at_level(logging.WARNING, logger="agl.store"):
        (back,) = store.query_spans(rollout.rollout_id)
    shared = len(attrs[0][PROMPT]) + len(attrs[0][RESPONSE])
    assert back.attributes[semconv.PROMPT_PREFIX_MISSING] == shared >= MIN_SHARED
    assert back.attributes[PROMPT] == attrs[1][PROMPT][shared:]
    assert "which is gone" in caplog.text
    store.close()


def test_a_client_batch_cannot_refer_to_stored_spans(tmp_path: Path, make_span: Any) -> None:
    from agl.store.http.server import ServerThread, create_app

    backing = SqliteLightningStore(tmp_path / "s.db")
    rollout = running(backing)
    server = ServerThread(create_app(backing, allow_anonymous=True)).start()
    try:
        row = storable_row(make_span(rollout, 1, attributes=turns(2)[1]), ("0" * 16, 40))
        answer = httpx.post(
            f"{server.url}/v1/spans", content=span_frame(row), headers={"Content-Type": SPANS_MEDIA_TYPE}
        )
        assert answer.status_code == 422 and "only a store may write" in answer.text
        assert backing.stats().spans == 0
    finally:
        server.stop(wait=False)
        backing.close()
