"""The span endpoints in agl's own format: store a batch (insert-only, so a retried batch is harmless), read
an attempt's spans, delete the spans of finished rollouts. OpenTelemetry exporters use :mod:`.traces`."""

from __future__ import annotations

from typing import List

from fastapi import Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from agl.store.base import AsyncRolloutCalls
from agl.store.http.server.context import context_of
from agl.store.http.server.routing import StoreRouter, as_json, parse_body
from agl.store.http.wire import Deleted, DeleteSpansBody, SpanList, SpansBody, Stored
from agl.store.span_codec import SPANS_MEDIA_TYPE, frame_rows, span_frame
from agl.store.sqlite.schema import span_fields, span_to_row
from agl.types import Span

router = StoreRouter("spans")


@router.post(
    "/spans",
    body=SpansBody,
    response_model=Stored,
    summary="store spans (insert-only, idempotent)",
    description=f"JSON, or agl's binary span batch (Content-Type: {SPANS_MEDIA_TYPE}, as agl's client sends).",
)
async def add_spans(request: Request) -> Response:
    ctx = context_of(request)
    if request.headers.get("content-type") == SPANS_MEDIA_TYPE:
        body = await _framed_spans(request)
    else:
        body = await parse_body(request, SpansBody)

    async def on_loop(native: AsyncRolloutCalls) -> Response:
        return as_json(Stored(stored=await native.aadd_spans(body.spans)))

    return await ctx.answer_once(request, lambda: as_json(Stored(stored=ctx.store.add_spans(body.spans))), on_loop)


@router.post(
    "/spans/delete",
    body=DeleteSpansBody,
    response_model=Deleted,
    summary="delete the spans of finished rollouts (the rollouts stay)",
)
async def delete_spans(request: Request) -> Response:
    ctx = context_of(request)
    body = await parse_body(request, DeleteSpansBody)
    call = lambda: as_json(Deleted(deleted=ctx.store.delete_spans(body.rollout_ids)))  # noqa: E731 - a one-line callable handed on
    return await ctx.run(lambda: ctx.once(request, call))


@router.get(
    "/rollouts/{rollout_id}/spans",
    response_model=SpanList,
    description=f"JSON, or agl's binary span batch for a request that accepts {SPANS_MEDIA_TYPE}.",
)
async def query_spans(
    request: Request,
    rollout_id: str,
    attempt_id: str = Query("latest", description="an attempt id, 'latest' or 'all'"),
) -> Response:
    ctx = context_of(request)
    which = None if attempt_id == "all" else attempt_id
    if SPANS_MEDIA_TYPE in request.headers.get("accept", ""):
        return await ctx.run(lambda: _frames(ctx.store.query_spans(rollout_id, which)))
    return await ctx.run(lambda: as_json(SpanList(spans=ctx.store.query_spans(rollout_id, which))))


async def _framed_spans(request: Request) -> SpansBody:
    """A binary span batch, validated as its JSON would be (a malformed one: the same 422)."""
    try:
        rows = frame_rows(await request.body())
        return SpansBody.model_validate({"spans": [span_fields(row) for row in rows]})
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    except ValueError as exc:
        problem = {"type": "value_error", "loc": ("body",), "msg": str(exc), "input": None}
        raise RequestValidationError([problem]) from None


def _frames(spans: List[Span]) -> Response:
    return Response(b"".join(span_frame(span_to_row(span)) for span in spans), media_type=SPANS_MEDIA_TYPE)
