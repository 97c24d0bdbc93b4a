"""Helpers for the fault and shutdown tests: a streaming client in a thread that records how its
stream ended, and the TCP listeners of a process tree (from /proc, as `ss -ltnp` shows them)."""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import httpx

DONE = "[DONE]"


class Stream:
    """One streaming completion of token-id prompt [1, 2, 3], run in a thread. `events` are the
    parsed `data:` payloads in order ("[DONE]" as the string), `cut` the error if the connection
    broke before the stream ended, `status` the HTTP status."""

    def __init__(self, url: str, max_tokens: int, timeout_s: float = 120.0) -> None:
        self.events: List[Any] = []
        self.cut: Optional[str] = None
        self.status = 0
        self.ended_at = 0.0
        self._first = threading.Event()
        body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        self._thread = threading.Thread(target=self._run, args=(url, body, timeout_s),
                                        daemon=True)
        self._thread.start()

    def _run(self, url: str, body: Dict[str, Any], timeout_s: float) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body,
                              timeout=timeout_s) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == DONE else json.loads(data))
                        self._first.set()
        except httpx.HTTPError as e:
            self.cut = f"{type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()
            self._first.set()

    def started(self, timeout_s: float = 60.0) -> "Stream":
        """Wait for the first event (AssertionError if none came)."""
        assert self._first.wait(timeout_s) and self.events, (self.status, self.cut)
        return self

    def join(self, timeout_s: float = 30.0) -> "Stream":
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"
        return self

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == DONE

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and "choices" in e
                   and any(c.get("text") is not None for c in e["choices"]))

    @property
    def finish_reason(self) -> Optional[str]:
        reasons = [c.get("finish_reason") for e in self.events
                   if isinstance(e, dict) for c in e.get("choices", [])]
        return next((r for r in reversed(reasons) if r), None)

    def ended_with_error(self) -> Dict[str, Any]:
        """The OpenAI error body that ended the stream, which must be followed by [DONE]."""
        assert self.cut is None and self.done, (self.cut, self.events[-3:])
        last = self.events[-2]
        assert isinstance(last, dict) and "error" in last, self.events[-3:]
        assert {"message", "type", "param", "code"} <= set(last["error"]), last
        return last["error"]


class Listener(NamedTuple):
    pid: int
    address: str
    port: int

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified


def listeners(pids: Sequence[int]) -> List[Listener]:
    """Every TCP socket in LISTEN state that one of `pids` holds."""
    by_inode = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            links = [os.readlink(fd) for fd in fd_dir.iterdir()]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:["):
                by_inode[link[8:-1]] = pid
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in by_inode:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            out.append(Listener(by_inode[fields[9]], _address(hex_addr, v6), int(hex_port, 16)))
    return out


def _address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc writes each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words))


def status(url: str, path: str = "/health") -> int:
    try:
        return httpx.get(f"{url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def wait_for(cond: Any, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True
