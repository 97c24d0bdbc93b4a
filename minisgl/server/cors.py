"""Cross-origin requests from browsers (CORS), opt-in with --allowed-origins (vLLM's setting;
vLLM allows every origin by default, minisgl none).

A page of an allowed origin may call the API from a browser: its preflight (OPTIONS) is
answered before the API key and Host checks (a preflight carries no credentials), and the
answers carry Access-Control-Allow-Origin. Requests from other origins get no such header, so
the browser keeps their answers from the page. `*` is refused without an API key: any page
could then use a loopback server through its visitors' browsers (the Host check stops only
pages that pose as localhost).
"""

from __future__ import annotations

import json
from typing import Optional, Tuple


def parse_origins(value: Optional[str]) -> Tuple[str, ...]:
    """--allowed-origins as origins: comma-separated, or a JSON list (vLLM's form); each `*`
    or scheme://host[:port] with no path. ValueError naming one that is not."""
    if value is None or not value.strip():
        return ()
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ValueError(f"allowed_origins is not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError(f"allowed_origins must be a list of strings, got {text!r:.80}")
    else:
        items = text.split(",")
    origins = tuple(o.strip().rstrip("/") for o in items if o.strip())
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest
                              or "/" in rest):
            raise ValueError(f"allowed_origins: {origin!r} is not an origin "
                             f"(scheme://host[:port], or *)")
    return origins
