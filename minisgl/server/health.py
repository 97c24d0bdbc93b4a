"""Whether the service is up, as the launcher tells the API server (GET /health).

A file in the runtime directory: the launcher touches it on every watch turn while every
process of the service shows signs of life, and removes it as soon as one does not (dead,
stopped, a step past the watchdog), and when the service drains or stops. The API server reads
it: up while the file exists and was touched within `FRESH_S`, so a launcher that is itself
stopped or hung reads as down too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

FRESH_S = 2.0


class HealthFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def mark(self, up: bool) -> None:
        """The launcher's side: touch the file (up) or remove it (down)."""
        if up:
            Path(self.path).touch()
        else:
            Path(self.path).unlink(missing_ok=True)

    def is_up(self) -> bool:
        """The API server's side."""
        try:
            return time.time() - os.stat(self.path).st_mtime < FRESH_S
        except OSError:
            return False
