"""The gated MLP's activation in Triton, act(gate) * up with act SiLU or GELU (tanh; the codes
of kernels/types.py): one launch on CUDA, and the one copy of its formula, which the gate/up
GEMV's epilogue (gemv.py) and the MoE GEMM's (moe.py) share so that all round alike;
`act_and_mul_quantized` also quantizes it per row for an FP8 down projection (one launch, or
two with each row split over programs at decode batch sizes). This module imports triton: only
GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8 import Quantized, amax_scale, empty_quantized, quantize_values
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.types import GELU_TANH, SILU

# Columns per pass of the quantizing activation kernel: 16 warps of 8 values per array in flight.
_ACT_QUANT_BLOCK = 4096
# The codes as Triton constants, for jit code (a kernel takes its code as an ACT argument)
ACT_SILU: tl.constexpr = tl.constexpr(SILU)
ACT_GELU_TANH: tl.constexpr = tl.constexpr(GELU_TANH)
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)


@triton.jit
def gated_f32(gate, up, ACT: tl.constexpr):
    """act(gate) * up in float32 (ACT: SILU or GELU_TANH): the one copy of the formulas,
    shared by the activation kernels and the GEMV's and MoE GEMM's epilogues, so all round
    alike. GELU's tanh(y) is 1 - 2 / (exp(2y) + 1) (no tanh in Triton's core language; exact
    at both ends: exp overflows to inf, or underflows to 0)."""
    gate = gate.to(tl.float32)
    if ACT == ACT_GELU_TANH:
        y = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return act * up.to(tl.float32)


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, d, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
    out = gated_f32(gate, up, ACT)
    tl.store(out_ptr + row * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, act: int = SILU, pdl: bool = False) -> torch.Tensor:
    """x = [gate | up] (contiguous) -> act(gate) * up (`act`: kernels/types.SILU or
    GELU_TANH)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = 1024
    _act_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, ACT=act, BLOCK=block,
                                                           PDL=pdl, **launch_options(pdl))
    return out.view(*x.shape[:-1], d)


@triton.jit
def _act_f32(x_row, rs, cs_ptr, cols, mask, d, ACT: tl.constexpr, SCALED: tl.constexpr):
    """act(gate) * up at `cols` of one [gate | up] row, rounded to its dtype, as float32
    (masked lanes 0). SCALED: the row is an unscaled FP8 product; gate and up are first
    x * rs * cs[col], rounded to x's dtype (the scaled product's values)."""
    ty = x_row.dtype.element_ty
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0)
    if SCALED:
        gate = (gate.to(tl.float32) * rs * tl.load(cs_ptr + cols, mask=mask, other=0.0)).to(ty)
        up = (up.to(tl.float32) * rs * tl.load(cs_ptr + d + cols, mask=mask, other=0.0)).to(ty)
    return gated_f32(gate, up, ACT).to(ty).to(tl.float32)


