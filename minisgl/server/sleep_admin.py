"""Sleep mode over HTTP, as vLLM serves it (with `--enable-sleep-mode`; engine/sleep.py):

- POST /sleep?level=1 (or 2; a JSON body {"level": 2} too): every data-parallel replica lets its
  running requests finish, then hands back its device memory (level 1 keeps the weights in host
  memory, level 2 forgets them, for a reload; the KV cache and the prefix cache are forgotten at
  either). 200, empty. Requests that arrive meanwhile or while asleep wait, and run once a
  wake-up leaves nothing asleep. `mode=abort` (vLLM's) ends the running requests at once
  (finish_reason "abort") instead of waiting for them (`mode=wait`, the default here).
- POST /wake_up (?tags=weights&tags=kv_cache; none: both): the parts named take their memory
  again (the RL loop's order: wake the weights, reload them with /update_weights_from_disk,
  then wake the KV cache, so the two never hold memory at once with a trainer's). 200, empty;
  where a replica cannot (its GPU out of memory: another process holds it), a 500 naming
  why, that replica asleep as it was.
- GET /is_sleeping: {"is_sleeping": true} while any part of any replica sleeps.
- /metrics: vLLM's `vllm:engine_sleep_state` state set, 1 for the service's state: "awake",
  "weights_offloaded" (level 1), "discard_all" (level 2), or "kv_cache_discarded" (the KV
  cache alone asleep: SGLang's partial release); the deepest of any replica's.

And SGLang's (`--enable-memory-saver` is the same flag): POST /release_memory_occupation
{"tags": [...]} (none: all) puts the parts named to sleep, at level 1 with
`--enable-weights-cpu-backup`, else 2 (SGLang forgets the weights unless backed up); POST
/resume_memory_occupation {"tags": [...]} wakes them. Both answer 200 with SGLang's
{"success": true, "message": ...}. Its "cuda_graph" tag is accepted beside the others (the
graphs go and come back with them); alone it is a 400.

A bad level or tag is a 400 naming it; without `--enable-sleep-mode` the routes do not exist
(404), as in vLLM. Changes run one at a time (a lock).
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, FrozenSet, List, Optional, Tuple, TypeVar

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from minisgl.engine.sleep_parts import TAGS, check_level, check_tags, sglang_parts
from minisgl.message.types import SleepMsg, WakeMsg
from minisgl.server.metrics import Gauge
from minisgl.server.openapi import App, body as body_schema
from minisgl.server.protocol import ApiError, Body, parse_body
from minisgl.server.streams import RequestStreams, first_replica_error

T = TypeVar("T")


class Sleep:
    """What sleeps on each replica, as their answers said, and the changes to it."""

    def __init__(self, streams: RequestStreams, replicas: int) -> None:
        self.streams = streams
        self.asleep: List[FrozenSet[str]] = [frozenset()] * replicas
        self.levels = [0] * replicas  # each replica's last sleep's level
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return any(self.asleep)

    async def sleep(self, level: int, tags: Tuple[str, ...] = ()) -> None:
        """The parts `tags` names (empty: both) of every replica asleep at `level`; ApiError
        (500) naming a replica's error."""
        async with self._lock:
            errors = await self.streams.apply_change(lambda uid: SleepMsg(uid, level, tags),
                                                     list(range(len(self.asleep))))
            for r, error in enumerate(errors):
                if error is None:
                    self.asleep[r] |= frozenset(tags or TAGS)
                    self.levels[r] = level
            _raise_first(errors, "sleep")

    async def wake_up(self, tags: Tuple[str, ...]) -> None:
        """The parts `tags` names (empty: both) awake on every replica; ApiError (500)
        naming a replica's error, that replica asleep as it was."""
        async with self._lock:
            errors = await self.streams.apply_change(lambda uid: WakeMsg(uid, tags),
                                                     list(range(len(self.asleep))))
            for r, error in enumerate(errors):
                if error is None:
                    self.asleep[r] -= frozenset(tags or TAGS)
            _raise_first(errors, "wake_up")


    def gauge(self) -> Gauge:
        """vLLM's `vllm:engine_sleep_state` for /metrics (see the module doc)."""
        order = ["awake", "kv_cache_discarded", "weights_offloaded", "discard_all"]
        deepest = max((0 if not parts else 1 if "weights" not in parts else 1 + level)
                      for parts, level in zip(self.asleep, self.levels))
        return Gauge("vllm:engine_sleep_state", "Sleep mode's state: 1 for the service's "
                     "(the deepest of any replica's).",
                     {state: float(i == deepest) for i, state in enumerate(order)},
                     "sleep_state")


