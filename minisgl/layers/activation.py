"""Gated activation of the fused gate/up projection."""

import torch
import torch.nn.functional as F

from minisgl.kernels.policy import KernelPolicy


def silu_and_mul(x: torch.Tensor, policy: KernelPolicy = KernelPolicy()) -> torch.Tensor:
    """x = [gate | up] along the last dimension; returns silu(gate) * up (`policy.fused`: one
    Triton kernel on CUDA tensors, launched with programmatic dependent launch where
    `policy.pdl`)."""
    if policy.fused and x.is_cuda:
        from minisgl.kernels import activation
        return activation.silu_and_mul(x.contiguous(), policy.pdl)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
