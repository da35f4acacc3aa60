"""Compact span attributes (agl.store.span_codec): exact round trips, their size, stores an older agl wrote, and
the store server's binary span batches."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import struct
from pathlib import Path
from typing import Any, Dict, List

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from agl import semconv
from agl.store import LightningStore, SqliteLightningStore
from agl.store.postgres.store import PostgresLightningStore
from agl.store.span_codec import MAGIC, SPANS_MEDIA_TYPE, decode_attributes, encode_attributes, frame_rows, span_frame
from agl.store.sqlite.schema import storable_row
from agl.testing.postgres import PostgresServer
from agl.testing.spans import incompressible_text

IDS, OUT_IDS, LOGPROBS = semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS
_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(), st.floats(allow_nan=False)
)
_json = st.recursive(
    _json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)
)


def _float32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Equal, in the same key order, with ints still ints and floats still floats (NaN equal to NaN)."""
    return list(a) == list(b) and json.dumps(a, allow_nan=True) == json.dumps(b, allow_nan=True)


@settings(max_examples=300, deadline=None)
@given(
    other=st.dictionaries(st.text(), _json, max_size=6),
    ids=st.lists(st.integers(0, 2**40), max_size=50) | st.lists(st.integers(0, 65_535), max_size=50),
    logprobs=st.lists(st.floats(width=32), max_size=20) | st.lists(st.floats(), max_size=20),
    position=st.integers(0, 6),
)
def test_attributes_read_back_exactly(
    other: Dict[str, Any], ids: List[int], logprobs: List[float], position: int
) -> None:
    items = list(other.items())
    items.insert(min(position, len(items)), (IDS, ids))
    items.append((LOGPROBS, logprobs))
    attributes = dict(items)
    assert _same(decode_attributes(encode_attributes(attributes)), attributes)


def test_values_that_are_not_id_or_logprob_lists_stay_json() -> None:
    odd = {IDS: [1, 2.5, 3], OUT_IDS: "not a list", LOGPROBS: [0, -1.5], "x": [1, 2, 3]}
    assert _same(decode_attributes(encode_attributes(odd)), odd)
    big = {IDS: [2**70, 1]}  # beyond 64 bits: JSON keeps it
    assert decode_attributes(encode_attributes(big)) == big
    special = {LOGPROBS: [-math.inf, 0.0, -1e-45, math.nan]}
    back = decode_attributes(encode_attributes(special))[LOGPROBS]
    assert back[:3] == special[LOGPROBS][:3] and math.isnan(back[3])


def test_an_llm_span_takes_a_third_of_its_json() -> None:
    rng = random.Random(0)
    attributes = {
        IDS: [rng.randrange(50_000) for _ in range(600)],
        OUT_IDS: [rng.randrange(50_000) for _ in range(200)],
        LOGPROBS: [_float32(-rng.expovariate(1.0)) for _ in range(200)],
        "gen_ai.prompt": json.dumps([{"role": "user", "content": "the quick brown fox " * 40}]),
    }
    compact = encode_attributes(attributes)
    assert compact[0] == MAGIC
    assert len(compact) < 2 * 800 + 4 * 200 + 400  # 2 bytes an id, 4 a float32 logprob, the text compressed
    assert len(compact) * 3 < len(json.dumps(attributes))


def test_rows_an_older_agl_wrote_read_the_same(tmp_path: Path, make_span: Any) -> None:
    path = tmp_path / "old.db"
    store = SqliteLightningStore(path)
    store.enqueue_rollout({"q": 1})
    rollout = store.dequeue_rollout("r")
    new = make_span(rollout, 1, attributes={IDS: [5, 6], "k": "v"})
    store.add_spans([new])
    old_row = list(storable_row(make_span(rollout, 2, attributes={IDS: [7, 8], "k": "w"})))
    old_row[12] = json.dumps({IDS: [7, 8], "k": "w"})  # how agl wrote attributes before: JSON text
    with sqlite3.connect(path) as conn:
        aid = conn.execute("SELECT latest_aid FROM rollouts").fetchone()[0]
        conn.execute(
            "INSERT INTO spans (aid, rollout_id, attempt_id, span_id, sequence_id, trace_id, parent_id, "
            "name, kind, start_time, end_time, status, error, attributes, events) "
            "VALUES (" + ", ".join("?" * 15) + ")",
            [aid, *old_row],
        )
    spans = store.query_spans(rollout.rollout_id)
    assert [s.attributes for s in spans] == [{IDS: [5, 6], "k": "v"}, {IDS: [7, 8], "k": "w"}]
    store.close()


def test_a_schema_1_postgres_store_is_brought_up_to_date(postgres_server: PostgresServer, make_span: Any) -> None:
    import psycopg

    with postgres_server.store_database() as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:  # the database as agl wrote it before payload existed
            conn.execute("ALTER TABLE agl_spans DROP COLUMN payload")
            conn.execute("UPDATE agl_schema SET version = 1")
        store = PostgresLightningStore(dsn)
        try:
            store.enqueue_rollout({"q": 1})
            rollout = store.dequeue_rollout("r")
            store.add_spans([make_span(rollout, 1, attributes={IDS: [1, 2], LOGPROBS: [-0.5]})])
            assert store.query_spans(rollout.rollout_id)[0].attributes == {IDS: [1, 2], LOGPROBS: [-0.5]}
        finally:
            store.close()
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT max(version) FROM agl_schema").fetchone()[0] == 2


def test_binary_span_batches_on_the_wire(store: LightningStore, make_span: Any) -> None:
    store.enqueue_rollout({"q": 1})
    rollout = store.dequeue_rollout("r")
    spans = [
        make_span(rollout, i, attributes={IDS: list(range(i * 300)), "text": incompressible_text(50, i)})
        for i in range(3)
    ]
    assert store.add_spans(spans) == 3
    assert store.query_spans(rollout.rollout_id) == spans
    rows = [storable_row(span) for span in spans]
    assert frame_rows(b"".join(span_frame(row) for row in rows)) == rows


def test_a_malformed_binary_batch_is_refused_and_stores_nothing(tmp_path: Path) -> None:
    from agl.store.http.server import ServerThread, create_app

    backing = SqliteLightningStore(tmp_path / "s.db")
    server = ServerThread(create_app(backing, allow_anonymous=True)).start()
    try:
        answer = httpx.post(
            f"{server.url}/v1/spans", content=b"\x05\x00\x00\x00[1,2", headers={"Content-Type": SPANS_MEDIA_TYPE}
        )
        assert answer.status_code == 422 and SPANS_MEDIA_TYPE in answer.text
        assert backing.stats().spans == 0
    finally:
        server.stop(wait=False)
        backing.close()