def _raise_first(errors: List[Optional[str]], what: str) -> None:
    error = first_replica_error(errors)
    if error is not None:
        raise ApiError(500, f"{what} failed on {error}", kind="server_error")


async def _level(request: Request) -> int:
    """The sleep level a /sleep names: the query's `level`, else a JSON body's, else 1;
    ApiError (400) naming a bad one."""
    raw: object = request.query_params.get("level")
    if raw is None:
        body = await request.body()
        try:
            raw = json.loads(body).get("level", 1) if body.strip() else 1
        except (ValueError, AttributeError):
            raise ApiError(400, "the /sleep body must be a JSON object such as {\"level\": 1}",
                           "level") from None
    level = int(str(raw)) if str(raw) in ("1", "2") else raw
    return _checked(lambda: check_level(level), "level")


def _checked(check: Callable[[], T], param: str) -> T:
    """`check()`'s value; its ValueError as a 400 naming `param`."""
    try:
        return check()
    except ValueError as e:
        raise ApiError(400, str(e), param) from None


def _tags(request: Request) -> Tuple[str, ...]:
    """The parts a /wake_up names (its `tags`, repeated; none: both); ApiError (400) naming
    an unknown one."""
    return _checked(lambda: check_tags(request.query_params.getlist("tags")), "tags")


class TagsBody(Body):
    tags: Optional[List[str]] = None


def install_sleep_routes(app: App, sleep: Sleep, cpu_backup: bool,
                         read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """vLLM's POST /sleep, POST /wake_up and GET /is_sleeping, SGLang's POST
    /release_memory_occupation and /resume_memory_occupation (see the module's docstring);
    `cpu_backup`: SGLang's release keeps the weights in host memory."""
    app.body_models.append(TagsBody)

    async def tags_of(request: Request) -> Tuple[str, ...]:
        raw = await read_body(request)
        body = parse_body(raw, TagsBody) if raw.strip() else TagsBody()
        return _checked(lambda: sglang_parts(body.tags), "tags")

    @app.post("/release_memory_occupation", openapi_extra=body_schema(TagsBody))
    async def release_route(request: Request) -> Response:
        await sleep.sleep(1 if cpu_backup else 2, await tags_of(request))
        return JSONResponse({"success": True, "message": "Succeeded to release memory."})

    @app.post("/resume_memory_occupation", openapi_extra=body_schema(TagsBody))
    async def resume_route(request: Request) -> Response:
        await sleep.wake_up(await tags_of(request))
        return JSONResponse({"success": True, "message": "Succeeded to resume memory."})

    @app.post("/sleep")
    async def sleep_route(request: Request) -> Response:
        level, mode = await _level(request), request.query_params.get("mode", "wait")
        if mode not in ("wait", "abort"):
            raise ApiError(400, f"sleep mode must be 'wait' (the running requests finish "
                                f"first) or 'abort' (they end at once), not {mode!r}", "mode")
        if mode == "abort":
            sleep.streams.abort_all()
        await sleep.sleep(level)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up_route(request: Request) -> Response:
        await sleep.wake_up(_tags(request))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping_route() -> Response:
        return JSONResponse({"is_sleeping": sleep.is_sleeping})

