"""The resources endpoints (add a version, read one or the latest) and the store's counts (``/v1/stats``)."""

from __future__ import annotations

from typing import Optional

from fastapi import Query, Request
from fastapi.responses import Response

from agl.store.base import StoreStats
from agl.store.http.server.context import context_of
from agl.store.http.server.routing import StoreRouter, as_json
from agl.store.http.wire import MaybeResources, ResourcesBody
from agl.types import ResourcesUpdate

router = StoreRouter()


@router.post("/resources", response_model=ResourcesUpdate, tags=["resources"], summary="add a resources version")
async def add_resources(body: ResourcesBody, request: Request) -> Response:
    ctx = context_of(request)

    def call() -> Response:
        return as_json(ctx.store.add_resources(body.resources, body.resources_id))  # type: ignore[arg-type]  # validated by the request model

    return await ctx.run(lambda: ctx.once(request, call))


@router.get(
    "/resources", response_model=MaybeResources, tags=["resources"], summary="a resources version, or the latest"
)
async def get_resources(
    request: Request, resources_id: Optional[str] = Query(None, description="omit for the latest")
) -> Response:
    ctx = context_of(request)
    if ctx.native is not None:
        return as_json(MaybeResources(update=await ctx.native.aget_resources(resources_id)))
    return await ctx.run(lambda: as_json(MaybeResources(update=ctx.store.get_resources(resources_id))))


@router.get("/stats", response_model=StoreStats, tags=["meta"])
async def stats(request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_json(ctx.store.stats()))
