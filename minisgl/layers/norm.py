"""RMSNorm, computed in float32 like the reference implementation, with an optional fused
residual add (`forward(x, residual)` returns the normed sum and the new residual)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple, Union

import torch
from torch import nn

from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import Normed, ProductScales
from minisgl.layers.readback import Piece
from minisgl.layers.source import TensorSource, copy_into

if TYPE_CHECKING:  # kernels/fp8.py imports triton: only CUDA paths load it
    from minisgl.kernels.fp8 import Quantized


class RMSNorm(nn.Module):
    """`policy.fused`: on CUDA tensors, one Triton kernel (kernels/rmsnorm.py) instead of torch
    ops, launched with programmatic dependent launch where `policy.pdl`. `offset`: added to
    the checkpoint's weight as it loads (Gemma's norms multiply by 1 + weight; the sum is
    taken in float32 and rounded once to the model's dtype)."""

    def __init__(self, dim: int, eps: float, policy: KernelPolicy = KernelPolicy(),
                 offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.policy = policy
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                scales: Optional[ProductScales] = None) -> Union[torch.Tensor, Normed]:
        """norm(x), or with `residual` Normed(norm(x + residual), x + residual). `scales`: x
        is an unscaled FP8 product, x * scales.row * scales.col its value (applied in the
        kernel where it is fused, as kernels/fp8.rescale rounds them)."""
        if self.policy.fused and x.is_cuda:
            from minisgl.kernels import rmsnorm
            out, new_residual = rmsnorm.rmsnorm(x, self.weight, self.eps, residual,
                                                self.policy.pdl, scales)
            return out if new_residual is None else Normed(out, new_residual)
        if scales is not None:
            x = (x.float() * scales.row * scales.col).to(x.dtype)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return Normed(self._norm(x), x)

    def quantized(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                  scales: Optional[ProductScales] = None) -> Tuple[Quantized, torch.Tensor]:
        """(norm(x + residual) quantized per token, x + residual) in one Triton kernel
        (kernels/rmsnorm.rmsnorm_quantized), for a W8A8 projection's input; CUDA tensors and a
        fused policy only (ValueError otherwise). `scales` as for `forward`."""
        if not (self.policy.fused and x.is_cuda):
            raise ValueError("RMSNorm.quantized runs the fused norm kernel: CUDA tensors and a "
                             "fused kernel policy")
        from minisgl.kernels import rmsnorm
        if scales is not None and residual is None:  # h would be the product's scaled copy
            raise ValueError("RMSNorm.quantized of an unscaled product takes a residual")
        q, new_residual = rmsnorm.rmsnorm_quantized(x, self.weight, self.eps, residual,
                                                    self.policy.pdl, scales)
        return q, (x if new_residual is None else new_residual)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        weight = src.read()
        copy_into(self.weight.data, weight.float() + self.offset if self.offset else weight,
                  "norm weight")

    def piece(self, param: str, shard_id: int = 0) -> Piece:
        """The weight as the checkpoint holds it (the offset taken off again)."""
        return Piece(self.weight.float() - self.offset if self.offset else self.weight)
