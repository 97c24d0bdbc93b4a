"""The start-up report a child process sends its parent over a pipe: ("ready", name, info)
once it can serve, or ("error", name, "Type: reason") before exiting with status 1. Before it,
a child may send ("progress", name, text) for each start-up step (`server.proc.wait_ready`).

Later, a rank's exit status tells its parent whose failure it was: `PEER_EXIT` when the rank
ended only because another rank failed first (a peer gone, a collective broken), so that the
supervisor names that other one."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator

PEER_EXIT = 4


@contextlib.contextmanager
def report_startup(conn: Any, name: str, log: logging.Logger,
                   traceback_level: int = logging.DEBUG) -> Iterator[None]:
    """Run the start-up block; if it raises, log the traceback at `traceback_level`, send the
    error report (the parent may be gone already) and exit 1. The caller sends
    ("ready", name, info) after the block."""
    try:
        yield
    except Exception as e:
        log.log(traceback_level, "%s failed to start", name, exc_info=True)
        with contextlib.suppress(Exception):
            conn.send(("error", name, f"{type(e).__name__}: {e}"))
        sys.exit(1)
