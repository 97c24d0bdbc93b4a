"""Slow requests prepared on threads beside the tokenizer's loop, so the others never wait.

Two kinds are slow: a prompt of more than `LONG_PROMPT_CHARS` characters, and a request with a
structured-output constraint, whose grammar the tokenizer compiles to refuse one that does not
(xgrammar's set-up, torch's import with it, on the first; each new schema's compilation after).
The tokenizer's loop hands such a request to `SlowRequests.submit` with the function that
prepares it, and goes on with the next message. The Rust tokenizers and xgrammar's compiler
release the GIL while they work, so the loop keeps preparing the other requests meanwhile. A
finished job is queued and the loop woken through a pipe whose read end it polls beside its
socket (`fileno`); `finished()` hands back the results, in completion order,
without those whose uid was `cancel`led (aborted while being prepared), and returns the memory
a long prompt took to the system (`malloc_trim`), so the tokenizer's RSS goes back down.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Set, Tuple

logger = logging.getLogger("minisgl.tokenizer")

LONG_PROMPT_CHARS = 1 << 16


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc; elsewhere nothing to do)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class SlowRequests:
    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._done: "queue.SimpleQueue[Tuple[Any, Any]]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.running: Set[int] = set()  # uids submitted and not handed back
        self._cancelled: Set[int] = set()

    def fileno(self) -> int:
        """Readable when a job finished (for the loop's poller)."""
        return self._wake_r

    def submit(self, msg: Any, prepare: Callable[[Any], Any]) -> None:
        """Run `prepare(msg)` on a thread; `finished()` returns `(msg, result)` later."""
        self.running.add(msg.uid)
        self._pool.submit(self._run, msg, prepare)

    def _run(self, msg: Any, prepare: Callable[[Any], Any]) -> None:
        try:
            result = prepare(msg)
        except BaseException as e:  # reported by the loop, which owns the sockets
            result = e
        self._done.put((msg, result))
        os.write(self._wake_w, b"x")

    def cancel(self, uid: int) -> None:
        """Drop `uid`'s result when it comes (its request was aborted)."""
        if uid in self.running:
            self._cancelled.add(uid)

    def finished(self) -> List[Tuple[Any, Any]]:
        """The jobs finished since the last call, less the cancelled ones. A job whose function
        raised gives the exception as its result."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out, came = [], 0
        while True:
            try:
                msg, result = self._done.get_nowait()
            except queue.Empty:
                break
            came += 1
            self.running.discard(msg.uid)
            if msg.uid in self._cancelled:
                self._cancelled.discard(msg.uid)
                continue
            out.append((msg, result))
        if came:
            _trim_heap()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self._wake_r)
        os.close(self._wake_w)
