"""Cross-origin requests from browsers (CORS), opt-in with --allowed-origins (vLLM's setting;
vLLM allows every origin by default, minisgl none).

A page of an allowed origin may call the API from a browser: its preflight (OPTIONS) is
answered before the API key and Host checks (a preflight carries no credentials), and the
answers carry Access-Control-Allow-Origin. Requests from other origins get no such header, so
the browser keeps their answers from the page. `*` is refused without an API key: any page
could then use a loopback server through its visitors' browsers (the Host check stops only
pages that pose as localhost). The methods and headers a preflight may ask for
(--allowed-methods, --allowed-headers) are any by default; --allow-credentials lets such a page
send its cookies and HTTP authentication too (vLLM's settings, each).
"""

from __future__ import annotations

import json
import re
from typing import List, NamedTuple, Optional, Tuple

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110): a name


class CorsPolicy(NamedTuple):
    """Who may call from a browser, and how (starlette's CORSMiddleware's arguments)."""

    origins: Tuple[str, ...] = ()  # none: CORS is off
    methods: Tuple[str, ...] = ("*",)
    headers: Tuple[str, ...] = ("*",)
    credentials: bool = False


def _items(value: str, name: str) -> List[str]:
    """A list setting's entries: comma-separated, or a JSON list (vLLM's form)."""
    text = value.strip()
    if not text.startswith("["):
        return [v.strip() for v in text.split(",") if v.strip()]
    try:
        items = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{name} is not a JSON list: {e}") from None
    if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
        raise ValueError(f"{name} must be a list of strings, got {text!r:.80}")
    return [v.strip() for v in items if v.strip()]


def parse_names(value: Optional[str], name: str) -> Tuple[str, ...]:
    """--allowed-methods / --allowed-headers: `*` (any; also where unset) or HTTP names.
    ValueError naming one that is not a name."""
    names = tuple(_items(value, name)) if value is not None else ("*",)
    for entry in names:
        if not _TOKEN.fullmatch(entry):
            raise ValueError(f"{name}: {entry!r} is not an HTTP method or header name (or *)")
    return names or ("*",)


def parse_origins(value: Optional[str]) -> Tuple[str, ...]:
    """--allowed-origins as origins: comma-separated, or a JSON list (vLLM's form); each `*`
    or scheme://host[:port] with no path. ValueError naming one that is not."""
    if value is None or not value.strip():
        return ()
    origins = tuple(o.rstrip("/") for o in _items(value, "allowed_origins"))
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest
                              or "/" in rest):
            raise ValueError(f"allowed_origins: {origin!r} is not an origin "
                             f"(scheme://host[:port], or *)")
    return origins
