"""Tensor-parallel linear layers.

Column-parallel layers split the output features (no communication); row-parallel layers split the
input features and all-reduce the partial sums. Each layer's `load` reads only this rank's slice.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import Communicator, DistributedInfo, Shard
from minisgl.layers.norm import RMSNorm
from minisgl.layers.source import TensorSource, copy_into


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def takes_gemv(x: torch.Tensor, pdl: bool) -> bool:
    """Whether `project(x, ..., pdl)` runs the Triton GEMV: with `pdl`, a single token in a half
    dtype on CUDA (decode at batch 1)."""
    return (pdl and x.is_cuda and x.numel() == x.shape[-1]
            and x.dtype in (torch.bfloat16, torch.float16))


def project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
            pdl: bool = False, gated: bool = False) -> torch.Tensor:
    """x W^T + b. Where `takes_gemv(x, pdl)`, the Triton GEMV of layers/triton_ops.py, launched
    with programmatic dependent launch so that its weights stream while the previous kernel
    finishes; anything else F.linear (cuBLAS). `gated` (GEMV only, else ValueError): x is
    [gate | up] and the input is silu(gate) * up, computed inside the GEMV."""
    if takes_gemv(x, pdl):
        from minisgl.layers import triton_ops
        return triton_ops.gemv(x, weight, bias, pdl=True, gated=gated)
    if gated:
        raise ValueError(f"a gated projection runs only in the one-token GEMV (pdl on, one "
                         f"half-precision CUDA row); got x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device}, pdl {pdl}")
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: this rank holds rows `out_sizes` slices.

    `out_sizes` lists the logical outputs fused into one matrix (e.g. gate and up); each is split
    across ranks separately, so shard `i` of every rank is contiguous in the local weight.
    """

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool,
                 info: DistributedInfo, pdl: bool = False) -> None:
        super().__init__()
        self.info = info
        self.pdl = pdl  # see project()
        self.shards = [info.shard(n, "linear output features") for n in out_sizes]
        self.offsets = [sum(s.size for s in self.shards[:i]) for i in range(len(self.shards))]
        local_out = sum(s.size for s in self.shards)
        self.weight = _empty(local_out, in_features)
        self.bias = _empty(local_out) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.pdl)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        shard, off = self.shards[shard_id], self.offsets[shard_id]
        dst = getattr(self, param)
        copy_into(dst.data[off:off + shard.size], src.read(0, shard.start, shard.stop),
                  f"{param}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections. Q heads are split over ranks; KV heads are split when tp divides
    them and replicated (each rank keeps the one KV head its Q heads use) when tp exceeds them."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 info: DistributedInfo, pdl: bool = False) -> None:
        check_head_split(num_heads, num_kv_heads, info.size)
        self.num_local_heads = num_heads // info.size
        self.num_local_kv_heads = max(1, num_kv_heads // info.size)
        super().__init__(hidden, [num_heads * head_dim], bias, info, pdl)
        kv_start = (info.rank * num_kv_heads // info.size) * head_dim
        kv_size = self.num_local_kv_heads * head_dim
        self.shards = self.shards + [Shard(kv_start, kv_size), Shard(kv_start, kv_size)]
        self.offsets = [0, self.shards[0].size, self.shards[0].size + kv_size]
        local_out = self.shards[0].size + 2 * kv_size
        self.weight = _empty(local_out, hidden)
        self.bias = _empty(local_out) if bias else None
        self.head_dim = head_dim

    @property
    def split_sizes(self) -> List[int]:
        q = self.num_local_heads * self.head_dim
        kv = self.num_local_kv_heads * self.head_dim
        return [q, kv, kv]


def check_head_split(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Fail at start-up, naming the numbers, when the heads cannot be split over `tp` ranks."""
    if num_heads % tp != 0:
        raise ValueError(f"cannot split {num_heads} attention heads over tp={tp}: "
                         f"tp must divide the number of attention heads")
    if num_kv_heads % tp != 0 and tp % num_kv_heads != 0:
        raise ValueError(f"cannot split {num_kv_heads} KV heads over tp={tp}: tp must divide the "
                         f"KV heads or be a multiple of them (attention heads: {num_heads})")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b; the input features are split over ranks.

    Where an RMSNorm follows (o_proj, down_proj), the decoder takes the partial product
    (`forward(x, reduce=False)`) and hands it to `reduce_norm`, which can do the all-reduce,
    the residual add and the norm in one kernel (Communicator.all_reduce_rmsnorm)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, info: DistributedInfo,
                 comm: Communicator, pdl: bool = False) -> None:
        super().__init__()
        self.pdl = pdl  # see project()
        self.shard = info.shard(in_features, "linear input features")
        self.comm = comm
        self.weight = _empty(out_features, self.shard.size)
        self.bias = _empty(out_features) if bias else None

    def forward(self, x: torch.Tensor, reduce: bool = True, gated: bool = False) -> torch.Tensor:
        """The layer's output; with `reduce=False` only this rank's partial product (no
        all-reduce, no bias), which the caller must pass to `finish` or `reduce_norm`.
        `gated`: x is [gate | up] of the local columns (see project; GEMV path only)."""
        partial = project(x, self.weight, None, self.pdl, gated)
        return self.finish(partial) if reduce else partial

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """The output from the partial product: all-reduce (a collective), then the bias."""
        y = self.comm.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """norm(finish(partial), residual): (the normed sum, the new residual). One fused kernel
        where the communicator offers it (no bias: it is added after the reduce, before the
        norm; the norm's Triton kernel on CUDA), else exactly `finish` then `norm`. A
        collective: every rank calls it in the same order with the same shapes."""
        if self.bias is None and norm.fused and partial.is_cuda:
            fused = self.comm.all_reduce_rmsnorm(partial, residual, norm.weight, norm.eps,
                                                 norm.pdl)
            if fused is not None:
                return fused
        # With a residual, RMSNorm returns (normed, new residual).
        return cast(Tuple[torch.Tensor, torch.Tensor], norm(self.finish(partial), residual))

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        if param == "bias":
            copy_into(self.bias.data, src.read(), "bias")
        else:
            copy_into(self.weight.data, src.read(1, self.shard.start, self.shard.stop), param)


class ReplicatedLinear(nn.Module):
    """A whole (unsplit) linear layer on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features)
        self.bias: Optional[nn.Parameter] = _empty(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        copy_into(getattr(self, param).data, src.read(), param)
