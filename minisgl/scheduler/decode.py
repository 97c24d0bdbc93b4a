"""The running set: requests whose prompt is computed, decoded one token a step.

A decode batch lists its requests longest first, ties by uid: every rank builds the same batch
whatever order requests arrived or finished in (lengths and uids match across ranks), and the
decode attention kernel, whose programs start in batch order, then schedules the longest jobs
first, so its last wave is short (the GPU's load balance)."""

from __future__ import annotations

from typing import Dict, Optional

from minisgl.core import Batch, Phase, Req


class DecodeManager:
    def __init__(self) -> None:
        self.running: Dict[int, Req] = {}

    def add(self, req: Req) -> None:
        self.running[req.uid] = req

    def remove(self, req: Req) -> bool:
        return self.running.pop(req.uid, None) is not None

    def schedule(self) -> Optional[Batch]:
        if not self.running:
            return None
        reqs = sorted(self.running.values(), key=lambda r: (-r.device_len, r.uid))
        lens = [r.device_len for r in reqs]
        return Batch(Phase.DECODE, reqs, [n - 1 for n in lens], [1] * len(reqs),
                     [True] * len(reqs))
