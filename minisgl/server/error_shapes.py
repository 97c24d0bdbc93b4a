"""The shape of an error body, chosen by the request's path: Anthropic's on the Messages API's
paths, OpenAI's everywhere else. The API's handlers and the middleware that answers before them
(auth.py's 401, limits.py's 413/408) both pick the shape here, so a client of either API reads
its own shape whichever layer refused the request."""

from __future__ import annotations

from typing import Any, Dict

from minisgl.server.protocol import ApiError

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ANTHROPIC_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})
# Anthropic's error type for each status (429 here is the server's load, never a client quota)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "overloaded_error"}


def anthropic_error_body(e: ApiError) -> Dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`: the type Anthropic gives the status
    (another 4xx: invalid_request_error, a 5xx: api_error)."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_body(e: ApiError, path: str) -> Dict[str, Any]:
    """The error body a client of `path` reads: Anthropic's on the Messages API's paths, OpenAI's
    (`e.body()`) everywhere else."""
    return anthropic_error_body(e) if path in ANTHROPIC_PATHS else e.body()
