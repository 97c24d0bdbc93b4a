"""N-gram lookup in a request's own tokens, the drafts of speculative decoding
(`speculative.py`), and the verify batches made of them."""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.speculative import SpeculativeConfig, may_speculate


def propose(tokens: Sequence[int], lo: int, hi: int, k: int) -> List[int]:
    """Up to `k` tokens that followed an earlier occurrence of `tokens`' last n tokens, for the
    longest n in [lo, hi] that occurs (among equal n, the latest occurrence); [] where none
    does. A pure function of its arguments."""
    size = len(tokens)
    if k < 1 or size <= lo:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], lo)  # each followed by one
    starts = np.flatnonzero((windows == arr[size - lo:]).all(axis=1))
    if starts.size == 0:
        return []
    length = np.full(starts.shape, lo)
    for n in range(lo + 1, min(hi, size - 1) + 1):  # extend the matches leftwards
        before = starts - (n - lo)
        longer = (length == n - 1) & (before >= 0)
        longer &= arr[np.maximum(before, 0)] == arr[size - n]
        if not longer.any():
            break
        length[longer] = n
    begin = int(starts[length == length.max()][-1]) + lo
    return arr[begin:begin + k].tolist()


class Drafter:
    """Turns a decode batch into a verify batch (Phase.VERIFY) where its requests propose
    drafts (`with_drafts`). Reads only the requests, so every rank drafts alike."""

    def __init__(self, cfg: SpeculativeConfig, page_size: int, long_rope_from: int = 0) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.long_rope_from = long_rope_from  # StepEngine.long_rope_from (0: not longrope)

    def room(self, req: Req) -> int:
        """The most drafts `req` may take this step: num_speculative_tokens, no more than
        would pass max_tokens if every one were kept, and no KV slot beyond its own pages and
        its reservation (drafts never take a free page from the others), and, for a longrope
        model's short sequence, no input position at or past the pretraining length (the
        scheduler prefills it again with the long factors before it grows past that,
        `Scheduler._restart_long_rope`). The scheduler has no token in flight:
        `req.device_len` is its length on the host too."""
        left = req.prompt_len + req.max_tokens - req.device_len - 1
        slots = (len(req.pages) + req.reserved_pages) * self.page_size - req.device_len
        room = min(self.cfg.num_speculative_tokens, left, slots)
        if self.long_rope_from and not req.long_rope:
            room = min(room, self.long_rope_from - req.device_len)
        return room

    def with_drafts(self, batch: Batch) -> Batch:
        """`batch` (a decode batch) as a verify batch of the same requests in the same order,
        each extended by its drafts (none for a request that may not take them,
        `may_speculate`: it verifies its newest token alone, as a decode step computes it);
        `batch` itself where no request drafts, where the batch is larger than
        disable_by_batch_size, or where a request is constrained (a masked batch samples one
        row per request)."""
        limit = self.cfg.disable_by_batch_size
        if (limit is not None and batch.size > limit) or any(
                r.grammar is not None for r in batch.reqs):
            return batch
        lo, hi = self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
        drafts = [propose(r.token_ids, lo, hi, self.room(r)) if may_speculate(r) else []
                  for r in batch.reqs]
        if not any(drafts):
            return batch
        return Batch(Phase.VERIFY, batch.reqs, batch.prefix_lens, [1 + len(d) for d in drafts],
                     batch.sample, drafts=drafts)
