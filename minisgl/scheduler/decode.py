"""The running set: requests whose prompt is computed, decoded one token a step, ordered by uid
(so every rank builds the same batch whatever order requests arrived or finished in)."""

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
        reqs = [self.running[uid] for uid in sorted(self.running)]
        lens = [r.device_len for r in reqs]
        return Batch(Phase.DECODE, reqs, [n - 1 for n in lens], [1] * len(reqs),
                     [True] * len(reqs))
