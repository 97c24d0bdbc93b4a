"""Embeddings pooled over the whole prompt (SamplingParams.pooling "mean" or "cls"), whose
prompt may be computed in several chunks over several steps.

Each such request keeps, in the row of a device buffer that its page-table row indexes, the sum
of its tokens' final hidden states so far ("mean") or its first token's ("cls"). A chunk that
starts at position 0 (the scheduler reuses no cached prefix for these requests:
Req.pools_whole_prompt) overwrites the row, so whatever a former owner of the row left, or a
retracted attempt of the same request, never leaks in; nothing needs freeing. Only the primary
rank pools (it alone replies); every rank's hidden states are whole.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

import torch

from minisgl.core import Batch, Phase, Req
from minisgl.utils import to_device


def pooled_chunks(batch: Batch) -> List[int]:
    """Batch indices of the prompt chunks whose hidden states an embedding pools beyond its
    last token's (none in a decode or verify batch)."""
    if batch.phase is not Phase.PREFILL:
        return []
    return [i for i in range(batch.first_decode) if batch.reqs[i].pools_whole_prompt]


class PromptPools:
    """The running sums (or first states) of the requests pooling their whole prompt: `rows`
    page-table rows of `hidden` float32 values, allocated at the first such request."""

    def __init__(self, rows: int, hidden: int, device: torch.device) -> None:
        self.rows, self.hidden, self.device = rows, hidden, device
        self._pools: Optional[torch.Tensor] = None

    def _buffer(self) -> torch.Tensor:
        if self._pools is None:
            self._pools = torch.zeros(self.rows, self.hidden, dtype=torch.float32,
                                      device=self.device)
        return self._pools

    def add(self, batch: Batch, hidden: torch.Tensor, chunks: Sequence[int]) -> None:
        """Pool chunk i's hidden states (rows of `hidden`, the batch's tokens in order) into
        its request's row, for each i in `chunks` (pooled_chunks)."""
        if not chunks:
            return
        pools = self._buffer()
        ends = list(itertools.accumulate(batch.extend_lens))
        fresh = [batch.reqs[i].table_row for i in chunks if batch.prefix_lens[i] == 0]
        if fresh:
            pools[to_device(fresh, torch.int64, self.device)] = 0.0
        tokens: List[int] = []
        owners: List[int] = []
        for i in chunks:
            req, start = batch.reqs[i], ends[i] - batch.extend_lens[i]
            if req.params.pooling == "cls":
                if batch.prefix_lens[i] == 0:
                    tokens.append(start)
                    owners.append(req.table_row)
                continue
            tokens.extend(range(start, ends[i]))
            owners.extend([req.table_row] * batch.extend_lens[i])
        if tokens:
            states = hidden[to_device(tokens, torch.int64, self.device)].float()
            pools.index_add_(0, to_device(owners, torch.int64, self.device), states)

    def pooled(self, reqs: Sequence[Req]) -> torch.Tensor:
        """[len(reqs), hidden] float32: each finished request's pooled state (the mean over
        its prompt, or its first token's), after `add` took its last chunk."""
        pools = self._buffer()
        rows = pools[to_device([r.table_row for r in reqs], torch.int64, self.device)]
        counts = [float(r.prompt_len) if r.params.pooling == "mean" else 1.0 for r in reqs]
        return rows / to_device(counts, torch.float32, self.device)[:, None]
