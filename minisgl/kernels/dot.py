"""The matrix-product helpers the tiled Triton kernels (attention, fused MoE, the FP8 and packed
integer GEMMs) share: which operands a `tl.dot` takes, the dot itself, and the order of the
output tiles. This module imports triton: only GPU kernel
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


@triton.jit
def swizzled_tile(pid, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SWIZZLE: tl.constexpr):
    """(row block, column block) of program `pid` over an [m, n] output: the programs that
    share a weight column block run close together, so its weights are read once from memory
    for SWIZZLE row blocks."""
    grid_m = tl.cdiv(m, BLOCK_M)
    grid_n = tl.cdiv(n, BLOCK_N)
    width = SWIZZLE * grid_n
    first_m = (pid // width) * SWIZZLE
    size_m = tl.minimum(grid_m - first_m, SWIZZLE)
    return first_m + (pid % width) % size_m, (pid % width) // size_m
