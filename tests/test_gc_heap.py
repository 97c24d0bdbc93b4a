"""The start-up heap frozen out of the garbage collector (gc_heap.py), in a fresh interpreter so
that this test process's collector is left alone: after the heavy imports a process of the
service makes, one call collects and freezes them, so a later full collection walks only what
was allocated after it."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = """
import gc, json, logging
import torch, transformers  # what a rank imports before it serves
from minisgl.gc_heap import freeze_startup_heap
logging.basicConfig(level="DEBUG")
before = len(gc.get_objects())
frozen = freeze_startup_heap(logging.getLogger("t"), "test")
served = [[i] for i in range(1000)]  # what serving allocates afterwards stays collectable
print(json.dumps({"before": before, "frozen": frozen, "after": len(gc.get_objects()),
                  "count": gc.get_freeze_count()}))
"""


def test_startup_objects_are_frozen_and_later_ones_are_not() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] == got["count"] >= 0.9 * got["before"] > 20_000, got
    assert 1000 <= got["after"] < 0.05 * got["before"], got  # the 1,000 new lists only, about
    assert "start-up objects frozen out of garbage collection" in out.stderr
