"""Gated activation of the fused gate/up projection."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, fused: bool = False, pdl: bool = False) -> torch.Tensor:
    """x = [gate | up] along the last dimension; returns silu(gate) * up (`fused`: one Triton
    kernel on CUDA tensors, `pdl`: launched with programmatic dependent launch)."""
    if fused and x.is_cuda:
        from minisgl.kernels import activation
        return activation.silu_and_mul(x.contiguous(), pdl)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
