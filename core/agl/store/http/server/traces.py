"""OpenTelemetry exporters' endpoint, ``/v1/traces`` (OTLP/HTTP, JSON or protobuf): an export's spans are
stored per (rollout, attempt), so one bad id does not drop the others', and the answer says what was refused."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from fastapi import Request
from fastapi.responses import Response

from agl import semconv
from agl.errors import AglError
from agl.store.base import LightningStore
from agl.store.http import otlp
from agl.store.http.server.context import context_of
from agl.store.http.server.routing import StoreRouter
from agl.store.http.wire import error_body, error_status

router = StoreRouter("spans")


@router.post(
    "/traces",
    summary="OTLP/HTTP trace export (JSON or protobuf)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                otlp.JSON: {"schema": {"$ref": "#/components/schemas/ExportTraceServiceRequest"}},
                otlp.PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
async def otlp_traces(request: Request) -> Response:
    ctx = context_of(request)
    refused_by_store: List[Tuple[int, BaseException]]
    body = await request.body()
    media = request.headers.get("content-type", otlp.JSON)
    answer_media = otlp.PROTOBUF if media.split(";")[0].strip().lower() == otlp.PROTOBUF else otlp.JSON
    try:
        export = otlp.decode_export(body, media, request.headers.get("content-encoding", ""), ctx.limits.max_body_bytes)
        spans, refusals = otlp.to_spans(export)
        stored, refused_by_store = 0, []
        if spans:
            stored, refused_by_store = await ctx.run(lambda: _add_otlp_spans(ctx.store, spans, refusals))
    except LookupError as exc:
        if isinstance(exc, KeyError):  # Unknown*Error: an id that is not in the store
            return _otlp_error(answer_media, 404, exc)
        return _otlp_error(answer_media, 415, exc)
    except otlp.BodyTooLarge as exc:  # a gzip body that inflates past the limit: as a large body
        return _otlp_error(answer_media, 413, exc)
    except otlp.OtlpError as exc:  # bad data: 400, which OTLP exporters do not retry
        return _otlp_error(answer_media, 400, exc)
    except (AglError, ValueError, TypeError, OverflowError) as exc:
        return _otlp_error(answer_media, error_status(exc) or 400, exc)
    ctx.otlp_refusals.log(refusals)
    if refused_by_store and not stored:  # nothing stored, and the store refused ids: the error, as before
        status, _ = refused_by_store[0]
        return _otlp_error(answer_media, status, _OtlpRefused(refusals.message(), refused_by_store[0][1]))
    return Response(otlp.export_response(answer_media, refusals.rejected, refusals.message()), media_type=answer_media)


_SPAN_REFUSALS = (AglError, ValueError, TypeError, OverflowError)  # what add_spans raises on purpose


def _add_otlp_spans(
    store: LightningStore, spans: List[Any], refusals: otlp.Refusals
) -> Tuple[int, List[Tuple[int, BaseException]]]:
    """Store an OTLP export's spans: in one call, or, when the store refuses the batch (an unknown rollout or
    attempt, a span it cannot store), one call per (rollout, attempt), so that one bad id does not drop the
    other rollouts' spans. Refused groups are added to ``refusals``. Returns (spans stored or already there,
    [(status, error)] of the refused groups); a 5xx error (the store is closed) is raised."""
    groups: Dict[Tuple[str, str], List[Any]] = {}
    for span in spans:
        groups.setdefault((span.rollout_id, span.attempt_id), []).append(span)
    failures: Dict[Tuple[str, str], BaseException] = {}
    try:
        store.add_spans(spans)
    except _SPAN_REFUSALS as exc:
        if (error_status(exc) or 400) >= 500:
            raise
        if len(groups) == 1:
            failures[next(iter(groups))] = exc
        else:
            for key, group in groups.items():
                try:
                    store.add_spans(group)
                except _SPAN_REFUSALS as group_exc:
                    if (error_status(group_exc) or 400) >= 500:
                        raise
                    failures[key] = group_exc
    stored, refused = 0, []
    for key, group in groups.items():
        failure = failures.get(key)
        if failure is None:
            stored += len(group)
            continue
        hint = (
            (
                f" (set {semconv.OTLP_ROLLOUT_ID} and {semconv.OTLP_ATTEMPT_ID} to the ids of a rollout the "
                "runner is running: rollout.rollout_id, rollout.attempt.attempt_id)"
            )
            if isinstance(failure, KeyError)
            else ""
        )
        refusals.refuse(f"{failure}{hint}", key[0], len(group))
        refused.append((error_status(failure) or 400, failure))
    return stored, refused


class _OtlpRefused(Exception):
    """An OTLP export of which nothing was stored: the whole refusal message, answered with the status (and, for
    JSON clients, the error name and ids) of the store's first refusal."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def _otlp_error(media: str, status: int, exc: BaseException) -> Response:
    """An OTLP failure: a google.rpc.Status for protobuf clients, agl's error body for JSON ones."""
    if media == otlp.PROTOBUF:
        grpc_code = {404: 5, 415: 3}.get(status, 3)  # NOT_FOUND, INVALID_ARGUMENT
        return Response(otlp.status_response(grpc_code, str(exc)), status_code=status, media_type=media)
    if isinstance(exc, _OtlpRefused):  # the store's error (name, ids) with the whole export's message
        body = error_body(exc.cause).model_copy(update={"message": str(exc)})
        return Response(body.model_dump_json(exclude_none=True), status_code=status, media_type=otlp.JSON)
    name = type(exc).__name__ if error_status(exc) else "StoreRequestError"
    body = error_body(exc).model_copy(update={"error": name})
    return Response(body.model_dump_json(exclude_none=True), status_code=status, media_type=otlp.JSON)
