"""A batch-invariant product out = x W^T + b (deterministic inference, SGLang's
--enable-deterministic-inference; vLLM's VLLM_BATCH_INVARIANT): each output row's bits depend
on its own input row and the weights only, never on how many rows come with it.

cuBLAS picks its kernel, its tiles and any split of K by the row count, so one token's product
rounds one way at a decode step of one row and another inside a prefill chunk or a verify
step of five. Here every output element sums the same products in the same order wherever
its row sits: K is cut in ranges fixed by the weight's shape and the GPU (`k_splits`), each
range summed from zero in steps of one depth (BLOCK_K) in increasing order, and the ranges'
sums added in order; by one program looping over the ranges (from LARGE_TILE_ROWS rows) or,
for a few rows, by one program a range writing float32 partials that a second launch adds in
the same order (the same bits, and a decode step's few rows fill the GPU). The row count is
not specialized on (`do_not_specialize`). The output tile may follow the row count on sm_90
(`invariant_tiles`): there a row's bits were measured the same at every tile from 64 x 64 to
128 x 256 and 4 or 8 warps (the tensor cores sum each element's 16-deep chunks alike;
RESULTS.md, forty-sixth session), and large tiles make a prefill's products 1.5-2.4x faster;
elsewhere one tile serves every row count. On sm_90 a prefill's large tiles are loaded by TMA
(the same products in the same order: the same bits; 1.3-1.7x faster than pointer loads,
forty-seventh session). Output tiles run in swizzled order: a weight column block's programs
run together and read it from memory once per 8 row blocks. Decode steps still run in CUDA
graphs (the partials' buffer is allocated per call, which a capture records once).

This module imports triton: only GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minisgl.kernels.dot import dot, f32_dot, swizzled_tile, tensor_gpu
from minisgl.utils import checked_out


class InvariantTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool  # the operands' tiles come by the Hopper tensor memory accelerator


class Ranges(NamedTuple):
    """K's ranges: `splits` of `span` columns each (the last may hold fewer)."""

    splits: int
    span: int


# From this many rows (a prefill chunk) sm_90 takes the large output tile.
LARGE_TILE_ROWS = 256
# Weights wider than this take 128-wide large tiles (the gate/up projections: 128 x 256 was
# 1.2x slower there at 8,192 rows; RESULTS.md, forty-seventh session).
WIDE_WEIGHT = 16384


def invariant_tiles(dtype: torch.dtype, rows: int, n: int,
                    capability: Tuple[int, int]) -> InvariantTiles:
    """The tiling of `rows` rows of a dtype times a weight of `n` outputs on a GPU of
    `capability`: BLOCK_K (and so each element's order of sums) is the dtype's alone. Half
    types: 64-deep steps of K on the tensor cores, 64 x 64 output tiles, and on sm_90 from
    LARGE_TILE_ROWS rows 128 x 256 (128 x 128 over WIDE_WEIGHT outputs) with 8 warps, loaded
    by TMA (module doc); float32 (IEEE dots on the FMA units): one small tile that compiles
    without spills."""
    if dtype == torch.float32:
        return InvariantTiles(32, 32, 32, 4, 2, False)
    if rows >= LARGE_TILE_ROWS and capability[0] == 9:
        return InvariantTiles(128, 128 if n > WIDE_WEIGHT else 256, 64, 8, 3, True)
    return InvariantTiles(64, 64, 64, 4, 3, False)


