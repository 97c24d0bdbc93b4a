"""Host names and addresses: which name loopback, and the host part of a Host header."""

from __future__ import annotations

from minisgl.distributed.bind import is_loopback

__all__ = ["host_name", "is_loopback"]


def host_name(value: str) -> str:
    """The host part of a Host header: `[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`
    (a bare IPv6 address, which has several colons, stays whole)."""
    value = value.strip()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value
