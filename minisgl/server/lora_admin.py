"""LoRA adapters loaded and unloaded over HTTP, and the API server's list of them.

vLLM's endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"} and
POST /v1/unload_lora_adapter {"lora_name"}; success is 200 with a line of text, an error is
OpenAI's error body (400; 404 unloading a name not loaded). SGLang's: POST /load_lora_adapter
{"lora_name", "lora_path"} and POST /unload_lora_adapter {"lora_name"}, answered
{"success", "error_message", "loaded_adapters": {name: path}} (200, or 400 on failure).

Each change goes to every data-parallel replica (message.ReplicaChange, a uid each) and
waits for all their answers; a load that failed on some replica is unloaded again where it
succeeded, so every replica serves the same adapters. Changes run one at a time (a lock) and
this server's list changes only with the replicas' answers, so a request naming an adapter
is let through exactly while it is loaded (a request already past this check when its adapter
is unloaded gets the scheduler's refusal).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import Request

from minisgl.message.types import AdapterMsg
from minisgl.models.lora_config import RUNTIME_OFF, check_runtime_load
from minisgl.server.metrics import Gauge
from minisgl.server.openapi import App, body as body_schema
from minisgl.server.protocol import ApiError, Body, parse_body
from minisgl.server.streams import RequestStreams


class LoadBody(Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name


class UnloadBody(Body):
    lora_name: str


class Adapters:
    """The adapters every replica holds (name -> directory) and the changes to them.
    `runtime`: loads are allowed (EngineConfig.lora_runtime); `max_rank`: --max-lora-rank;
    `taken`: the served model's names, which an adapter may not take."""

    def __init__(self, streams: RequestStreams, replicas: int, runtime: bool, max_rank: int,
                 initial: Sequence[Tuple[str, str]], taken: Sequence[str]) -> None:
        self.streams, self.replicas = streams, replicas
        self.runtime, self.max_rank = runtime, max_rank
        self.paths: Dict[str, str] = dict(initial)
        self.taken = set(taken)
        self._lock = asyncio.Lock()

    def gauge(self) -> Gauge:
        """`minisgl_lora_adapters_loaded` for /metrics."""
        return Gauge("minisgl_lora_adapters_loaded",
                     "LoRA adapters loaded (every data-parallel replica holds the same).",
                     {None: len(self.paths)})

    async def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Load adapter `name` from `path` on every replica (with `inplace`, in place of the
        one of that name); ApiError (400) why not, after which nothing changed (an in-place
        load that fails leaves the name unloaded)."""
        if not self.runtime:
            raise ApiError(400, RUNTIME_OFF, "lora_name")
        if not name.strip() or name in self.taken:
            raise ApiError(400, f"{name!r} cannot name a LoRA adapter (it is empty, or a name "
                                f"of the served model)", "lora_name")
        try:  # the config's refusals here, quickly; the ranks read every file again
            # off the event loop: a hub id's adapter downloads here (the ranks find it cached)
            await asyncio.to_thread(check_runtime_load, name, path, self.runtime,
                                    self.max_rank)
        except ValueError as e:
            raise ApiError(400, str(e), "lora_path") from None
        async with self._lock:
            if name in self.paths and not inplace:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded.",
                               "lora_name")
            if name in self.paths:
                await self._unload(name)
            errors = await self._change(name, path)
            if any(errors):
                done = [r for r, e in enumerate(errors) if e is None]
                if done:
                    await self._change(name, None, done)
                raise ApiError(400, next(e for e in errors if e), "lora_path")
            self.paths[name] = str(Path(path).expanduser())

    async def unload(self, name: str) -> None:
        """Unload adapter `name` on every replica; ApiError 404 where it is not loaded."""
        async with self._lock:
            if name not in self.paths:
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                               "lora_adapter_not_found")
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        errors = await self._change(name, None)
        del self.paths[name]  # a replica that refused did not hold it either
        failed = [e for e in errors if e]
        if failed and len(failed) == len(errors):
            raise ApiError(400, failed[0], "lora_name")

    async def _change(self, name: str, path: Optional[str],
                      replicas: Optional[List[int]] = None) -> List[Optional[str]]:
        """Each replica's error (None: done) for loading (`path`) or unloading `name`."""
        targets = list(range(self.replicas)) if replicas is None else replicas
        return await self.streams.apply_change(lambda uid: AdapterMsg(uid, name, path),
                                               targets)


def install_adapter_routes(app: App, adapters: Adapters,
                           read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """vLLM's and SGLang's load / unload endpoints (see the module's docstring);
    `read_body`: a JSON body's bytes (api.json_body: 415 for another content type)."""
    app.body_models += [LoadBody, UnloadBody]
    load_schema, unload_schema = body_schema(LoadBody), body_schema(UnloadBody)

    async def body(request: Request, kind: Any) -> Any:
        return parse_body(await read_body(request), kind)

    @app.post("/v1/load_lora_adapter", openapi_extra=load_schema)
    async def vllm_load(request: Request) -> Response:
        b = await body(request, LoadBody)
        await adapters.load(b.lora_name, b.lora_path, b.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{b.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=unload_schema)
    async def vllm_unload(request: Request) -> Response:
        b = await body(request, UnloadBody)
        await adapters.unload(b.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{b.lora_name}' removed "
                                 f"successfully.")

    async def sglang_answer(change: Any) -> Response:
        try:
            await change
        except ApiError as e:
            return JSONResponse({"success": False, "error_message": e.message,
                                 "loaded_adapters": adapters.paths}, status_code=400)
        return JSONResponse({"success": True, "error_message": "",
                             "loaded_adapters": adapters.paths})

    @app.post("/load_lora_adapter", openapi_extra=load_schema)
    async def sglang_load(request: Request) -> Response:
        b = await body(request, LoadBody)
        return await sglang_answer(adapters.load(b.lora_name, b.lora_path))

    @app.post("/unload_lora_adapter", openapi_extra=unload_schema)
    async def sglang_unload(request: Request) -> Response:
        b = await body(request, UnloadBody)
        return await sglang_answer(adapters.unload(b.lora_name))
