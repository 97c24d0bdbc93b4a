"""Sleep mode over HTTP, as vLLM serves it (with `--enable-sleep-mode`; engine/sleep.py):

- POST /sleep?level=1 (or 2; a JSON body {"level": 2} too): every data-parallel replica lets its
  running requests finish, then hands back its device memory (level 1 keeps the weights in host
  memory, level 2 forgets them, for a reload; the KV cache and the prefix cache are forgotten at
  either). 200, empty. Requests that arrive meanwhile or while asleep wait, and run once a
  wake-up leaves nothing asleep.
- POST /wake_up (?tags=weights&tags=kv_cache; none: both): the parts named take their memory
  again (the RL loop's order: wake the weights, reload them with /update_weights_from_disk,
  then wake the KV cache, so the two never hold memory at once with a trainer's). 200, empty;
  where a replica cannot (its GPU out of memory: another process holds it), a 500 naming
  why, that replica asleep as it was.
- GET /is_sleeping: {"is_sleeping": true} while any part of any replica sleeps.

A bad level or tag is a 400 naming it; without `--enable-sleep-mode` the routes do not exist
(404), as in vLLM. Changes run one at a time (a lock).
"""

from __future__ import annotations

import asyncio
import json
from typing import FrozenSet, List, Optional, Tuple

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from minisgl.message.types import SleepMsg, WakeMsg
from minisgl.server.openapi import App
from minisgl.server.protocol import ApiError
from minisgl.server.streams import RequestStreams

_TAGS = ("weights", "kv_cache")  # engine/sleep.py's (the API server imports no torch)


class Sleep:
    """What sleeps on each replica, as their answers said, and the changes to it."""

    def __init__(self, streams: RequestStreams, replicas: int) -> None:
        self.streams = streams
        self.asleep: List[FrozenSet[str]] = [frozenset()] * replicas
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        return any(self.asleep)

    async def sleep(self, level: int) -> None:
        """Every replica asleep at `level`; ApiError (500) naming a replica's error."""
        async with self._lock:
            errors = await self.streams.apply_change(lambda uid: SleepMsg(uid, level),
                                                     list(range(len(self.asleep))))
            for r, error in enumerate(errors):
                if error is None:
                    self.asleep[r] = frozenset(_TAGS)
            _raise_first(errors, "sleep")

    async def wake_up(self, tags: Tuple[str, ...]) -> None:
        """The parts `tags` names (empty: both) awake on every replica; ApiError (500)
        naming a replica's error, that replica asleep as it was."""
        async with self._lock:
            errors = await self.streams.apply_change(lambda uid: WakeMsg(uid, tags),
                                                     list(range(len(self.asleep))))
            for r, error in enumerate(errors):
                if error is None:
                    self.asleep[r] -= frozenset(tags or _TAGS)
            _raise_first(errors, "wake_up")


def _raise_first(errors: List[Optional[str]], what: str) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, error = failed[0]
        where = f"replica {r}: " if len(errors) > 1 else ""
        raise ApiError(500, f"{what} failed on {where}{error}", kind="server_error")


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
    if str(raw) not in ("1", "2"):
        raise ApiError(400, f"sleep level must be 1 (weights kept in host memory) or 2 "
                            f"(weights forgotten), not {raw!r}", "level")
    return int(str(raw))


def _tags(request: Request) -> Tuple[str, ...]:
    """The parts a /wake_up names (its `tags`, repeated); ApiError (400) naming an unknown
    one."""
    tags = request.query_params.getlist("tags")
    unknown = [t for t in tags if t not in _TAGS]
    if unknown:
        raise ApiError(400, f"unknown wake_up tag {unknown[0]!r}: tags are 'weights' and "
                            f"'kv_cache'", "tags")
    return tuple(t for t in _TAGS if t in tags)


def install_sleep_routes(app: App, sleep: Sleep) -> None:
    """vLLM's POST /sleep, POST /wake_up and GET /is_sleeping (see the module's docstring)."""

    @app.post("/sleep")
    async def sleep_route(request: Request) -> Response:
        await sleep.sleep(await _level(request))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up_route(request: Request) -> Response:
        await sleep.wake_up(_tags(request))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping_route() -> Response:
        return JSONResponse({"is_sleeping": sleep.is_sleeping})

