"""Generation paused and resumed over HTTP, as async RL loops do around a weight update
(message.PauseMsg):

- vLLM's POST /pause?mode=abort|wait|keep (vLLM's default abort: the running requests end with
  finish_reason "abort"; wait: they finish first; keep: they stay where they are, their KV
  kept, and continue after the resume; its older `wait_for_inflight_requests=true` is wait),
  POST /resume, GET /is_paused {"is_paused": bool}. 200, empty.
- SGLang's POST /pause_generation {"mode": "abort" | "in_place" | "retract"} (in_place and
  retract keep the requests in place) and POST /continue_generation, answered as SGLang's
  {"success", "message"}.

While paused no batch runs on any replica and requests that arrive wait (queued, as behind a
reload); a weight reload (/update_weights_from_disk, /update_weights_from_distributed) applies
at once, so kept requests continue on the new weights. A bad mode is a 400 naming it.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, List, Optional

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from minisgl.message.types import PauseMsg
from minisgl.server.openapi import App, body as body_schema
from minisgl.server.protocol import ApiError, Body, parse_body
from minisgl.server.streams import RequestStreams, first_replica_error

MODES = ("abort", "wait", "keep")
_SGLANG_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


class Pause:
    """Whether generation is paused (every replica answered), and the changes to it."""

    def __init__(self, streams: RequestStreams, replicas: int) -> None:
        self.streams, self.replicas = streams, replicas
        self.paused = False
        self._lock = asyncio.Lock()

    async def pause(self, mode: str) -> None:
        """Every replica paused (`mode`: MODES); ApiError (500) naming a replica's error."""
        async with self._lock:
            if mode == "abort":
                self.streams.abort_all()
            await self._change(lambda uid: PauseMsg(uid, wait=mode == "wait"))
            self.paused = True

    async def resume(self) -> None:
        async with self._lock:
            await self._change(lambda uid: PauseMsg(uid, resume=True))
            self.paused = False

    async def _change(self, change: Callable[[int], PauseMsg]) -> None:
        errors: List[Optional[str]] = await self.streams.apply_change(
            change, list(range(self.replicas)))
        error = first_replica_error(errors)
        if error is not None:
            raise ApiError(409, error, kind="invalid_request_error")


class PauseBody(Body):
    mode: str = "abort"


def _vllm_mode(request: Request) -> str:
    """/pause's mode: `mode`, else the older `wait_for_inflight_requests`, else abort."""
    mode = request.query_params.get("mode")
    if mode is None:
        waits = request.query_params.get("wait_for_inflight_requests", "false").lower()
        mode = "wait" if waits in ("1", "true") else "abort"
    if mode not in MODES:
        raise ApiError(400, f"pause mode must be 'abort', 'wait' or 'keep', not {mode!r}",
                       "mode")
    return mode


def install_pause_routes(app: App, pause: Pause,
                         read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """vLLM's /pause, /resume, /is_paused; SGLang's /pause_generation, /continue_generation
    (see the module's docstring)."""
    app.body_models.append(PauseBody)

    @app.post("/pause")
    async def pause_route(request: Request) -> Response:
        await pause.pause(_vllm_mode(request))
        return Response(status_code=200)

    @app.post("/resume")
    async def resume_route() -> Response:
        await pause.resume()
        return Response(status_code=200)

    @app.get("/is_paused")
    async def is_paused_route() -> Response:
        return JSONResponse({"is_paused": pause.paused})

    @app.post("/pause_generation", openapi_extra=body_schema(PauseBody))
    async def pause_generation(request: Request) -> Response:
        raw = await read_body(request)
        body = parse_body(raw, PauseBody) if raw.strip() else PauseBody()
        if body.mode not in _SGLANG_MODES:
            raise ApiError(400, f"pause_generation mode must be 'abort', 'in_place' or "
                                f"'retract', not {body.mode!r}", "mode")
        await pause.pause(_SGLANG_MODES[body.mode])
        return JSONResponse({"success": True, "message": "Generation paused."})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await pause.resume()
        return JSONResponse({"success": True, "message": "Generation continued."})
