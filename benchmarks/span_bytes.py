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
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import openai

try:
    import httpx2 as httpx  # what openai >= 3 uses
except ImportError:  # pragma: no cover - openai 1.x/2.x
    import httpx  # type: ignore[no-redef]

from agl import semconv
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.store import EnqueueRequest, LightningStore, SqliteLightningStore, open_store
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
    extra: Dict[str, Any] = {"logprobs": True} if logprobs else {}

    def calls(client: openai.OpenAI) -> None:
        for _ in range(n):
            client.chat.completions.create(model="bench-model", messages=messages(rng, english), **extra)  # type: ignore[arg-type]

    return recorded(lambda request: completion(rng, logprobs, english), {"ro-bench": calls})


def recorded(answer: Callable[[Any], bytes], rollouts: Dict[str, Callable[[openai.OpenAI], None]]) -> List[Span]:
    """The LLM spans agl's instrumentation records while each of ``rollouts`` makes its calls in a rollout of
    that id, against a transport whose answers ``answer(request)`` makes."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=answer(request)))
    client = openai.OpenAI(
        base_url="http://bench.invalid/v1", api_key="x", http_client=httpx.Client(transport=transport)
    )
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument()
    try:
        with tracer_writes_to(ListSink()) as sink:
            for rollout_id, calls in rollouts.items():
                token = enter_scope(RolloutScope(rollout_id, "at-bench"))
                try:
                    calls(client)
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
    parser.add_argument("--rollouts", type=int, default=512, help="rollouts of the multi-turn step")
    parser.add_argument("--turns", type=int, default=10, help="LLM calls per rollout of the multi-turn step")
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
        report_step(args.rollouts, args.turns, dsn)


SETS = (
    ("the issue's spans (short repeated messages)", False, False),
    ("English messages", False, True),
    ("English messages, 200 logprobs", True, True),
)


def text_ids(message: Dict[str, Any]) -> List[int]:
    """A message's token ids as a tokenizer would give them: the same text always gives the same ids (one per
    four characters, random from the vocabulary), with two ids of the chat template around each message."""
    rng = random.Random(zlib.crc32(f"{message['role']}:{message['content']}".encode()))
    return [1] + [rng.randrange(VOCAB) for _ in range(len(message["content"]) // 4)] + [2]


def conversation_answer(request: Any) -> bytes:
    """The fake model of a multi-turn agent: the prompt is its messages' ids, the answer 800 characters of the docs."""
    sent = json.loads(request.content)["messages"]
    answer = {"role": "assistant", "content": DOCS[zlib.crc32(request.content) % (len(DOCS) - 800) :][:800]}
    prompt = [i for message in sent for i in text_ids(message)]
    response = text_ids(answer)
    return json.dumps(
        {
            "id": f"chatcmpl-{len(prompt)}",
            "object": "chat.completion",
            "created": 0,
            "model": "bench-model",
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": answer, "finish_reason": "stop", "token_ids": response}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response), "total_tokens": 0},
        }
    ).encode()


def conversation(index: int, turns: int) -> Callable[[openai.OpenAI], None]:
    """An agent's rollout: a 1,600-character task, then per turn the model's answer and a 640-character tool
    result are added to the conversation (the context grows from ~400 to ~4k tokens over 10 turns)."""

    def calls(client: openai.OpenAI) -> None:
        start = index * 97 % (len(DOCS) - 2_000)
        sent: List[Dict[str, Any]] = [{"role": "user", "content": DOCS[start : start + 1_600]}]
        for turn in range(turns):
            answer = client.chat.completions.create(model="bench-model", messages=sent)  # type: ignore[arg-type]
            tool = DOCS[(start + 1_600 + 640 * turn) % (len(DOCS) - 640) :][:640]
            sent = sent + [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": tool},
            ]

    return calls


def step_bytes(spans: List[Span], backend: Callable[[], LightningStore], size: Callable[[LightningStore], int]) -> int:
    """Bytes a store grows by when each rollout's spans are added turn by turn, as its runner's writer adds them."""
    store = backend()
    try:
        by_rollout: Dict[str, List[Span]] = {}
        for span in spans:
            by_rollout.setdefault(span.rollout_id, []).append(span)
        store.enqueue_many([EnqueueRequest(input=None) for _ in by_rollout])
        claimed = store.dequeue_many("bench", limit=len(by_rollout))
        before = size(store)
        for rollout, own in zip(claimed, by_rollout.values()):
            assert rollout.attempt is not None
            ids = {"rollout_id": rollout.rollout_id, "attempt_id": rollout.attempt.attempt_id}
            for span in own:
                store.add_spans([span.model_copy(update=ids)])
        return size(store) - before
    finally:
        store.close()


def report_step(rollouts: int, turns: int, dsn: Optional[str]) -> None:
    spans = recorded(conversation_answer, {f"ro-{i}": conversation(i, turns) for i in range(rollouts)})
    prompts = [len(s.attributes[semconv.PROMPT_TOKEN_IDS]) for s in spans]
    print(f"A multi-turn step: {rollouts} rollouts x {turns} turns, prompts of {min(prompts)} to {max(prompts)} ids:")
    row_mb("SQLite, JSON attributes (before)", sqlite_bytes(spans, as_json=True))
    row_mb("SQLite, compact, prompts in full", sqlite_bytes(spans, as_json=False))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "store.db")
        row_mb("SQLite, compact, shared ids once", step_bytes(spans, lambda: SqliteLightningStore(path), _sqlite_size))
    if dsn:
        row_mb("PostgreSQL, compact, shared ids once", step_bytes(spans, lambda: open_store(dsn), _postgres_size))


def row_mb(label: str, found: int) -> None:
    mark = "  (target <= 50 MB: met)" if found <= 50e6 else "  (target <= 50 MB: NOT met)"
    print(f"  {label:<38} {found / 1e6:7.1f} MB{'' if 'before' in label or 'full' in label else mark}")


def _sqlite_size(store: LightningStore) -> int:
    """The database's pages as its latest commit left them (the WAL's included)."""
    assert isinstance(store, SqliteLightningStore)
    with contextlib.closing(sqlite3.connect(store.path)) as conn:
        return int(
            conn.execute("SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()").fetchone()[0]
        )


def _postgres_size(store: LightningStore) -> int:
    import psycopg

    with psycopg.connect(store.dsn, autocommit=True) as conn:
        conn.execute("VACUUM agl_spans")
        return _relation_size(conn)


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
