"""SageMaker's `POST /invocations` (vLLM's): one route for every kind of request, told apart by
the body's fields, as vLLM tries its request types in turn: `messages` a chat completion,
`prompt` a completion, `input` an embedding (a classification where the model is a
classifier), `query` a rerank, `text_1` a score. Anything else is a 400 listing the fields
looked for; the request then goes to that endpoint's own handler, which judges it whole.
"""

from __future__ import annotations

import json
from typing import Any

from minisgl.server.protocol import ApiError

# (a field the body has, the route it goes to), in the order vLLM tries its request types
_ROUTES = (("messages", "chat"), ("prompt", "completions"), ("input", "embeddings"),
           ("query", "rerank"), ("text_1", "score"))


def invocation_route(raw: bytes, classifier: bool) -> str:
    """The route a /invocations body goes to: chat, completions, embeddings, classify,
    rerank or score; ApiError(400) for a body that is not a JSON object or has none of the
    fields."""
    try:
        body: Any = json.loads(raw or b"null")
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        raise ApiError(400, "an invocation's body must be a JSON object")
    route = next((r for field, r in _ROUTES if field in body), None)
    if route is None:
        raise ApiError(400, "cannot tell what this invocation asks for: expected one of the "
                            "fields " + ", ".join(f"{f} ({r})" for f, r in _ROUTES))
    return "classify" if route == "embeddings" and classifier else route
