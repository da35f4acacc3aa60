"""The attempt endpoints of a runner's rollout cycle: heartbeat, complete, and complete-and-dequeue (the step
to its next rollout in one request); a networked store with async calls serves the latter two on the loop."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import Response

from agl.store.base import AsyncRolloutCalls
from agl.store.http.server.context import context_of
from agl.store.http.server.routing import StoreRouter, as_json, parse_body
from agl.store.http.wire import AttemptList, CompleteAndDequeueBody, CompleteBody, CompletedAndClaimed
from agl.types import Attempt, Rollout

logger = logging.getLogger("agl.store.http.server")  # the server's one logger, whichever module logs

router = StoreRouter("attempts")


@router.get("/rollouts/{rollout_id}/attempts", response_model=AttemptList)
async def query_attempts(rollout_id: str, request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_json(AttemptList(attempts=ctx.store.query_attempts(rollout_id))))


@router.post("/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat", response_model=Attempt)
async def heartbeat(rollout_id: str, attempt_id: str, request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_json(ctx.store.heartbeat(rollout_id, attempt_id)))


@router.post("/rollouts/{rollout_id}/attempts/{attempt_id}/complete", body=CompleteBody, response_model=Rollout)
async def complete(rollout_id: str, attempt_id: str, request: Request) -> Response:
    ctx = context_of(request)
    body = await parse_body(request, CompleteBody)

    async def on_loop(native: AsyncRolloutCalls) -> Response:
        return as_json(
            await native.acomplete_attempt(rollout_id, attempt_id, body.status, reward=body.reward, error=body.error)
        )

    def call() -> Response:
        return as_json(
            ctx.store.complete_attempt(rollout_id, attempt_id, body.status, reward=body.reward, error=body.error)
        )

    return await ctx.answer_once(request, call, on_loop)


@router.post(
    "/rollouts/{rollout_id}/attempts/{attempt_id}/complete-and-dequeue",
    body=CompleteAndDequeueBody,
    response_model=CompletedAndClaimed,
    summary="complete, then claim work without waiting (a runner's step to its next rollout)",
)
async def complete_and_dequeue(rollout_id: str, attempt_id: str, request: Request) -> Response:
    ctx = context_of(request)
    body = await parse_body(request, CompleteAndDequeueBody)

    async def on_loop(native: AsyncRolloutCalls) -> Response:
        completed = await native.acomplete_attempt(
            rollout_id, attempt_id, body.status, reward=body.reward, error=body.error
        )
        try:
            claimed = await native.aclaim(body.runner_id, body.limit)
        except Exception as exc:  # noqa: BLE001 - as LightningStore.complete_and_dequeue: completion stands
            logger.warning("claim after completing %s failed (the runner will dequeue again): %s", rollout_id, exc)
            claimed = []
        return as_json(CompletedAndClaimed(rollout=completed, claimed=claimed))

    def call() -> Response:
        completed, claimed = ctx.store.complete_and_dequeue(
            rollout_id,
            attempt_id,
            body.status,
            reward=body.reward,
            error=body.error,
            runner_id=body.runner_id,
            limit=body.limit,
        )
        return as_json(CompletedAndClaimed(rollout=completed, claimed=claimed))

    return await ctx.answer_once(request, call, on_loop)
