"""What the endpoint modules share: their router (:class:`StoreRouter`), request bodies parsed in one step
(:func:`parse_body`) and answers serialised once (:func:`as_json`, :func:`as_rollouts`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Type, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.types import DecoratedCallable
from pydantic import BaseModel, TypeAdapter, ValidationError

from agl.store.http.server.errors import ERROR_RESPONSES
from agl.store.http.wire import RolloutList
from agl.types import Rollout

_ROLLOUTS = TypeAdapter(RolloutList)


def as_json(model: Any) -> Response:
    """A pre-serialised JSON response (the response models are only used for the OpenAPI schema)."""
    return Response(model.model_dump_json(), media_type="application/json")


def as_rollouts(rollouts: List[Rollout]) -> Response:
    return Response(_ROLLOUTS.dump_json(RolloutList(rollouts=rollouts)), media_type="application/json")


Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, model: Type[Body]) -> Body:
    """The request's JSON body as ``model``, parsed from the raw bytes in one step by pydantic's JSON parser.

    Why not a FastAPI body parameter: FastAPI decodes with ``json.loads`` and then validates the objects, ~15 µs
    more per small request (dequeue, complete: ``benchmarks/server_overhead.py``) and ~3x the cost for a batch
    of 1,000 spans. Errors are the same 422 that FastAPI gives, naming the field.
    """
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


class StoreRouter(APIRouter):
    """The endpoints of one area under ``/v1``, each documenting the error answers they share.

    The app takes their routes as its own (:func:`agl.store.http.server.app.create_app`) rather than
    including the router: FastAPI (0.16x) matches the routes of an included router through an extra layer on
    every request, ~55 of the ~170 microseconds of server CPU a light request costs (measured with
    ``GET /v1/resources``); routes of the app are matched directly.
    """

    def __init__(self, tag: Optional[str] = None) -> None:
        """``tag``: the OpenAPI tag of every endpoint of the area (None: each endpoint names its own)."""
        super().__init__(prefix="/v1", responses=ERROR_RESPONSES, tags=None if tag is None else [tag])
        self.bodies: List[Type[BaseModel]] = []  # models of bodies the endpoints parse themselves (parse_body)

    def post(
        self, path: str, *, body: Optional[Type[BaseModel]] = None, **kwargs: Any
    ) -> Callable[[DecoratedCallable], DecoratedCallable]:
        """``body``: the model of a JSON body the endpoint parses with :func:`parse_body`, for the OpenAPI document."""
        if body is not None:
            self.bodies.append(body)
            schema = {"$ref": f"#/components/schemas/{body.__name__}"}
            kwargs["openapi_extra"] = {
                "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}
            }
        return super().post(path, **kwargs)


def document_models(app: FastAPI, models: List[Type[BaseModel]]) -> None:
    """Add the models of bodies that endpoints parse themselves to the OpenAPI components (FastAPI documents
    only the bodies it parses); a model FastAPI already documents keeps FastAPI's schema."""
    generate = app.openapi

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                found = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in found.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components.setdefault(model.__name__, found)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
