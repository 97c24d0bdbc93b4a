"""Process-wide logging set-up, shared by every process of the service, and the quick exit that
flushes it (imports no torch)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def setup_logging(tag: str, level: str = "INFO") -> None:
    """One line per record on stderr, tagged with the process (launcher, rank0, tokenizer...)."""
    logging.basicConfig(level=level.upper(), force=True, stream=sys.stderr,
                        format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s")


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once its logs and standard streams are flushed, without the
    interpreter's teardown: with torch or the HTTP stack loaded that takes a second or more, in
    which a stopping service would only wait. Only for a process that has released what it
    holds (children reaped, runtime files removed); the kernel closes its sockets."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
