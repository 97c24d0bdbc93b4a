"""Profiling over HTTP (vLLM's and SGLang's routes; scheduler/profiler.py): POST /start_profile
starts torch.profiler on every rank of every replica, POST /stop_profile stops it and each rank
writes its trace to the server's profile_dir (--profile-dir). A request body is not read (the
server, not the client, says where traces go). 200 with a line of text; a start while one
runs, a stop with none running, or profiling off (no --profile-dir): a 400 saying so.
"""

from __future__ import annotations

import asyncio
import time
from typing import List, Optional

from fastapi.responses import PlainTextResponse, Response

from minisgl.message.types import ProfileMsg
from minisgl.server.openapi import App
from minisgl.server.protocol import ApiError
from minisgl.server.streams import RequestStreams, first_replica_error


def install_profile_routes(app: App, streams: RequestStreams, replicas: int) -> None:
    lock = asyncio.Lock()  # one start or stop at a time: each is every replica's

    async def change(start: bool) -> None:
        name = f"minisgl-{time.strftime('%Y%m%d-%H%M%S')}"
        async with lock:
            errors: List[Optional[str]] = await streams.apply_change(
                lambda uid: ProfileMsg(uid, start, name), list(range(replicas)))
        error = first_replica_error(errors)
        if error is not None:
            raise ApiError(400, error, kind="invalid_request_error")

    @app.post("/start_profile")
    async def start_profile() -> Response:
        await change(True)
        return PlainTextResponse("Start profiling.\n")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        await change(False)
        return PlainTextResponse("Stop profiling. The traces are in the server's "
                                 "profile_dir.\n")
