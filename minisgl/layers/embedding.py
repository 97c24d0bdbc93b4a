"""Vocab-parallel embedding and LM head.

The vocabulary is padded up to a multiple of tp; rank r owns rows [r*V/tp, (r+1)*V/tp) of the
padded table. The embedding all-reduces the rows each rank found; the LM head all-gathers the
logits so every rank holds the full row (and so samples the same token).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import Communicator, DistributedInfo
from minisgl.kernels.policy import KernelPolicy
from minisgl.layers.linear import project
from minisgl.layers.readback import Piece
from minisgl.layers.source import TensorSource, copy_into


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, info: DistributedInfo,
                 comm: Communicator) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // info.size) * info.size
        self.shard = info.shard(self.padded_vocab, "padded vocabulary")
        self.comm = comm
        self.tp = info.size
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        start, stop = self.shard.start, min(self.shard.stop, self.vocab_size)
        self.weight.data.zero_()
        if stop > start:
            copy_into(self.weight.data[: stop - start], src.read(0, start, stop), "embedding")

    def piece(self, param: str, shard_id: int = 0) -> Piece:
        """The vocabulary rows this rank holds (none of its padding)."""
        start, stop = self.shard.start, min(self.shard.stop, self.vocab_size)
        return Piece(self.weight[:max(stop - start, 0)], 0, min(start, self.vocab_size),
                     self.vocab_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary on every rank; `tied_to` shares the embedding's rows;
    `policy`: see layers/linear.project; `softcap`: the logits are capped to
    softcap * tanh(logits / softcap) (Gemma's final_logit_softcapping; None: not); `divisor`:
    the logits are divided by it (Granite's logits_scaling)."""

    def __init__(self, vocab_size: int, hidden: int, info: DistributedInfo, comm: Communicator,
                 tied_to: Optional[VocabParallelEmbedding] = None,
                 policy: KernelPolicy = KernelPolicy(), softcap: Optional[float] = None,
                 divisor: float = 1.0) -> None:
        super().__init__(vocab_size, hidden, info, comm)
        self.policy = policy
        self.softcap = softcap
        self.divisor = divisor
        self.blas_by_rows: Dict[int, str] = {}  # see layers/linear.project; filled by blas.tune
        if tied_to is not None:
            self.weight = tied_to.weight

    def forward(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [rows, vocab_size] of `hidden` [rows, hidden], in its dtype: a view of `out`
        [rows, padded_vocab] where given (the logits land there, every rank's gathered), else of
        a new tensor."""
        if self.tp == 1:
            logits = project(hidden, self.weight, None, self.policy, self.blas_by_rows, out=out)
        else:
            logits = self.comm.all_gather_last_dim(project(hidden, self.weight, None, self.policy,
                                                           self.blas_by_rows), out=out)
        logits = logits[..., : self.vocab_size]
        if self.divisor != 1.0:  # in place, as the softcap
            logits.div_(self.divisor)
        if self.softcap:  # in place: the logits stay where `out` put them
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits
