"""A child entry for tests of `server/proc.py`, in a module of its own so that a spawned child
imports nothing else of the tests (a spawn re-imports the entry's module)."""

from __future__ import annotations

import os
from typing import Any, List


def report_env(keys: List[str], conn: Any) -> None:
    """Ready, with the values of `keys` in this process's environment and its pid; then wait
    until the parent closes the pipe."""
    conn.send(("ready", "probe", {"values": [os.environ.get(k) for k in keys],
                                  "pid": os.getpid()}))
    try:
        conn.recv()
    except EOFError:
        pass
