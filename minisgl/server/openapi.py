"""The request bodies in `/openapi.json`.

Handlers read the raw body and validate it themselves (protocol.parse_body: this API's error
messages and 4xx codes), so FastAPI cannot see their body models. `body(Model)` is a route's
`openapi_extra` naming the model; `App` is the FastAPI app whose schema also carries every named
model (and the models they use) under `components.schemas`, so clients and fuzzers can learn
the API from it. A route that answers several methods is one route per method
(`App.each_method`): each is then an operation with its own id, as OpenAPI requires.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Type, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
F = TypeVar("F", bound=Callable[..., Any])


def body(model: Type[BaseModel]) -> Dict[str, Any]:
    """The `openapi_extra` of a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


class App(FastAPI):
    """FastAPI with `body_models`, whose schemas go into the OpenAPI document."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body_models: List[Type[BaseModel]] = []

    def each_method(self, path: str, methods: Sequence[str]) -> Callable[[F], F]:
        """A decorator routing each of `methods` at `path` to the endpoint, one route apiece
        (one route of several methods would document them all under one operation id)."""
        def register(endpoint: F) -> F:
            for method in methods:
                self.add_api_route(path, endpoint, methods=[method])
            return endpoint
        return register

    def openapi(self) -> Dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            _, defs = models_json_schema([(m, "validation") for m in self.body_models],
                                         ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            self.openapi_schema = schema
        return self.openapi_schema
