"""Process-wide logging set-up, shared by every process of the service (imports no torch)."""

from __future__ import annotations

import logging
import sys


def setup_logging(tag: str, level: str = "INFO") -> None:
    """One line per record on stderr, tagged with the process (launcher, rank0, tokenizer...)."""
    logging.basicConfig(level=level.upper(), force=True, stream=sys.stderr,
                        format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s")
