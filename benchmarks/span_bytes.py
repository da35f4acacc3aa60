"""Bytes per stored LLM span, compact encoding vs the JSON text agl wrote before, measured on the same spans.

    python benchmarks/span_bytes.py [--spans 1000] [--postgres DSN]

The spans are made by agl's own instrumentation: the real ``openai`` client calls an in-process transport
whose completions carry 600 prompt and 200 response token ids drawn at random from a 50k vocabulary (no help
from sequential ids). Three sets: the issue's span (benchmarks/tracer_overhead.py's 8 short input messages of
repeated words and its 500-character answer); 8 messages of English text (slices of this repo's docs, 2.4k
characters) and a 500-character answer; the same with the answer's 200 logprobs (float32 values, as a server
computes them). Each set goes
into a new SQLite file (bytes on disk after a checkpoint), a PostgreSQL database (the spans table with its
TOAST and indexes; ``--postgres DSN``, ``$AGL_TEST_POSTGRES_DSN``, or a throwaway server as the tests start) and the
store server's wire (bytes of the binary batch); "JSON" is the same spans written as agl wrote them before:
attributes as JSON text, in a SQLite file of the same schema. Target: <= 3 MB per 1,000 spans.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import sqlite3
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import openai

try:
    import httpx2 as httpx  # what openai >= 3 uses
except ImportError:  # pragma: no cover - openai 1.x/2.x
    import httpx  # type: ignore[no-redef]

from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.store import SqliteLightningStore
from agl.store.span_codec import decode_attributes, span_frame
from agl.store.sqlite.schema import INSERT_SPAN, storable_row
from agl.testing.postgres import PostgresUnavailableError, postgres_for_tests
from agl.testing.sink import ListSink, tracer_writes_to
from agl.tracing.context import RolloutScope, enter_scope, exit_scope
from agl.types import Span

VOCAB, PROMPT_TOKENS, RESPONSE_TOKENS = 50_000, 600, 200
TARGET_MB = 3.0
DOCS = " ".join(p.read_text() for p in sorted((Path(__file__).parent.parent / "docs").glob("*.md")))


def completion(rng: random.Random, logprobs: bool, english: bool) -> bytes:
    """A chat completion as vLLM returns it with token ids (and, if asked, logprobs)."""
    answer = DOCS[rng.randrange(len(DOCS) - 500) :][:500] if english else "word " * 100
    response_ids = [rng.randrange(VOCAB) for _ in range(RESPONSE_TOKENS)]
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": answer},
        "finish_reason": "stop",
        "token_ids": response_ids,
        "logprobs": None,
    }
    if logprobs:
        values = [struct.unpack("<f", struct.pack("<f", -rng.expovariate(2.0)))[0] for _ in response_ids]
        choice["logprobs"] = {
            "content": [
                {"token": f"t{i}", "logprob": v, "bytes": None, "top_logprobs": []}
                for i, v in zip(response_ids, values)
            ]
        }
    return json.dumps(
        {
            "id": f"chatcmpl-{rng.randrange(10**9)}",
            "object": "chat.completion",
            "created": 0,
            "model": "bench-model",
            "prompt_token_ids": [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)],
            "choices": [choice],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": RESPONSE_TOKENS, "total_tokens": 800},
        }
    ).encode()


def messages(rng: random.Random, english: bool) -> List[dict[str, str]]:
    if not english:  # benchmarks/tracer_overhead.py's
        return [{"role": "system", "content": "You are a careful assistant that uses tools."}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "some words " * 20}
            for i in range(7)
        ]
    start = rng.randrange(len(DOCS) - 2_400)
    return [{"role": "user", "content": DOCS[start + 300 * i : start + 300 * (i + 1)]} for i in range(8)]


def llm_spans(n: int, logprobs: bool, english: bool, seed: int = 0) -> List[Span]:
    """``n`` spans of real instrumented calls, each with new random ids (and text, if English)."""
    rng = random.Random(seed)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=completion(rng, logprobs, english)))
    client = openai.OpenAI(
        base_url="http://bench.invalid/v1", api_key="x", http_client=httpx.Client(transport=transport)
    )
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument()
    try:
        with tracer_writes_to(ListSink()) as sink:
            token = enter_scope(RolloutScope("ro-bench", "at-bench"))
            try:
                for _ in range(n):
                    extra: Dict[str, Any] = {"logprobs": True} if logprobs else {}
                    client.chat.completions.create(model="bench-model", messages=messages(rng, english), **extra)  # type: ignore[arg-type]
            finally:
                exit_scope(token)
    finally:
        instrumentor.uninstrument()
    return [s for s in sink.spans if s.kind == "llm"]


def sqlite_bytes(spans: List[Span], as_json: bool) -> int:
    """Bytes the spans add to a new SQLite store file (compact rows, or the attributes as JSON text)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "store.db")
        store = SqliteLightningStore(path)
        rollout = store.enqueue_rollout(None)
        store.close()
        before = os.path.getsize(path)
        rows = [list(storable_row(s.model_copy(update={"rollout_id": rollout.rollout_id}))) for s in spans]
        for row in rows:
            if as_json:
                row[12] = json.dumps(decode_attributes(row[12]))
        conn = sqlite3.connect(path)
        with conn:
            conn.executemany(INSERT_SPAN, [[1, *row] for row in rows])
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        return os.path.getsize(path) - before


