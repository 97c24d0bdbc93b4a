"""The request bodies in `/openapi.json`.

Handlers read the raw body and validate it themselves (protocol.parse_body: this API's error
messages and 4xx codes), so FastAPI cannot see their body models. `body(Model)` is a route's
`openapi_extra` naming the model; `App` is the FastAPI app whose schema also carries every named
model (and the models they use) under `components.schemas`, so clients and fuzzers can learn
the API from it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Type

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def body(model: Type[BaseModel]) -> Dict[str, Any]:
    """The `openapi_extra` of a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


class App(FastAPI):
    """FastAPI with `body_models`, whose schemas go into the OpenAPI document."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body_models: List[Type[BaseModel]] = []

    def openapi(self) -> Dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            _, defs = models_json_schema([(m, "validation") for m in self.body_models],
                                         ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            self.openapi_schema = schema
        return self.openapi_schema
