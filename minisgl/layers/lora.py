"""LoRA adapters of one projection: the low-rank deltas some of a batch's tokens add.

A projection fusing several checkpoint layers (QKV, gate/up) holds one adapter pair per part.
The parts' A matrices are stacked along the rank, and B is block-diagonal over them (zeros
between the parts), so that a token's delta for every part is two matrix products:
delta = (x A^T) B^T, with A [parts * rank, in] and B [out, parts * rank], the adapter's
scaling folded into B. Slot s of the buffers holds adapter s (models/lora.py loads them); an
adapter of a smaller rank is zero-padded, which adds nothing.

A batch's adapters take one pair of products together, whatever their number: the slots'
A matrices stacked ([k * parts * rank, in]) give every token's low-rank input under each
adapter, a mask (`LoraRows.mask`) zeroes all but its own adapter's (all of them for a token of
the base model), and the slots' B matrices side by side ([out, k * parts * rank]) turn that into
its delta. No host value enters, so the decode graphs capture it over every slot; the extra
work is the other slots' rank-sized columns, small beside the projection itself. On CUDA with
the fused kernels the mask and the expand product are one Triton kernel (kernels/lora.py),
which adds the delta to the projection as it goes: two launches a projection, not three.

Tensor parallelism follows the weight's split: a column-parallel layer's ranks hold all of A
and their rows of B (each part's shard, as the weight's); a row-parallel layer's ranks hold
their columns of A and all of B, so each rank's delta is a partial sum that the layer's
all-reduce completes with its product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from minisgl.core import LoraRows
from minisgl.distributed import Shard
from minisgl.kernels.policy import KernelPolicy
from minisgl.layers import blas


@dataclass(frozen=True)
class LoraShape:
    """The adapters a model can hold: `slots` of them (every one resident), each of rank at
    most `max_rank`."""

    slots: int
    max_rank: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_rank < 1:
            raise ValueError(f"LoRA needs at least one adapter slot and a rank >= 1, got "
                             f"{self.slots} slots of rank {self.max_rank}")


class LoraSlots(nn.Module):
    """A [slots, parts * max_rank, in_local] and B [out_local, slots, parts * max_rank] of one
    projection (see the module's docstring: B's slots are inner so that all of them are one
    [out_local, slots * parts * max_rank] matrix); zeros until an adapter loads into a slot.
    Loads and clears write in place: captured graphs read the same tensors."""

    a: torch.Tensor
    b: torch.Tensor

    def __init__(self, shape: LoraShape, in_local: int, out_shards: Sequence[Shard],
                 policy: KernelPolicy = KernelPolicy()) -> None:
        """`out_shards`: this rank's rows of each part of the output, in the order of the
        weight's local rows (a row-parallel layer: one part, all its rows). `policy.fused`:
        the Triton expand on CUDA."""
        super().__init__()
        self.policy = policy
        self.max_rank = shape.max_rank
        self.out_shards = list(out_shards)
        self.offsets = [sum(s.size for s in self.out_shards[:i])
                        for i in range(len(self.out_shards))]
        cols = len(self.out_shards) * shape.max_rank
        out_local = sum(s.size for s in self.out_shards)
        self.register_buffer("a", torch.zeros(shape.slots, cols, in_local), persistent=False)
        self.register_buffer("b", torch.zeros(out_local, shape.slots, cols), persistent=False)

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor,
             scaling: float) -> None:
        """Adapter `slot`'s pair for output `part`: a [rank, in_local] (this rank's columns
        already cut where the layer is row-parallel), b [part's full rows, rank], whose rows
        this rank keeps as the weight's; the rank padded up to max_rank."""
        rank = a.shape[0]
        if rank > self.max_rank or b.shape[1] != rank or a.shape[1] != self.a.shape[2]:
            raise ValueError(f"LoRA pair of shapes A {tuple(a.shape)}, B {tuple(b.shape)} does "
                             f"not fit rank <= {self.max_rank}, {self.a.shape[2]} inputs")
        shard = self.out_shards[part]
        if b.shape[0] < shard.stop:
            raise ValueError(f"LoRA B has {b.shape[0]} rows; this projection's part {part} "
                             f"needs rows {shard.start}..{shard.stop}")
        cols = slice(part * self.max_rank, part * self.max_rank + rank)
        rows = slice(self.offsets[part], self.offsets[part] + shard.size)
        self.a[slot, cols] = a.to(self.a.dtype)
        self.b[rows, slot, cols] = (b[shard.start:shard.stop].float() * scaling).to(self.b.dtype)

    def clear(self, slot: int) -> None:
        """Zero adapter `slot`'s pairs (none loaded there)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """y (the projection of x, [T, out_local]) plus each token's delta under its adapter
        (`rows`; x [T, in_local]): a new tensor, y left as it was. `policy.batch_invariant`:
        both products are blas.invariant_linear's over every slot (rows.picks must be None),
        so a token's delta does not depend on the batch."""
        if self.policy.batch_invariant:
            return self._invariant_delta(y, x, rows)
        a, b = self.a, self.b
        if rows.picks is not None:
            a, b = a.index_select(0, rows.picks), b.index_select(1, rows.picks)
        low = x @ a.reshape(-1, a.shape[2]).t()  # [T, k * cols]
        b = b.reshape(b.shape[0], -1)
        if self.policy.fused and y.is_cuda:
            from minisgl.kernels import lora as kernels
            if low.shape[1] <= kernels.MAX_LOW_COLUMNS:
                return kernels.expand_add(y, low, rows.mask, b, a.shape[1])
        low = (low.view(x.shape[0], a.shape[0], a.shape[1]) * rows.mask.unsqueeze(2)).flatten(1)
        if y.dtype != low.dtype:
            return y + (low @ b.t()).to(y.dtype)
        return torch.addmm(y, low, b.t())  # one kernel: the product and the sum

    def _invariant_delta(self, y: torch.Tensor, x: torch.Tensor, rows: LoraRows
                         ) -> torch.Tensor:
        if rows.picks is not None:
            raise ValueError("a batch-invariant LoRA delta spans every slot: rows.picks must "
                             "be None (engine/lora.py lora_rows' every_slot)")
        slots, cols = self.a.shape[0], self.a.shape[1]
        low = blas.invariant_linear(x, self.a.reshape(-1, self.a.shape[2]), None)
        low = (low.view(x.shape[0], slots, cols) * rows.mask.unsqueeze(2)).flatten(1)
        delta = blas.invariant_linear(low, self.b.reshape(self.b.shape[0], -1), None)
        return y + delta.to(y.dtype)
