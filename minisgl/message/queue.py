"""ZMQ sockets carrying encoded messages: PUSH/PULL between processes, XPUB/SUB from scheduler
rank 0 to the other ranks. Raw-bytes methods let rank 0 forward messages verbatim."""

from __future__ import annotations

import time
from typing import Any

import zmq

from minisgl.message.codec import decode, encode


class PullQueue:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.bind(addr) if bind else self.sock.connect(addr)

    def get_raw(self, timeout_ms: int = -1) -> bytes:
        """Block (at most `timeout_ms`, -1 forever) for one message; TimeoutError if none."""
        if timeout_ms >= 0 and not self.sock.poll(timeout_ms):
            raise TimeoutError("no message")
        return self.sock.recv(copy=True)

    def get(self, timeout_ms: int = -1) -> Any:
        return decode(self.get_raw(timeout_ms))

    def empty(self) -> bool:
        return not self.sock.poll(0)

    def close(self) -> None:
        self.sock.close(linger=0)


class PushQueue:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.bind(addr) if bind else self.sock.connect(addr)

    def put(self, msg: Any) -> None:
        self.sock.send(encode(msg), copy=False)

    def put_raw(self, raw: bytes) -> None:
        self.sock.send(raw, copy=False)

    def close(self) -> None:
        self.sock.close(linger=1000)


class PubQueue:
    """Rank 0's side of the broadcast. XPUB reports each subscription, so rank 0 can wait until
    every rank has subscribed before its first publish (a PUB drops messages sent earlier).
    It listens on every address given (ipc:// for this host, tcp:// for other nodes)."""

    def __init__(self, ctx: zmq.Context, addr: str, *more_addrs: str) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop: other ranks must see every message
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every rank's (identical) subscription
        for a in (addr, *more_addrs):
            try:
                self.sock.bind(a)
            except zmq.ZMQError as e:
                self.sock.close(linger=0)
                raise OSError(f"rank 0 cannot listen for the other ranks on {a}: {e}") from None

    def wait_for_subscribers(self, n: int, timeout_s: float) -> None:
        seen, deadline = 0, time.monotonic() + timeout_s
        while seen < n:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                raise TimeoutError(f"only {seen} of {n} scheduler ranks subscribed to rank 0's "
                                   f"broadcast within {timeout_s:.0f} s")
            if self.sock.recv()[:1] == b"\x01":
                seen += 1

    def put_raw(self, raw: bytes) -> None:
        self.sock.send(raw, copy=False)

    def close(self) -> None:
        self.sock.close(linger=1000)


class SubQueue:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(addr)

    def get(self) -> Any:
        return decode(self.sock.recv(copy=True))

    def close(self) -> None:
        self.sock.close(linger=0)
