"""A long-lived process's start-up heap, kept out of the garbage collector's full passes.

Once a process of the service has imported its libraries and built what it serves with, it holds
a few hundred thousand objects the cyclic garbage collector tracks (216,771 in a process with the
default model loaded on CPU), and they live as long as the process. Python's full collection
walks every one of them (105 ms on a two-core CI machine): in a rank, a pause of the scheduler
loop and of every running request's next token. So each process, at the end of its start-up,
collects once (start-up garbage is not kept) and moves the survivors to the permanent generation
(`gc.freeze`); later collections walk only what serving allocated. vLLM's engine does the same.
Only for processes the service owns: never for a user's process (`minisgl.LLM` at tp=1).
"""

from __future__ import annotations

import gc
import logging
import time


def freeze_startup_heap(log: logging.Logger, name: str) -> int:
    """Collect, then freeze every object left (see the module's doc); returns how many are frozen
    and logs one debug line with the count and the time the collection took."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%s: %d start-up objects frozen out of garbage collection (%.1f ms)", name, frozen,
              (time.perf_counter() - start) * 1e3)
    return frozen
