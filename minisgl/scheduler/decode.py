"""The running set: requests whose prompt is computed, decoded one token a step.

A decode batch lists its requests longest first, ties by uid: every rank builds the same batch
whatever order requests arrived or finished in (lengths and uids match across ranks), and the
decode attention kernel, whose programs start in batch order, then schedules the longest jobs
first, so its last wave is short (the GPU's load balance).

A request whose every token is launched (`Req.all_launched`: its last token is in flight with
overlap scheduling) stays in the running set until its result is processed, but joins no more
batches: a step for it would only compute a token that is dropped, and with max_tokens=1 that
step would stand between the prompt and its first (and only) token."""

from __future__ import annotations

from typing import Dict, List, Optional

from minisgl.core import Batch, Phase, Req


class DecodeManager:
    def __init__(self) -> None:
        self.running: Dict[int, Req] = {}

    def add(self, req: Req) -> None:
        self.running[req.uid] = req

    def remove(self, req: Req) -> bool:
        return self.running.pop(req.uid, None) is not None

    def decoding(self) -> List[Req]:
        """The running requests a decode step is of use to (see the module docstring)."""
        return [r for r in self.running.values() if not r.all_launched]

    def schedule(self) -> Optional[Batch]:
        reqs = sorted(self.decoding(), key=lambda r: (-r.device_len, r.uid))
        if not reqs:
            return None
        lens = [r.device_len for r in reqs]
        return Batch(Phase.DECODE, reqs, [n - 1 for n in lens], [1] * len(reqs),
                     [True] * len(reqs))
