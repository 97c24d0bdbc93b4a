"""SGLang's GET (or POST) /get_weights_by_name {"name", "truncate_size"}: the first
`truncate_size` rows (default 100) of a checkpoint tensor as the ranks serve it, every rank's
shard put together (message.WeightReadMsg; scheduler/weight_read.py), as nested lists of
floats: what an RL loop compares with its trainer's tensor after an update. With several
data-parallel replicas, a list of each replica's. A name the model does not hold, a layer
kept quantized, or too many values is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, List

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from minisgl.message.types import WeightReadMsg
from minisgl.server.openapi import App
from minisgl.server.protocol import ApiError, Body, parse_body
from minisgl.server.streams import RequestStreams


class WeightReadBody(Body):
    name: str
    truncate_size: int = 100


async def _read(request: Request, read_body: Callable[[Request], Awaitable[bytes]]
                ) -> WeightReadBody:
    """The body, or (a GET without one) the query's name and truncate_size."""
    raw = await read_body(request)
    if raw.strip() or request.method != "GET":
        return parse_body(raw, WeightReadBody)
    query = request.query_params
    if "name" not in query:
        raise ApiError(400, "get_weights_by_name needs a name (a JSON body, or ?name=)",
                       "name")
    try:
        return WeightReadBody(name=query["name"],
                              truncate_size=int(query.get("truncate_size", "100")))
    except ValueError:
        raise ApiError(400, f"truncate_size must be an integer, got "
                            f"{query['truncate_size']!r:.40}", "truncate_size") from None


def install_weight_read_route(app: App, streams: RequestStreams, replicas: int,
                              read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """/get_weights_by_name (see the module's docstring) over `replicas` data-parallel
    replicas; `read_body`: a JSON body's bytes (api.json_body)."""
    app.body_models.append(WeightReadBody)

    @app.each_method("/get_weights_by_name", ["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Response:
        body = await _read(request, read_body)
        chunks = await streams.ask_replicas(
            lambda uid: WeightReadMsg(uid, body.name, body.truncate_size),
            list(range(replicas)))
        values: List[Any] = []
        for chunk in chunks:
            if chunk.error is not None or chunk.tensor is None:
                raise ApiError(400, chunk.error or "no values came back",
                               "truncate_size" if "truncate_size" in (chunk.error or "")
                               else "name")
            values.append(chunk.tensor.tolist())
        return JSONResponse(values[0] if replicas == 1 else values)
