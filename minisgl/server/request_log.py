"""Request ids and the access log: one line per HTTP request, for operators.

`RequestLog` is the outermost ASGI middleware:
- every request has an id: the client's `X-Request-Id` header (vLLM's and most proxies'
  convention; 1 to `MAX_ID_CHARS` printable ASCII characters, else a 400 naming the header), or
  a fresh one. Handlers read it from `request.state.request_id` (a completion's `id` is built
  from it, as vLLM builds it), and every response carries it back in `X-Request-Id`
  (unless `echo_id` is off);
- with `enabled`, when the response has gone out (a stream's last event), or the client left,
  one INFO line names the client, method, path, status ("unfinished" where the response did
  not end: the client left, or the server failed), the time from the request's arrival,
  the request id and the scheduler uids of its choices (`request.state.uids`, set by the job
  runner), so that a client's id leads to the uids in the other processes' logs. Probes and
  scrapes (`QUIET_PATHS`) are logged at DEBUG: a load balancer's health checks every few
  seconds would bury the requests;
- every request, logged or not, is handed to `count` with its route (`route_label`) and its
  status, once: the /metrics counter of HTTP answers, refusals before any request reached
  the scheduler (a bad body's 400, a 401, a 413) included.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from minisgl.server.limits import (App, Message, Receive, Scope, Send, header, route_path,
                                   send_error)
from minisgl.server.protocol import MAX_ID_CHARS, ApiError, request_id_error

__all__ = ["MAX_ID_CHARS", "REQUEST_ID_HEADER", "RequestLog", "bad_request_id", "route_label"]

logger = logging.getLogger("minisgl.api")
REQUEST_ID_HEADER = "X-Request-Id"
QUIET_PATHS = frozenset({"/health", "/ping", "/health_generate", "/metrics"})


def bad_request_id(value: str) -> Optional[ApiError]:
    """Why a client's request id header cannot be used (it is echoed and logged), or None."""
    return request_id_error(value, f"the {REQUEST_ID_HEADER} header", REQUEST_ID_HEADER)


def route_label(scope: Scope) -> str:
    """The request's route as its app declares it (`/v1/models/{name:path}`, not the model's
    name: a bounded set of labels), its path where routing never ran but the path is a route's
    (a 401 before it), else "other" (no such route)."""
    routes = getattr(scope.get("app"), "routes", ())
    endpoint = scope.get("endpoint")
    path = route_path(scope)
    for route in routes:
        template = getattr(route, "path", None)
        if endpoint is not None and getattr(route, "endpoint", None) is endpoint:
            return str(template)
        if endpoint is None and template == path:
            return path
    return "other"


def request_state(scope: Scope) -> Dict[str, Any]:
    """The request's `request.state` (Starlette keeps it in the scope)."""
    state: Dict[str, Any] = scope.setdefault("state", {})
    return state


class RequestLog:
    """See the module's doc; `echo_id` false: responses do not carry the id back (the
    --no-request-id-headers setting)."""

    def __init__(self, app: App, enabled: bool,
                 count: Optional[Callable[[str, str], None]] = None,
                 echo_id: bool = True) -> None:
        self.app, self.enabled, self.count, self.echo_id = app, enabled, count, echo_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        given = header(scope, REQUEST_ID_HEADER.lower().encode())
        error = None if given is None else bad_request_id(given)
        rid = given if given is not None and error is None else uuid.uuid4().hex
        status: List[int] = []
        if error is not None:
            await send_error(self._tagged(send, rid, status), error, route_path(scope))
            self._log(scope, rid, status, start, done=True)
            return
        request_state(scope)["request_id"] = rid
        done = False

        async def send_tagged(message: Message) -> None:
            nonlocal done
            await self._tagged(send, rid, status)(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done = True
                self._log(scope, rid, status, start, done)

        try:
            await self.app(scope, receive, send_tagged)
        finally:
            if not done:  # the client left before the response ended, or the app failed
                self._log(scope, rid, status, start, done)

    def _tagged(self, send: Send, rid: str, status: List[int]) -> Send:
        """`send`, adding the id header to the response's start (where `echo_id`) and
        noting its status."""
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if self.echo_id:
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (b"x-request-id", rid.encode())]}
            await send(message)
        return tagged

    def _log(self, scope: Scope, rid: str, status: List[int], start: float, done: bool) -> None:
        code = str(status[0]) if status else "-"
        if self.count is not None:
            self.count(route_label(scope), code if done else "unfinished")
        if not self.enabled:
            return
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        uids = request_state(scope).get("uids")
        path = scope.get("path", "-")
        level = logging.DEBUG if route_path(scope) in QUIET_PATHS else logging.INFO
        logger.log(level, "%s %s %s %s%s %.1f ms request_id=%s%s", who, scope.get("method", "-"),
                   path, code, "" if done else " (unfinished)",
                   (time.monotonic() - start) * 1000, rid,
                   f" uids={','.join(map(str, uids))}" if uids else "")
