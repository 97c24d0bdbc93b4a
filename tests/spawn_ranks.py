"""One spawned process per rank for a test, none of which may outlive it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from typing import Any, Callable, Iterator, List, NamedTuple

import pytest


class Ranks(NamedTuple):
    out: Any  # the spawn context's Queue every rank reports on
    procs: List[Any]  # multiprocessing.Process, rank r at index r


@contextlib.contextmanager
def spawn_ranks(target: Callable[..., None], world: int, *args: Any,
                join_timeout_s: float = 30.0) -> Iterator[Ranks]:
    """Run target(rank, *args, out) in `world` spawned daemon processes and yield them.

    The body must take every message the ranks put on `out` (a process does not exit while its
    queue items are unread). On leaving, the ranks get `join_timeout_s` in all to exit; any still
    running are killed, and unless the body already failed, the test fails naming them: a stuck
    rank must fail the test, not hang pytest.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out), daemon=True, name=f"rank{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        yield Ranks(out, procs)
    except BaseException:
        _stop(procs, join_timeout_s)
        raise
    stuck = _stop(procs, join_timeout_s)
    if stuck:
        pytest.fail(f"{', '.join(stuck)} still running {join_timeout_s} s after the test; killed")


def _stop(procs: List[Any], join_timeout_s: float) -> List[str]:
    """Join every process within one shared deadline, kill the rest; return their names."""
    deadline = time.monotonic() + join_timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return stuck
