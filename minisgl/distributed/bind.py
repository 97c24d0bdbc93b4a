"""Where the ranks' TCP endpoints listen: one address, never a wildcard.

torch.distributed's TCP store (`TCPStore(is_master=True)`) binds to every address (`::`) unless
it is handed a socket already bound (`listening_socket`), and gloo listens on the address its
host name resolves to, or on the interface `GLOO_SOCKET_IFNAME` names (`pin_gloo`). A service
on one host keeps both on loopback; over several nodes each rank listens on the address it
reaches node 0 from (`address_towards`), which on node 0 is the address given in
`--dist-init-addr`. NCCL's bootstrap already binds one interface's address and is left alone.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Optional, Tuple

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def split_host_port(addr: str, what: str) -> Tuple[str, int]:
    """("host", port) of "HOST:PORT" ("[v6]:PORT" too, brackets dropped); ValueError naming
    `what` and `addr` when it is not one."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT with a port in [1, 65535], got {addr!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name, without a port) names this machine's loopback
    interface only: localhost and its subdomains, 127.0.0.0/8, ::1 (brackets allowed)."""
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_towards(host: str) -> str:
    """The local address this host uses to reach `host` (numeric; no packet is sent): where a
    rank listens so that `host`'s side of the service can reach it. ValueError naming `host`
    when it does not resolve or no route leads there."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise ValueError(f"no local address reaches {host!r}: {e.strerror or e}") from None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous's or a test server's; another process
    may take it before the caller binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to `host`:`port` and listening (OSError when it cannot be)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface holding `address` (Linux), or None if none does."""
    ip = ipaddress.ip_address(address)
    for _, name in socket.if_nameindex():
        if ip.version == 4 and _ipv4_of(name) == address:
            return name
    if ip.version == 6:
        for line in _read("/proc/net/if_inet6").splitlines():
            fields = line.split()
            if len(fields) == 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                return fields[5]
    return None


def pin_gloo(address: str) -> None:
    """Make the gloo groups this process creates from now on listen on `address`'s interface
    (`GLOO_SOCKET_IFNAME`). A loopback address always pins the loopback interface (the ranks of
    one host never talk over another); otherwise a value the user set is kept. ValueError when
    no interface holds `address`. A no-op off Linux, where gloo keeps its own choice."""
    if not sys.platform.startswith("linux"):
        return
    if not is_loopback(address) and os.environ.get(GLOO_IFNAME):
        return
    name = interface_of(address)
    if name is None:
        raise ValueError(f"no network interface holds {address}, the address gloo should "
                         f"listen on; set {GLOO_IFNAME} to the interface to use")
    os.environ[GLOO_IFNAME] = name


def _ipv4_of(name: str) -> Optional[str]:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
