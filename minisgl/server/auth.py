"""Who may use the HTTP API: the API key and, on loopback, the Host header.

`AccessCheck` is ASGI middleware around the app:
- with an API key, every endpoint but `OPEN_PATHS` (/health, /ping, /health_generate and
  /metrics, for probes and scrapers) needs `Authorization: Bearer KEY`, and the Messages API's paths take
  `x-api-key: KEY` too (what Anthropic's clients send); the key is compared in constant time
  (`hmac.compare_digest`, every header given compared), and a missing or wrong one gets a 401:
  OpenAI's `invalid_api_key`, Anthropic's `authentication_error` on its paths;
- when the server listens on loopback only, a request whose Host header is not a loopback
  name (localhost, 127.x.y.z, [::1], with or without a port) gets a 403: a web page whose
  name an attacker re-points at 127.0.0.1 (DNS rebinding) would otherwise reach the server
  from the victim's browser, which sends the attacker's name as Host.
JSON endpoints also refuse bodies of other content types (api.py, 415), so a cross-origin
form or text/plain POST, which a browser sends without asking, is never served.
"""

from __future__ import annotations

import hmac
from typing import List, Optional

from minisgl.server.error_shapes import ANTHROPIC_PATHS
from minisgl.server.hosts import host_name, is_loopback
from minisgl.server.limits import App, Receive, Scope, Send, header, route_path, send_error
from minisgl.server.protocol import ApiError

OPEN_PATHS = frozenset({"/health", "/ping", "/health_generate", "/metrics"})


def bearer(value: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(given: Optional[str], key: str) -> bool:
    """Constant-time comparison (the time does not tell how much of a guess was right)."""
    return hmac.compare_digest((given or "").encode(), key.encode())


def unauthorized(given: Optional[str], anthropic: bool = False) -> ApiError:
    """The 401 of a missing (`given` None) or wrong key; `anthropic`: on the Messages API."""
    if anthropic:
        message = ("x-api-key header is required" if given is None else "invalid x-api-key")
    else:
        message = ("You didn't provide an API key. You need to provide your API key in an "
                   "Authorization header using Bearer auth (i.e. Authorization: Bearer "
                   "YOUR_KEY)." if given is None else "Incorrect API key provided.")
    return ApiError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def given_keys(scope: Scope) -> List[str]:
    """The keys a request presents: its Bearer token and, on the Messages API's paths, its
    `x-api-key` header."""
    keys = [bearer(header(scope, b"authorization"))]
    if route_path(scope) in ANTHROPIC_PATHS:
        keys.append(header(scope, b"x-api-key"))
    return [k for k in keys if k is not None]


class AccessCheck:
    def __init__(self, app: App, api_key: Optional[str], loopback_only: bool) -> None:
        self.app, self.api_key, self.loopback_only = app, api_key, loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                await send_error(send, error, route_path(scope))
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> Optional[ApiError]:
        """Why the request may not go on, or None."""
        if self.loopback_only:
            host = header(scope, b"host")
            if host is not None and not is_loopback(host_name(host)):
                return ApiError(403, f"the Host header {host!r} is not a loopback name; this "
                                     f"server listens on loopback only", "Host",
                                code="invalid_host")
        path = route_path(scope)
        if self.api_key is not None and path not in OPEN_PATHS:
            given = given_keys(scope)
            # every key compared (no early exit): the time tells nothing of which one matched
            matched = [key_matches(k, self.api_key) for k in given]
            if not any(matched):
                return unauthorized(given[0] if given else None, path in ANTHROPIC_PATHS)
        return None
