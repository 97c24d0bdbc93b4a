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
elsewhere one tile serves every row count. Decode steps still run in CUDA graphs (the
partials' buffer is allocated per call, which a capture records once).

This module imports triton: only GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.dot import dot, f32_dot
from minisgl.utils import checked_out


class InvariantTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# From this many rows (a prefill chunk) sm_90 takes the large output tile.
LARGE_TILE_ROWS = 256


def invariant_tiles(dtype: torch.dtype, rows: int, capability: Tuple[int, int]) -> InvariantTiles:
    """The tiling of `rows` rows of a dtype on a GPU of `capability`: BLOCK_K (and so each
    element's order of sums) is the dtype's alone. Half types: 64-deep steps of K on the
    tensor cores, 64 x 64 output tiles, and on sm_90 128 x 128 with 8 warps from
    LARGE_TILE_ROWS rows (module doc); float32 (IEEE dots on the FMA units): one small tile
    that compiles without spills."""
    if dtype == torch.float32:
        return InvariantTiles(32, 32, 32, 4, 2)
    if rows >= LARGE_TILE_ROWS and capability[0] == 9:
        return InvariantTiles(128, 128, 64, 8, 3)
    return InvariantTiles(64, 64, 64, 4, 3)


def k_splits(n: int, k: int, block_k: int, sms: int) -> int:
    """How many ranges K is summed in for a weight of `n` outputs and `k` inputs: a property
    of the weight and the GPU, never of the row count (each element's sum is the ranges'
    sums added in order, however they are computed). Enough that a few rows' 64-wide column
    blocks make about two programs a multiprocessor, each range at least 8 steps of K, at
    most 8 ranges."""
    want = triton.cdiv(2 * sms, triton.cdiv(n, 64))
    return max(1, min(want, k // (block_k * 8), 8))


@triton.jit
def _range_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k_lo, k_hi, stride_xm,
               stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               F32_DOT: tl.constexpr):
    """x[rows, k_lo:k_hi] W[cols, k_lo:k_hi]^T in float32, from zero, in steps of BLOCK_K in
    increasing order."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < k_hi
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += dot(a, w, F32_DOT)
    return acc


@triton.jit(do_not_specialize=["m"])
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, m, n, k, splits, span,
                         stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                         PARALLEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (column block, row block, range): PARALLEL, range r's sum of out[rows, cols]
    into the float32 partials [splits, m, n] (`_sum_ranges` finishes); else every range in
    turn, each from zero, added in order (the same bits), plus b[cols], rounded once."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    mask_n = offs_n < n
    tile = offs_m[:, None].to(tl.int64) * n + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if PARALLEL:
        r = tl.program_id(2)
        acc = _range_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, r * span,
                         tl.minimum(r * span + span, k), stride_xm, stride_wn, BLOCK_M,
                         BLOCK_N, BLOCK_K, F32_DOT)
        tl.store(part_ptr + r.to(tl.int64) * m * n + tile, acc, mask=mask)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r in range(0, splits):
            total += _range_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, r * span,
                                tl.minimum(r * span + span, k), stride_xm, stride_wn,
                                BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT)
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 total.to(out_ptr.dtype.element_ty), mask=mask)


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


@functools.lru_cache(maxsize=None)
def _gpu(index: Optional[int]) -> Tuple[Tuple[int, int], int]:
    """(compute capability, multiprocessors) of CUDA device `index`; ((0, 0), 8) for None
    (a CPU tensor: the interpreter). Read once a device: every projection of a step asks."""
    if index is None:
        return (0, 0), 8
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


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
    capability, sms = _gpu(x.device.index if x.is_cuda else None)
    t = invariant_tiles(x.dtype, m, capability)
    splits = k_splits(n, k, t.block_k, sms)
    span = triton.cdiv(triton.cdiv(k, splits), t.block_k) * t.block_k
    splits = triton.cdiv(k, span)  # ranges that hold some of K
    parallel = splits > 1 and m < LARGE_TILE_ROWS
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m), splits if parallel else 1)
    part = (torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if parallel
            else into)
    b = w if bias is None else bias
    _invariant_mm_kernel[grid](
        rows, w, b, into, part, m, n, k, splits, span, rows.stride(0), w.stride(0),
        into.stride(0), HAS_BIAS=bias is not None, PARALLEL=parallel, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, F32_DOT=f32_dot(x), num_warps=t.num_warps,
        num_stages=t.num_stages)
    if parallel:
        _sum_ranges[(triton.cdiv(n, 64), triton.cdiv(m, 64))](
            part, b, into, m, n, splits, into.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=64, BLOCK_N=64)
    return result
