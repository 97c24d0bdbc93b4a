"""N-gram lookup in a request's own tokens, the drafts of speculative decoding
(`speculative.py`), and the verify batches made of them (a draft model's too: `ModelDrafter`)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.speculative import SpeculativeConfig


def propose(tokens: "Sequence[int] | np.ndarray", lo: int, hi: int, k: int) -> List[int]:
    """Up to `k` tokens that followed an earlier occurrence of `tokens`' last n tokens, for the
    longest n in [lo, hi] that occurs (among equal n, the latest occurrence); [] where none
    does. A pure function of its arguments."""
    size = len(tokens)
    if k < 1 or size <= lo:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # the last token of each earlier occurrence of the last `lo` tokens (followed by one more),
    # found token by token from the end: a few vector compares of shrinking candidate sets
    ends = np.flatnonzero(arr[lo - 1:size - 1] == arr[size - 1]) + lo - 1
    for back in range(1, lo):
        ends = ends[arr[ends - back] == arr[size - 1 - back]]
    if ends.size == 0:
        return []
    length = np.full(ends.shape, lo)
    for n in range(lo + 1, min(hi, size - 1) + 1):  # extend the matches leftwards
        before = ends - (n - 1)
        longer = (length == n - 1) & (before >= 0)
        longer &= arr[np.maximum(before, 0)] == arr[size - n]
        if not longer.any():
            break
        length[longer] = n
    begin = int(ends[length == length.max()][-1]) + 1
    return arr[begin:begin + k].tolist()


class Drafter:
    """Turns a decode batch into a verify batch (Phase.VERIFY) where its requests propose
    drafts (`with_drafts`). Reads only the requests, so every rank drafts alike."""

    def __init__(self, cfg: SpeculativeConfig, page_size: int, long_rope_from: int = 0) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.long_rope_from = long_rope_from  # StepEngine.long_rope_from (0: not longrope)
        # uid -> (buffer, tokens in it): each decoding request's tokens as an array, grown by
        # the tokens it kept since (a list of thousands converted anew each step cost ~0.1 ms
        # a request); only the requests of the latest batch are kept
        self._arrays: Dict[int, Tuple[np.ndarray, int]] = {}

    def _array(self, req: Req) -> np.ndarray:
        """`req.token_ids` as an int64 array (a view of its buffer, valid until the next
        call for the request)."""
        n = len(req.token_ids)
        buffer, have = self._arrays.get(req.uid, (np.empty(0, np.int64), 0))
        if have > n:  # (tokens only grow; rebuilt should that ever change)
            have = 0
        if n > len(buffer):
            grown = np.empty(max(2 * len(buffer), n + 256), np.int64)
            grown[:have] = buffer[:have]
            buffer = grown
        buffer[have:n] = req.token_ids[have:n]
        self._arrays[req.uid] = (buffer, n)
        return buffer[:n]

    def _disabled(self, batch: Batch) -> bool:
        """Whether `batch` has more requests than disable_by_batch_size allows to draft."""
        limit = self.cfg.disable_by_batch_size
        return limit is not None and batch.size > limit

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
        each extended by its drafts (a request without verifies its newest token alone, as a
        decode step computes it); `batch` itself where no request drafts or where the batch is
        larger than disable_by_batch_size."""
        if self._disabled(batch):
            return batch
        lo, hi = self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
        drafts = [propose(self._array(r), lo, hi, self.room(r)) for r in batch.reqs]
        self._arrays = {r.uid: self._arrays[r.uid] for r in batch.reqs if r.uid in self._arrays}
        if not any(drafts):
            return batch
        return Batch(Phase.VERIFY, batch.reqs, batch.prefix_lens, [1 + len(d) for d in drafts],
                     batch.sample, drafts=drafts)


class ModelDrafter(Drafter):
    """A draft model's verify batches: each request extends by as many drafts as it has room
    for (`room`); the engine's draft model proposes them when the batch launches
    (engine/draft.py fills `batch.drafts`). A decode batch stays one where no request has
    room, or past disable_by_batch_size requests (the engine's draft still shadows it)."""

    def with_drafts(self, batch: Batch) -> Batch:
        if self._disabled(batch):
            return batch
        rooms = [max(0, self.room(r)) for r in batch.reqs]
        if not any(rooms):
            return batch
        return Batch(Phase.VERIFY, batch.reqs, batch.prefix_lens, [1 + n for n in rooms],
                     batch.sample)
