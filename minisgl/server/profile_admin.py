"""Profiling over HTTP (vLLM's and SGLang's routes; scheduler/profiler.py): /start_profile
starts torch.profiler on every rank of every replica, /stop_profile stops it and each rank
writes its trace under the server's profile_dir (--profile-dir). Both take POST (and GET, as
SGLang). /start_profile takes SGLang's optional body: `num_steps` (stop by itself after that
many steps; a /stop_profile is then not needed), `activities` (CPU, GPU, MEM), `with_stack`,
`record_shapes`, `profile_prefix` (the traces' name) and `output_dir` (a directory inside
profile_dir: a client never writes elsewhere). 200 with a line of text; a start while one runs,
a stop with none running, profiling off, an output_dir outside profile_dir, or a field this
server does not take (`start_step`, `merge_profiles`, `profile_by_stage`, SGLang's RPD and
CUDA_PROFILER activities): a 400 naming it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, List, Optional

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from minisgl.message.types import PROFILE_ACTIVITIES, ProfileMsg
from minisgl.server.openapi import App, body as body_schema
from minisgl.server.protocol import ApiError, Body, parse_body, refuse_unsupported
from minisgl.server.streams import RequestStreams, first_replica_error

# SGLang's fields with no effect here, each with the test for a value that asks for nothing
_UNSUPPORTED = {"start_step": lambda v: v is None, "merge_profiles": lambda v: not v,
                "profile_by_stage": lambda v: not v, "profile_stages": lambda v: not v}


class ProfileBody(Body):
    """SGLang's /start_profile body (every field optional)."""

    output_dir: Optional[str] = None
    num_steps: Optional[int] = None
    activities: Optional[List[str]] = None
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None
    profile_prefix: Optional[str] = None


def start_message(body: ProfileBody, uid: int, started: str) -> ProfileMsg:
    """The start `body` asks for (`started`: the time in the traces' name); ApiError(400)
    naming a field out of range or not taken."""
    refuse_unsupported(body.model_extra or {}, _UNSUPPORTED)
    if body.num_steps is not None and body.num_steps < 1:
        raise ApiError(400, f"num_steps must be >= 1, got {body.num_steps}", "num_steps")
    activities = tuple(body.activities) if body.activities is not None else ("CPU", "GPU")
    unknown = [a for a in activities if a not in PROFILE_ACTIVITIES]
    if unknown or not activities:
        raise ApiError(400, f"activities must be some of {', '.join(PROFILE_ACTIVITIES)}, got "
                            f"{', '.join(unknown) or 'none'}", "activities")
    prefix = body.profile_prefix or "minisgl"
    if "/" in prefix or len(prefix) > 100:
        raise ApiError(400, "profile_prefix must be a file name part (no '/', at most 100 "
                            "characters)", "profile_prefix")
    return ProfileMsg(uid, True, f"{prefix}-{started}", body.num_steps, activities,
                      bool(body.with_stack), bool(body.record_shapes), body.output_dir)


def install_profile_routes(app: App, streams: RequestStreams, replicas: int,
                           read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    lock = asyncio.Lock()  # one start or stop at a time: each is every replica's

    async def change(message: Callable[[int], ProfileMsg]) -> None:
        async with lock:
            errors: List[Optional[str]] = await streams.apply_change(
                message, list(range(replicas)))
        error = first_replica_error(errors)
        if error is not None:
            param = "output_dir" if error.startswith("output_dir ") else None
            raise ApiError(400, error, param, kind="invalid_request_error")

    async def start_profile(request: Request) -> Response:
        raw = await read_body(request) if request.method == "POST" else b""
        body = parse_body(raw, ProfileBody) if raw.strip() else ProfileBody()
        started = time.strftime("%Y%m%d-%H%M%S")
        start_message(body, 0, started)  # a bad body refused before any rank hears of it
        await change(lambda uid: start_message(body, uid, started))
        steps = "" if body.num_steps is None else f" for {body.num_steps} steps"
        return PlainTextResponse(f"Start profiling{steps}.\n")

    # one route a method: one of several methods would document them under one operation id
    app.post("/start_profile", openapi_extra=body_schema(ProfileBody))(start_profile)
    app.get("/start_profile")(start_profile)

    @app.each_method("/stop_profile", ["POST", "GET"])
    async def stop_profile() -> Response:
        await change(lambda uid: ProfileMsg(uid, False))
        return PlainTextResponse("Stop profiling. The traces are in the server's "
                                 "profile_dir.\n")