def k_splits(n: int, k: int, block_k: int, sms: int) -> int:
    """How many ranges K is summed in for a weight of `n` outputs and `k` inputs: a property
    of the weight and the GPU, never of the row count (each element's sum is the ranges'
    sums added in order, however they are computed). Enough that a few rows' 64-wide column
    blocks make about two programs a multiprocessor, each range at least 8 steps of K, at
    most 8 ranges."""
    want = triton.cdiv(2 * sms, triton.cdiv(n, 64))
    return max(1, min(want, k // (block_k * 8), 8))


@triton.jit
def _range_sum(x_tile, w_tile, mask_m, mask_n, k_lo, k_hi, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               F32_DOT: tl.constexpr):
    """x[rows, k_lo:k_hi] W[cols, k_lo:k_hi]^T in float32, from zero, in steps of BLOCK_K in
    increasing order. x_tile / w_tile: the [BLOCK_M, BLOCK_K] / [BLOCK_K, BLOCK_N] pointers at
    k = 0. EVEN_K: K is a whole number of steps (no step reads past a range's end)."""
    ks = tl.arange(0, BLOCK_K)
    x_tile += k_lo
    w_tile += k_lo
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_tile, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_tile, mask=mask_n[None, :], other=0.0)
        else:
            a = tl.load(x_tile, mask=mask_m[:, None] & (k0 + ks[None, :] < k_hi), other=0.0)
            w = tl.load(w_tile, mask=mask_n[None, :] & (k0 + ks[:, None] < k_hi), other=0.0)
        acc += dot(a, w, F32_DOT)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["m"])
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, m, n, k, splits, span,
                         stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                         PARALLEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWIZZLE: tl.constexpr,
                         F32_DOT: tl.constexpr):
    """Program (output tile, range), the tiles in swizzled order (a weight column block's
    programs run together: its weights are read from memory once per SWIZZLE row blocks):
    PARALLEL, range r's sum of out[rows, cols] into the float32 partials [splits, m, n]
    (`_sum_ranges` finishes); else every range in turn, each from zero, added in order (the
    same bits), plus b[cols], rounded once."""
    pid_m, pid_n = swizzled_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, SWIZZLE)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    mask_n = offs_n < n
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_tile = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None]
    tile = offs_m[:, None].to(tl.int64) * n + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if PARALLEL:
        r = tl.program_id(1)
        acc = _range_sum(x_tile, w_tile, mask_m, mask_n, r * span, tl.minimum(r * span + span, k),
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, F32_DOT)
        tl.store(part_ptr + r.to(tl.int64) * m * n + tile, acc, mask=mask)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r in range(0, splits):
            total += _range_sum(x_tile, w_tile, mask_m, mask_n, r * span,
                                tl.minimum(r * span + span, k), BLOCK_M, BLOCK_N, BLOCK_K,
                                EVEN_K, F32_DOT)
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["m"])
def _invariant_mm_tma_kernel(x_desc, w_desc, b_ptr, out_ptr, m, n, k, splits, span, stride_om,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SWIZZLE: tl.constexpr):
    """`_invariant_mm_kernel`'s serial arithmetic (every range in turn, each from zero in
    steps of BLOCK_K, added in order), the tiles loaded by TMA descriptors: x_desc's blocks
    [BLOCK_M, BLOCK_K], w_desc's [BLOCK_N, BLOCK_K]; past the tensors' edges they read zeros,
    and no step crosses a range's end (span is a whole number of steps). Half types only
    (`invariant_tiles`): tl.dot's default precision would take float32 as tf32."""
    pid_m, pid_n = swizzled_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, SWIZZLE)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(0, splits):
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(r * span, tl.minimum(r * span + span, k), BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc += tl.dot(a, w.T)
        total += acc
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             total.to(out_ptr.dtype.element_ty), mask=(offs_m < m)[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["m"])
def _sum_ranges(part_ptr, b_ptr, out_ptr, m, n, splits, stride_om, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[rows, cols] = the ranges' partials added in order from zero (+ b[cols]), rounded
    once: the serial kernel's arithmetic."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    tile = offs_m[:, None].to(tl.int64) * n + offs_n[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(0, splits):
        # int32 is enough: ranges split only weights of at most 64 x (2 x SMs) outputs
        # (k_splits), over fewer than LARGE_TILE_ROWS rows
        total += tl.load(part_ptr + r * m * n + tile, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             total.to(out_ptr.dtype.element_ty), mask=mask)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) in x's dtype, batch-invariant (module doc).
    `out`: where given, the product lands there (utils.checked_out)."""
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"invariant_linear: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    shape = (*x.shape[:-1], n)
    result = checked_out(out, shape, x)
    into = result.view(-1, n)
    m = rows.shape[0]
    if m == 0:
        return result
    capability, sms = tensor_gpu(x)
    t = invariant_tiles(x.dtype, m, n, capability)
    splits = k_splits(n, k, t.block_k, sms)
    span = triton.cdiv(triton.cdiv(k, splits), t.block_k) * t.block_k
    ranges = Ranges(triton.cdiv(k, span), span)  # only ranges that hold some of K
    if t.tma and _tma_aligned(rows) and _tma_aligned(w):
        _launch_tma(rows, w, bias, into, t, ranges)
    else:
        _launch(rows, w, bias, into, t, ranges)
    return result


def _tma_aligned(t: torch.Tensor) -> bool:
    """Whether TMA can read 2-D `t`: its start and row stride whole multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def _launch_tma(rows: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                into: torch.Tensor, t: InvariantTiles, ranges: Ranges) -> None:
    """into = rows w^T (+ bias) by `_invariant_mm_tma_kernel`, one program a tile."""
    (m, k), n = rows.shape, w.shape[0]
    x_desc = TensorDescriptor.from_tensor(rows, [t.block_m, t.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [t.block_n, t.block_k])
    grid = (triton.cdiv(n, t.block_n) * triton.cdiv(m, t.block_m),)
    _invariant_mm_tma_kernel[grid](
        x_desc, w_desc, w if bias is None else bias, into, m, n, k, ranges.splits, ranges.span,
        into.stride(0), HAS_BIAS=bias is not None, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, SWIZZLE=8, num_warps=t.num_warps, num_stages=t.num_stages)


def _launch(rows: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
            into: torch.Tensor, t: InvariantTiles, ranges: Ranges) -> None:
    """into = rows w^T (+ bias) by `_invariant_mm_kernel`: under LARGE_TILE_ROWS rows with K
    in more than one range, a program a (tile, range) into float32 partials that
    `_sum_ranges` adds; else a program a tile."""
    (m, k), n = rows.shape, w.shape[0]
    splits, span = ranges
    parallel = splits > 1 and m < LARGE_TILE_ROWS
    grid = (triton.cdiv(n, t.block_n) * triton.cdiv(m, t.block_m), splits if parallel else 1)
    part = (torch.empty((splits, m, n), dtype=torch.float32, device=rows.device) if parallel
            else into)
    b = w if bias is None else bias
    _invariant_mm_kernel[grid](
        rows, w, b, into, part, m, n, k, splits, span, rows.stride(0), w.stride(0),
        into.stride(0), HAS_BIAS=bias is not None, PARALLEL=parallel, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=k % t.block_k == 0, SWIZZLE=8,
        F32_DOT=f32_dot(rows), num_warps=t.num_warps, num_stages=t.num_stages)
    if parallel:
        _sum_ranges[(triton.cdiv(n, 64), triton.cdiv(m, 64))](
            part, b, into, m, n, splits, into.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=64, BLOCK_N=64)
