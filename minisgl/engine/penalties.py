"""Repetition, frequency and presence penalties, from per-row token counts kept on the device.

Semantics (vLLM's and OpenAI's; repetition as in Hugging Face's processor), applied to the raw
logits before temperature and filters, in this order:
- repetition_penalty p: a token seen in the prompt or the output has its logit divided by p if
  positive, multiplied by p if not;
- frequency_penalty f: minus f times the token's count in the output;
- presence_penalty q: minus q if the token occurs in the output.

The counts live in [rows, vocab] tensors indexed by page-table row, so a decode step needs no
token history from the host: with overlap scheduling the newest token is still only on the
device. Who writes them: the scheduler calls `start` when it admits a penalized request (the row
is its own from then until it retires); the engine calls `apply` before sampling and `record`
after it, in stream order, so a row reused by a later request was read for the last time before
`start` rewrites it. The tensors are made on the first penalized request (every rank at the
same step: admission is a pure function of the messages), so engines that never see one pay
nothing.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from minisgl.core import Req
from minisgl.utils import to_device


class Penalties:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        self.output_counts: Optional[torch.Tensor] = None  # [rows, vocab] int32
        self.prompt_seen: Optional[torch.Tensor] = None  # [rows, vocab] bool

    def start(self, row: int, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        """Row `row` now belongs to a penalized request with this prompt and these outputs so
        far (a retracted request comes back with some)."""
        if self.output_counts is None or self.prompt_seen is None:
            self.output_counts = torch.zeros((self.rows, self.vocab), dtype=torch.int32,
                                             device=self.device)
            self.prompt_seen = torch.zeros((self.rows, self.vocab), dtype=torch.bool,
                                           device=self.device)
        self.output_counts[row].zero_()
        self.prompt_seen[row].zero_()
        self.prompt_seen[row, to_device(list(prompt), torch.int64, self.device)] = True
        if outputs:
            ids = to_device(list(outputs), torch.int64, self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, reqs: List[Req],
              drafted: Optional[Sequence[Tuple[int, ...]]] = None) -> torch.Tensor:
        """Penalized float32 logits for `reqs` (row i of `logits` is reqs[i], in page-table
        rows `rows`); the input itself is not changed. Rows without penalties pass as they are.
        `drafted`: per logits row, tokens counted as output beside the row's counts (a
        verify step's drafts before each position: engine.draft_prefixes)."""
        if not any(r.params.has_penalties for r in reqs):
            return logits
        if self.output_counts is None or self.prompt_seen is None:
            raise RuntimeError("penalties applied before any penalized request was started "
                               "(Engine.start_request runs at admission)")
        ps = [r.params for r in reqs]
        def column(values: List[float]) -> torch.Tensor:
            return to_device(values, torch.float32, self.device).unsqueeze(1)
        rep = column([p.repetition_penalty for p in ps])
        freq = column([p.frequency_penalty for p in ps])
        pres = column([p.presence_penalty for p in ps])
        rows = rows.long()
        counts = self.output_counts[rows].float()
        pairs = [(i, t) for i, (req, before) in enumerate(zip(reqs, drafted or ()))
                 if req.params.has_penalties for t in before]
        if pairs:
            at = to_device([[i for i, _ in pairs], [t for _, t in pairs]], torch.int64,
                           self.device)
            counts.index_put_((at[0], at[1]), torch.ones(len(pairs), device=self.device),
                              accumulate=True)
        present = counts > 0
        out = logits.float()
        out = torch.where(self.prompt_seen[rows] | present,
                          torch.where(out > 0, out / rep, out * rep), out)
        return out - freq * counts - pres * present.float()

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, reqs: List[Req]) -> None:
        """Count the sampled `tokens` (row i of `rows` is reqs[i]) for the penalized requests."""
        if self.output_counts is None or not any(r.params.has_penalties for r in reqs):
            return
        self.output_counts.index_put_((rows.long(), tokens),
                                      torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
