"""The one matrix-product helper the tiled Triton kernels (attention, fused MoE) share: which
operands a `tl.dot` takes, and the dot itself. This module imports triton: only GPU kernel
modules (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def f32_dot(t: torch.Tensor) -> bool:
    """Whether dots on `t` run on float32 operands: always for float32 (exact, no tf32), and on
    the CPU interpreter, whose bf16 tl.dot returned garbage (triton 3.9; fp16 was right)."""
    return t.dtype == torch.float32 or t.device.type != "cuda"


@triton.jit
def dot(a, b, F32_DOT: tl.constexpr):
    """a @ b with a float32 result; F32_DOT: upcast the operands and use IEEE float32."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)
