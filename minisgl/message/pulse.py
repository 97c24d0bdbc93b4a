"""A child process's signs of life, in memory it shares with its parent (the launcher).

Three numbers per child, written by the child and read by the parent, lock-free (each is one
aligned double; a torn read is impossible and a stale one costs one watch turn):
- `beat`: when the child's watch thread last ran (`server.proc` ticks it every
  `BEAT_INTERVAL_S`). It stands still when the process is stopped (SIGSTOP), frozen, or so busy
  in one call that holds the GIL that no thread runs.
- `step_started`: when the scheduler rank's current step began, 0 while it waits for input with
  nothing to do (a wait for work is no hang). A step is the receive of this turn's messages (its
  count broadcast is a collective), the forward passes and the reply.
- `steps`: how many steps have ended, so that the parent can tell the first step, which may
  carry one-time work (kernel compilation), from the later ones.
Times are `time.monotonic()`, one clock for every process of a host.
"""

from __future__ import annotations

import time
from typing import Any

BEAT_INTERVAL_S = 0.25
_BEAT, _STEP_STARTED, _STEPS = range(3)


class Pulse:
    """Made by the parent before spawning (`ctx` a multiprocessing context) and handed to the
    child in its spawn arguments; both ends then see the same memory."""

    def __init__(self, ctx: Any) -> None:
        self._slots = ctx.RawArray("d", 3)
        self._slots[_BEAT] = time.monotonic()

    # --- the child's side ----------------------------------------------------------------------
    def beat(self) -> None:
        self._slots[_BEAT] = time.monotonic()

    def step_begins(self) -> None:
        """A step begins (ending the one before, if one ran)."""
        self._end_step()
        self._slots[_STEP_STARTED] = time.monotonic()

    def idle(self) -> None:
        """The process waits for input (ending the step before, if one ran)."""
        self._end_step()
        self._slots[_STEP_STARTED] = 0.0

    def _end_step(self) -> None:
        if self._slots[_STEP_STARTED] > 0:
            self._slots[_STEPS] += 1

    # --- the parent's side ---------------------------------------------------------------------
    def beat_age(self, now: float) -> float:
        """Seconds since the child's last beat."""
        return now - self._slots[_BEAT]

    def step_age(self, now: float) -> float:
        """Seconds the current step has run; 0 while the child waits for input."""
        started = self._slots[_STEP_STARTED]
        return now - started if started > 0 else 0.0

    @property
    def steps(self) -> int:
        return int(self._slots[_STEPS])
