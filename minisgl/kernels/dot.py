"""The matrix-product helpers the tiled Triton kernels (attention, fused MoE, the FP8 and packed
integer GEMMs) share: which operands a `tl.dot` takes, the dot itself, the order of the
output tiles, and the GPU facts their tilings turn on. This module imports triton: only GPU kernel
modules (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl


class GpuFacts(NamedTuple):
    capability: Tuple[int, int]
    sms: int  # multiprocessors


@functools.lru_cache(maxsize=None)
def gpu_facts(index: Optional[int]) -> GpuFacts:
    """The compute capability and multiprocessors of CUDA device `index`; ((0, 0), 8) for None
    (a CPU tensor: the interpreter). Read once a device: every projection of a step asks."""
    if index is None:
        return GpuFacts((0, 0), 8)
    props = torch.cuda.get_device_properties(index)
    return GpuFacts((props.major, props.minor), props.multi_processor_count)


def tensor_gpu(t: torch.Tensor) -> GpuFacts:
    """`gpu_facts` of the device `t` is on."""
    return gpu_facts(t.device.index if t.is_cuda else None)


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
