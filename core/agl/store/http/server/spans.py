"""The span endpoints in agl's own format: store a batch (insert-only, so a retried batch is harmless), read
an attempt's spans, delete the spans of finished rollouts. OpenTelemetry exporters use :mod:`.traces`."""

from __future__ import annotations

from fastapi import Query, Request
from fastapi.responses import Response

from agl.store.base import AsyncRolloutCalls
from agl.store.http.server.context import context_of
from agl.store.http.server.routing import StoreRouter, as_json, parse_body
from agl.store.http.wire import Deleted, DeleteSpansBody, SpanList, SpansBody, Stored

router = StoreRouter("spans")


@router.post("/spans", body=SpansBody, response_model=Stored, summary="store spans (insert-only, idempotent)")
async def add_spans(request: Request) -> Response:
    ctx = context_of(request)
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


@router.get("/rollouts/{rollout_id}/spans", response_model=SpanList)
async def query_spans(
    request: Request,
    rollout_id: str,
    attempt_id: str = Query("latest", description="an attempt id, 'latest' or 'all'"),
) -> Response:
    ctx = context_of(request)
    which = None if attempt_id == "all" else attempt_id
    return await ctx.run(lambda: as_json(SpanList(spans=ctx.store.query_spans(rollout_id, which))))
