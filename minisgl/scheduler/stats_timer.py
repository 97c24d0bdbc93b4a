"""Rank 0's scheduler state, pushed every `interval_s` seconds whatever the loop is doing.

The scheduler's stats otherwise travel only with its replies, so /metrics would go stale while
it idles or runs one long forward. `StatsTimer.post` takes the scheduler's latest stats (the
scheduler posts them before it launches a prefill batch and after it completes any, and once at
start-up, so the pool's size is known before the first request); a daemon thread sends the
latest to the detokenizer (which forwards it like any step's) every `interval_s`, on a socket of
its own. While the loop is blocked in a forward, the stats sent are those posted before that
launch (a prefill's: its requests counted as waiting, their pages as used), or after the step
before it (a decode step, which is short).

Only rank 0 has a timer, and nothing the scheduler decides reads it: the ranks' lockstep is
untouched.
"""

from __future__ import annotations

import threading
from typing import Optional

import zmq

from minisgl.message import BatchTokenOut, SchedulerStats
from minisgl.message.queue import PushQueue


class StatsTimer:
    def __init__(self, detokenizer_addr: str, interval_s: float) -> None:
        self.addr, self.interval_s = detokenizer_addr, interval_s
        self.ctx = zmq.Context()  # its own: closing the loop's IO never waits for this thread
        self._latest: Optional[SchedulerStats] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-timer", daemon=True)

    def post(self, stats: SchedulerStats) -> None:
        """The scheduler's latest stats (a reference swap: safe from the loop's thread)."""
        self._latest = stats

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        push = PushQueue(self.ctx, self.addr, bind=False)  # this thread's own socket
        try:
            while not self._stop.wait(self.interval_s):
                latest = self._latest
                if latest is not None:
                    push.put(BatchTokenOut([], latest))
        finally:
            push.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)
        if not self._thread.is_alive():
            self.ctx.term()
