"""The launcher's watchdog: on every watch turn it judges the pulses of its children
(`message/pulse.py`), so that a hung process ends the service like a dead one.

- A child whose beat stood still for `STALE_S` (or half the timeout, if shorter) makes the
  service unhealthy at once (GET /health answers 503; the service goes on, and is healthy again
  if the child resumes); one silent for `watchdog_timeout` stops the service.
- A rank whose current step has run for `watchdog_timeout` stops the service. Its first step
  gets `FIRST_STEP_FACTOR` times as long: it may compile kernels (Triton JIT, CPU kernel
  caches) and grow allocator pools, one-time work no steady-state step has, whose length no
  setting bounds; a hang there is still caught, only later. A wait for input is not a step.
When a step runs over while another child is silent, the silent one is blamed: the step most
likely waits for it in a collective.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from minisgl.server.proc import Child

STALE_S = 1.5
FIRST_STEP_FACTOR = 3


class Verdict(NamedTuple):
    failure: Optional[str]  # why the service must stop, in words; None while it may go on
    healthy: bool  # every child shows signs of life


def judge(children: Sequence[Child], ranks: Sequence[Child], timeout_s: float,
          now: float) -> Verdict:
    """The verdict on `children` (`ranks` among them: their steps are timed) at time `now`."""
    stale_s = min(STALE_S, timeout_s / 2)
    silent = [(c, c.pulse.beat_age(now)) for c in children]
    silent = [(c, age) for c, age in silent if age > stale_s and c.alive]
    for child, age in silent:
        if age > timeout_s:
            return Verdict(f"{child.label} showed no sign of life for {age:.1f} s (stopped or "
                           f"frozen; watchdog_timeout {timeout_s:g} s)", False)
    for rank in ranks:
        first = rank.pulse.steps == 0
        limit = timeout_s * (FIRST_STEP_FACTOR if first else 1)
        age = rank.pulse.step_age(now)
        if age <= limit:
            continue
        if silent:
            child, quiet = silent[0]
            return Verdict(f"{child.label} showed no sign of life for {quiet:.1f} s while "
                           f"{rank.name}'s step waited {age:.1f} s (stopped or frozen; "
                           f"watchdog_timeout {timeout_s:g} s)", False)
        return Verdict(f"{rank.label} is hung: its step has run for {age:.1f} s "
                       f"(watchdog_timeout {timeout_s:g} s"
                       f"{', tripled for its first step' if first else ''})", False)
    return Verdict(None, not silent)
