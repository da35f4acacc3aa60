"""The rollout endpoints: enqueue, claim work and wait for rollouts to end (both long polls), query, reap,
cancel. A claim whose client left before its answer gives the rollouts back at once."""

from __future__ import annotations

import logging
import threading
from typing import List, Optional

from fastapi import Request
from fastapi.responses import Response

from agl.store.base import LightningStore
from agl.store.http.server.context import context_of
from agl.store.http.server.routing import StoreRouter, as_json, as_rollouts, parse_body
from agl.store.http.wire import DequeueBody, EnqueueBody, QueryBody, Renewed, RolloutList, WaitBody
from agl.types import Rollout

logger = logging.getLogger("agl.store.http.server")  # the server's one logger, whichever module logs

router = StoreRouter("rollouts")


@router.post("/rollouts", response_model=RolloutList, summary="enqueue rollouts (FIFO)")
async def enqueue(body: EnqueueBody, request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: ctx.once(request, lambda: as_rollouts(ctx.store.enqueue_many(body.requests))))


@router.post("/rollouts/dequeue", body=DequeueBody, response_model=RolloutList, summary="claim work (long poll)")
async def dequeue(request: Request) -> Response:
    ctx = context_of(request)
    store, native = ctx.store, ctx.native
    body = await parse_body(request, DequeueBody)

    def waited(gone: threading.Event) -> Response:
        step = lambda t: store.dequeue_many(body.runner_id, body.limit, timeout=t)  # noqa: E731 - a one-line callable handed on
        claimed = ctx.sliced(body.timeout, gone, step) or []
        if claimed and gone.is_set():  # claimed as the client left (or by a store whose wait cannot give up)
            claimed = _give_back(store, claimed, body.runner_id)
        return as_rollouts(claimed)

    if native is not None:

        async def claim_or_wait() -> Response:  # the claim on the loop; only an empty queue costs a thread
            claimed = await native.aclaim(body.runner_id, body.limit)
            if claimed or body.timeout <= 0:
                return as_rollouts(claimed)
            return await ctx.long_poll(request, waited)

        return await ctx.once_async(request, claim_or_wait)  # a retry waits for this answer
    key = ctx.idempotency_key(request)
    if ctx.inline and (key is None or not ctx.cache.seen(key)):  # a first try: claim without a thread if work is there
        claimed = store.dequeue_many(body.runner_id, body.limit, timeout=0)
        if claimed or body.timeout <= 0:
            response = as_rollouts(claimed)
            return response if key is None else ctx.cache.record(key, response)
    return await ctx.long_poll(request, lambda gone: ctx.once(request, lambda: waited(gone)))


@router.post("/rollouts/wait", response_model=RolloutList, summary="wait for rollouts to end (long poll)")
async def wait_for_rollouts(body: WaitBody, request: Request) -> Response:
    ctx = context_of(request)
    store = ctx.store
    ids = list(dict.fromkeys(body.rollout_ids))

    def wait(gone: threading.Event) -> Response:
        def step(t: float) -> Optional[List[Rollout]]:
            done = store.wait_for_rollouts(ids, timeout=t)
            return done if len(done) == len(ids) else None

        done = ctx.sliced(body.timeout, gone, step)
        return as_rollouts(done if done is not None else store.wait_for_rollouts(ids, timeout=0))

    return await ctx.long_poll(request, wait)


@router.post("/rollouts/query", response_model=RolloutList, summary="list rollouts, filtered")
async def query_rollouts(body: QueryBody, request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_rollouts(ctx.store.query_rollouts(**body.model_dump())))


@router.post("/rollouts/reap", response_model=RolloutList, summary="end expired attempts now")
async def reap(request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_rollouts(ctx.store.reap_expired()))


@router.post(
    "/attempts/renew-heartbeats",
    response_model=Renewed,
    summary="count every running attempt as having sent a heartbeat now",
)
async def renew_heartbeats(request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_json(Renewed(renewed=ctx.store.renew_heartbeats())))


@router.get("/rollouts/{rollout_id}", response_model=Rollout)
async def get_rollout(rollout_id: str, request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_json(ctx.store.get_rollout(rollout_id)))


@router.post("/rollouts/{rollout_id}/cancel", response_model=Rollout)
async def cancel(rollout_id: str, request: Request) -> Response:
    ctx = context_of(request)
    return await ctx.run(lambda: as_json(ctx.store.cancel_rollout(rollout_id)))


def _give_back(store: LightningStore, claimed: List[Rollout], runner_id: str) -> List[Rollout]:
    """End the attempts of rollouts claimed for a poll whose client has disconnected (the answer cannot reach it),
    as the reaper would after the heartbeat timeout, but now: the rollouts are retried while attempts are left.
    Returns no rollouts: the answer a retry of the same request (Idempotency-Key) gets, so nobody runs them."""
    error = (
        f"runner {runner_id!r} disconnected before the store server could hand it this rollout "
        "(the runner left): attempt ended by the server"
    )
    for rollout in claimed:
        if rollout.attempt is None:  # a dequeued rollout always has one
            continue
        try:
            after = store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "unresponsive", error=error)
        except Exception as exc:  # noqa: BLE001 - the reaper ends it after the heartbeat timeout instead
            logger.warning(
                "rollout %s claimed for runner %s, which left: could not end the attempt: %s",
                rollout.rollout_id,
                runner_id,
                exc,
            )
            continue
        logger.info(
            "rollout %s claimed for runner %s, which left: attempt ended, rollout is now %s",
            rollout.rollout_id,
            runner_id,
            after.status,
        )
    return []
