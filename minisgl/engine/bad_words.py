"""vLLM's bad_words in the engine: a word's last token is banned (-inf) where the output so far
ends with the rest of the word; a one-token word is banned always. Only output tokens count,
as in vLLM (a prompt that ends with a word's first tokens bans nothing).

The last MAX_BAD_WORD_TOKENS - 1 output tokens of every row with bad words live in a [rows, W]
device tensor, so a decode step needs no token history from the host: with overlap scheduling
the newest token is still only on the device. Who writes it: the scheduler calls `start` when
it admits such a request (the row is its own until it retires; a retracted request comes back
with its outputs so far); the engine calls `apply` before sampling and `record` after it, in
stream order. The tensor is made on the first such request (every rank at the same step), so
engines that never see one pay nothing.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from minisgl.core import MAX_BAD_WORD_TOKENS, Req
from minisgl.utils import to_device

_NONE = -1  # a history slot before the first output token: matches no token id
_ANY = -2  # a prefix slot left of a shorter word's prefix: matches anything


class BadWords:
    width = MAX_BAD_WORD_TOKENS - 1  # output tokens a word's prefix can span

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows, self.device = rows, device
        self.history: Optional[torch.Tensor] = None  # [rows, width] int64, newest last

    def start(self, row: int, outputs: Sequence[int]) -> None:
        """Row `row` now belongs to a request with bad words and these outputs so far."""
        if self.history is None:
            self.history = torch.full((self.rows, self.width), _NONE, dtype=torch.int64,
                                      device=self.device)
        tail = list(outputs[-self.width:]) if self.width else []
        self.history[row] = to_device([_NONE] * (self.width - len(tail)) + tail, torch.int64,
                                      self.device)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, reqs: List[Req],
              drafted: Optional[Sequence[Tuple[int, ...]]] = None) -> torch.Tensor:
        """`logits` (row i is reqs[i], in page-table rows `rows`) with each bad word's last
        token at -inf where the row's outputs end with the word's other tokens: a new float32
        tensor, or `logits` itself where no request has bad words. `drafted`: per row, tokens
        that follow its history (a verify step's drafts before each position:
        engine.draft_prefixes)."""
        batch_rows: List[int] = []
        prefixes: List[List[int]] = []
        lasts: List[int] = []
        for i, req in enumerate(reqs):
            for word in req.params.bad_word_ids:
                batch_rows.append(i)
                prefixes.append([_ANY] * (self.width - len(word) + 1) + list(word[:-1]))
                lasts.append(word[-1])
        if not batch_rows:
            return logits
        if self.history is None:
            raise RuntimeError("bad words applied before any such request was started "
                               "(Engine.start_request runs at admission)")
        index = to_device(batch_rows, torch.int64, self.device)
        prefix = to_device(prefixes, torch.int64, self.device)
        last = to_device(lasts, torch.int64, self.device)
        seen = self.history[rows.long()[index]]
        if drafted is not None and any(drafted[i] for i in batch_rows):
            seen = self._followed(seen, [drafted[i] for i in batch_rows])
        match = ((prefix == seen) | (prefix == _ANY)).all(dim=-1)
        # Words may share a last token ("Paris", "in Paris"): count the matches per cell, so
        # that one word's miss never undoes another's ban (duplicate writes race on a GPU).
        hits = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
        hits.index_put_((index, last), match.to(torch.int32), accumulate=True)
        return logits.float().masked_fill(hits > 0, float("-inf"))

    def _followed(self, seen: torch.Tensor, after: List[Tuple[int, ...]]) -> torch.Tensor:
        """Each history row `seen[k]` with the tokens `after[k]` pushed in, newest last (the
        last `width` of the two together)."""
        most = max(len(a) for a in after)
        tails = [list(a) + [_NONE] * (most - len(a)) for a in after]  # padded on the right
        both = torch.cat([seen, to_device(tails, torch.int64, self.device)], dim=1)
        start = to_device([len(a) for a in after], torch.int64, self.device)  # its window
        return both.gather(1, start.unsqueeze(1) + torch.arange(self.width, device=self.device))

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, reqs: List[Req]) -> None:
        """Push the sampled `tokens` (row i of `rows` is reqs[i]) into the history of the
        requests with bad words."""
        if self.history is None or not self.width:
            return
        chosen = [i for i, r in enumerate(reqs) if r.params.bad_word_ids]
        if not chosen:
            return
        pick = to_device(chosen, torch.int64, self.device)
        at = rows.long()[pick]
        self.history[at] = torch.cat([self.history[at, 1:], tokens[pick].unsqueeze(1)], dim=1)
