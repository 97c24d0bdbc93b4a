"""Gated activation of the fused gate/up projection: act(gate) * up, act SiLU or GELU (tanh)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import GELU_TANH, SILU, ProductScales

if TYPE_CHECKING:  # kernels/fp8.py imports triton: only CUDA paths load it
    from minisgl.kernels.fp8 import Quantized


def act_and_mul(x: torch.Tensor, act: int = SILU,
                policy: KernelPolicy = KernelPolicy()) -> torch.Tensor:
    """x = [gate | up] along the last dimension; returns act(gate) * up, act SiLU or GELU
    with its tanh approximation (transformers' "gelu_pytorch_tanh": Gemma's MLP) by its code
    (kernels/types.py). `policy.fused`: one Triton kernel on CUDA tensors, launched with
    programmatic dependent launch where `policy.pdl`; else torch ops."""
    if policy.fused and x.is_cuda:
        from minisgl.kernels import activation
        return activation.act_and_mul(x.contiguous(), act, policy.pdl)
    gate, up = x.chunk(2, dim=-1)
    if act == GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def act_and_mul_quantized(x: torch.Tensor, act: int, policy: KernelPolicy,
                          scales: Optional[ProductScales] = None) -> Quantized:
    """act(gate) * up quantized per token, in one Triton kernel, for an FP8 down projection
    (RowParallelLinear.takes_quantized); with `scales`, x is an unscaled FP8 product
    (layers/fp8.UnscaledProduct) and the kernel scales it first. CUDA tensors and a
    fused policy only (ValueError otherwise)."""
    if not (policy.fused and x.is_cuda):
        raise ValueError("act_and_mul_quantized runs the fused kernel: CUDA tensors and a "
                         "fused kernel policy")
    from minisgl.kernels import activation
    rows, cols = scales if scales is not None else (None, None)
    return activation.act_and_mul_quantized(x.contiguous(), act, policy.pdl, rows, cols)