@triton.jit
def _act_mul_quant_kernel(x_ptr, act_ptr, q_ptr, s_ptr, rs_ptr, cs_ptr, d, ACT: tl.constexpr,
                          SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program `row`: act(gate) * up rounded to x's dtype, quantized per row as
    fp8.quantize_row_store does, in two passes of BLOCK columns: the activation into the
    scratch row act[row] (x's dtype) and its amax, then the FP8 values from the scratch (read
    back from L2 by the threads that wrote it) and the scale at s[row]. Holding a 14,336-wide
    row whole in registers took a multiprocessor per program (a decode batch of 137 rows ran
    in two waves); recomputing the activation in the second pass doubled a kernel bound by
    arithmetic (RESULTS.md, fourteenth session). SCALED: see `_act_f32`."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * 2 * d
    act_row = act_ptr + row * d
    rs = tl.load(rs_ptr + row) if SCALED else 1.0
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < d
        act = _act_f32(x_row, rs, cs_ptr, cols, mask, d, ACT, SCALED)
        tl.store(act_row + cols, act.to(act_ptr.dtype.element_ty), mask=mask)
        amax = tl.maximum(amax, tl.abs(act))
    scale = amax_scale(tl.max(amax, axis=0))
    tl.debug_barrier()  # the scratch row is written before any thread reads it back
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < d
        act = tl.load(act_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = quantize_values(act, scale)
        tl.store(q_ptr + row * d + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _act_mul_part_kernel(x_ptr, act_ptr, amax_ptr, rs_ptr, cs_ptr, d, parts, ACT: tl.constexpr,
                         SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, p): columns [p * BLOCK, +BLOCK) of the row's activation into the scratch
    row act[row] (x's dtype), and their largest magnitude at amax[row, p]."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    rs = tl.load(rs_ptr + row) if SCALED else 1.0
    act = _act_f32(x_ptr + row * 2 * d, rs, cs_ptr, cols, mask, d, ACT, SCALED)
    tl.store(act_ptr + row * d + cols, act.to(act_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr + row * parts + part, tl.max(tl.abs(act), axis=0))


@triton.jit
def _quant_part_kernel(act_ptr, amax_ptr, q_ptr, s_ptr, d, parts, BLOCK: tl.constexpr,
                       PARTS: tl.constexpr, PDL: tl.constexpr):
    """Program (row, p): the row's scale from its parts' amax (program 0 stores it at s[row]),
    and columns [p * BLOCK, +BLOCK) of the scratch row quantized by it."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = tl.arange(0, PARTS)
    amax = tl.max(tl.load(amax_ptr + row * parts + offs, mask=offs < parts, other=0.0), axis=0)
    scale = amax_scale(amax)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    act = tl.load(act_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * d + cols, quantize_values(act, scale).to(q_ptr.dtype.element_ty),
             mask=mask)
    if part == 0:
        tl.store(s_ptr + row, scale)


# Up to this many rows (small decode batches) the quantizing activation splits each row over
# programs of _SPLIT_BLOCK columns, in two launches (activation and amax per part, then the
# FP8 values). On an H200 at d = 14,336 (RESULTS.md, nineteenth session): 1 row 6.67 -> 3.15
# us, 137 rows 10.05 -> 7.86; at 256 rows one program a row is faster (10.86 against 11.63).
SPLIT_MAX_ROWS = 192
_SPLIT_BLOCK = 1024


def act_and_mul_quantized(x: torch.Tensor, act: int = SILU, pdl: bool = False,
                          row_scale: Optional[torch.Tensor] = None,
                          col_scale: Optional[torch.Tensor] = None,
                          tiles: Optional[Tuple[int, int]] = None,
                          split: Optional[bool] = None) -> Quantized:
    """x = [gate | up] (contiguous, rows [..., 2d]) -> act(gate) * up as FP8 rows [M, d] and
    their scales [M, 1]: fp8.quantize_tokens of `act_and_mul(x, act)`, exactly.
    With `row_scale` [M] and `col_scale` [2d]: x is an unscaled FP8 product
    (fp8.unscaled_mm) and its scales are applied first, as fp8.rescale would. `split`: each
    row over several programs in two launches (None: up to SPLIT_MAX_ROWS rows), else one
    program a row in one launch; both give the same bits. `tiles`: (columns per pass, or per
    program with `split`; warps) instead of the default (scripts/bench_kernels.py --what
    silu)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    scaled = row_scale is not None and col_scale is not None
    if (row_scale is None) != (col_scale is None) or (
            row_scale is not None and col_scale is not None
            and (row_scale.numel() != x2.shape[0] or col_scale.numel() != 2 * d)):
        raise ValueError(f"act_and_mul_quantized takes both scales or neither: {x2.shape[0]} "
                         f"row scales and {2 * d} column scales")
    out = empty_quantized(x2.shape[0], d, x.device)
    scratch = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if split if split is not None else x2.shape[0] <= SPLIT_MAX_ROWS:
        _split_act_quant(x2, scratch, out, act, row_scale if scaled else None,
                         col_scale if scaled else None, pdl, tiles)
        return out
    block = min(_ACT_QUANT_BLOCK, triton.next_power_of_2(d))
    block, warps = tiles if tiles is not None else (block, max(4, min(16, block // 256)))
    _act_mul_quant_kernel[(x2.shape[0],)](
        x2, scratch, out.values, out.scales, row_scale if scaled else out.scales,
        col_scale if scaled else out.scales, d, ACT=act, SCALED=scaled, BLOCK=block, PDL=pdl,
        num_warps=warps, **launch_options(pdl))
    return out


def _split_act_quant(x2: torch.Tensor, scratch: torch.Tensor, out: Quantized, act: int,
                     row_scale: Optional[torch.Tensor], col_scale: Optional[torch.Tensor],
                     pdl: bool, tiles: Optional[Tuple[int, int]]) -> None:
    """act_and_mul_quantized with each row over ceil(d / BLOCK) programs: the activation and
    each part's amax, then the FP8 values by the row's largest amax (max is exact in any
    order: the same scale, the same bits as one program a row)."""
    m, d = scratch.shape
    block = min(_SPLIT_BLOCK, triton.next_power_of_2(d))
    block, warps = tiles if tiles is not None else (block, 4)
    parts = triton.cdiv(d, block)
    amax = torch.empty((m, parts), dtype=torch.float32, device=x2.device)
    scaled = row_scale is not None and col_scale is not None
    _act_mul_part_kernel[(m, parts)](
        x2, scratch, amax, row_scale if scaled else amax, col_scale if scaled else amax, d,
        parts, ACT=act, SCALED=scaled, BLOCK=block, PDL=pdl, num_warps=warps,
        **launch_options(pdl))
    _quant_part_kernel[(m, parts)](
        scratch, amax, out.values, out.scales, d, parts, BLOCK=block,
        PARTS=max(2, triton.next_power_of_2(parts)), PDL=pdl, num_warps=warps,
        **launch_options(pdl))