def postgres_bytes(spans: List[Span], dsn: str) -> int:
    """Bytes of agl_spans (heap, TOAST, indexes) after storing the spans in the store at ``dsn``."""
    import psycopg

    from agl.store.postgres.store import PostgresLightningStore

    store = PostgresLightningStore(dsn)
    try:
        store.enqueue_rollout(None)
        claimed = store.dequeue_rollout("bench")
        with psycopg.connect(dsn) as conn:
            before = _relation_size(conn)
        assert claimed is not None and claimed.attempt is not None
        ids = {"rollout_id": claimed.rollout_id, "attempt_id": claimed.attempt.attempt_id}
        for start in range(0, len(spans), 100):
            store.add_spans([s.model_copy(update=ids) for s in spans[start : start + 100]])
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM agl_spans")
            return _relation_size(conn) - before
    finally:
        store.close()


def _relation_size(conn: Any) -> int:
    found = conn.execute("SELECT pg_total_relation_size('agl_spans')").fetchone()
    assert found is not None
    return int(found[0])


def wire_bytes(spans: List[Span]) -> int:
    return sum(len(span_frame(storable_row(s))) for s in spans)


def row(label: str, n: int, measure: Optional[Callable[[], int]]) -> None:
    found = None if measure is None else measure()
    if found is None:
        print(f"  {label:<34} skipped")
        return
    mb = found / n * 1000 / 1e6
    mark = "" if "JSON" in label else ("  (target <= 3 MB: met)" if mb <= TARGET_MB else "  (target <= 3 MB: NOT met)")
    print(f"  {label:<34} {mb:6.2f} MB per 1,000 spans{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1000)
    parser.add_argument("--postgres", default=os.environ.get("AGL_TEST_POSTGRES_DSN"), help="a database to write into")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        dsn = args.postgres
        if dsn is None:
            try:
                dsn = stack.enter_context(stack.enter_context(postgres_for_tests()).store_database())
            except PostgresUnavailableError as exc:
                print(f"PostgreSQL skipped: {exc}")
        report(args.spans, dsn)


SETS = (
    ("the issue's spans (short repeated messages)", False, False),
    ("English messages", False, True),
    ("English messages, 200 logprobs", True, True),
)


def report(n: int, dsn: Optional[str]) -> None:
    for title, logprobs, english in SETS:
        spans = llm_spans(n, logprobs, english)
        print(f"{len(spans)} LLM spans, 800 random token ids each, {title}:")
        for label, measure in (
            ("SQLite, JSON attributes (before)", functools.partial(sqlite_bytes, spans, as_json=True)),
            ("SQLite, compact", functools.partial(sqlite_bytes, spans, as_json=False)),
            ("PostgreSQL, compact", functools.partial(postgres_bytes, spans, dsn) if dsn else None),
            ("store server wire, compact", functools.partial(wire_bytes, spans)),
        ):
            row(label, len(spans), measure)


if __name__ == "__main__":
    main()
