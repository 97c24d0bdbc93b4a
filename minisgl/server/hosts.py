"""Host names and addresses: which name loopback, and the host part of a Host header."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name, without a port) names this machine's loopback
    interface only: localhost and its subdomains, 127.0.0.0/8, ::1."""
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host part of a Host header: `[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`
    (a bare IPv6 address, which has several colons, stays whole)."""
    value = value.strip()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value
