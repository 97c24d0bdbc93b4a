"""Bounds on what one HTTP request may cost the API server before any handler sees it.

`BodyLimits` is ASGI middleware around the app:
- a body larger than `max_bytes` gets a 413, from its `Content-Length` before a byte of it is
  read, and while it is read for a body without one (chunked) or one longer than it claims;
- a body not fully received within `timeout_s` of the request's start (a client that sends
  less than its `Content-Length`, or trickles it) gets a 408 and its connection is closed, so
  that no client can hold a connection and its handler forever.
Once the body is in, the app's later `receive` calls (disconnect watching) pass through.
`header` and `route_path` read a request's scope for this and the other middlewares.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Tuple

from minisgl.server.error_shapes import error_body
from minisgl.server.protocol import ApiError

Scope = Dict[str, Any]
Message = Dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_CLOSE = {"Connection": "close"}


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes",
                    headers=_CLOSE)


def too_slow(timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                    kind="invalid_request_error", code="request_timeout", headers=_CLOSE)


def route_path(scope: Mapping[str, Any]) -> str:
    """The request's path as the app's routes name it: behind a proxy that serves the API
    under a prefix (--root-path; uvicorn puts the prefix in front of every path it receives,
    as the ASGI spec has it), that prefix removed (as Starlette's router removes it)."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


def header(scope: Scope, name: bytes) -> Optional[str]:
    """The value of the first header `name` (lowercase), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send: Send, e: ApiError, path: str = "") -> None:
    """A whole JSON error response, straight on the ASGI connection, in the shape the request's
    `path` speaks (error_shapes.error_body)."""
    body = json.dumps(error_body(e, path)).encode()
    headers: List[Tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimits:
    def __init__(self, app: App, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_error(send, ApiError(400, f"invalid Content-Length {declared!r}",
                                                headers=_CLOSE), scope.get("path", ""))
                return
            if int(declared) > self.max_bytes:
                await send_error(send, too_large(self.max_bytes), scope.get("path", ""))
                return
        await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive: Receive) -> Receive:
        """`receive` with the body's byte count and deadline enforced (ApiError, which the
        app's handlers turn into the response)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        state = {"bytes": 0, "done": False}

        async def bounded() -> Message:
            if state["done"]:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise too_slow(self.timeout_s) from None
            if msg["type"] != "http.request":
                state["done"] = True
                return msg
            state["bytes"] += len(msg.get("body", b""))
            if state["bytes"] > self.max_bytes:
                raise too_large(self.max_bytes)
            state["done"] = not msg.get("more_body", False)
            return msg

        return bounded
