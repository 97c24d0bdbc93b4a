"""Triton kernels for the GPU decode path: fused RMSNorm (with the residual add), SiLU-and-mul and
rotary embedding (q and k together), each one launch instead of the 5 to 15 small kernels of the
torch version; and a one-token projection (GEMV) for programmatic dependent launch.

At batch 1 a decode step is some 400 small kernels, each costing a few microseconds even inside
a CUDA graph; fusing these three halved the count. They compute in float32 and round once, so
results can differ from the torch path in the last bit of bfloat16; the CPU path (exact against
the reference in float32) never calls them. This module imports triton; layers import it only
for CUDA tensors.

With `pdl` (minisgl/pdl.py) each kernel waits for its predecessor first thing and then lets its
successor launch; the GEMV loads its first weight tile before waiting, so weight streaming
overlaps the previous kernel.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.pdl import launch_options, pdl_enter
from minisgl.triton_rmsnorm import rmsnorm_row_store, rmsnorm_warps


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res,
                    eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    rmsnorm_row_store(x, w_ptr, out_ptr + row * n_cols, cols, mask, n_cols, eps)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with dense rows (a copy only where no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None, pdl: bool = False
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm over the last dimension of x; with `residual`, normalizes x + residual and also
    returns that sum (the new residual). Outputs are contiguous. Rows may be strided: the
    per-head q/k norms see views of the fused QKV output, and with one head per rank
    `reshape` keeps such a view (row stride = the QKV width) instead of copying it."""
    shape = x.shape
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    res = _rows(residual) if residual is not None else x2
    block = triton.next_power_of_2(shape[-1])
    _rmsnorm_kernel[(x2.shape[0],)](x2, res, weight, out, res_out, shape[-1], x2.stride(0),
                                    res.stride(0), eps, HAS_RES=residual is not None,
                                    BLOCK=block, PDL=pdl, num_warps=rmsnorm_warps(block),
                                    **launch_options(pdl))
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x = [gate | up] (contiguous) -> silu(gate) * up."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, BLOCK=block, PDL=pdl,
                                                            **launch_options(pdl))
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rotate_heads(base, cos, sin, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate `n_heads` dense [head_dim] vectors starting at `base`, in place."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    hmask = heads[:, None] < n_heads
    ptrs = base + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(ptrs, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=hmask, other=0.0).to(tl.float32)
    ty = base.dtype.element_ty
    tl.store(ptrs, (x1 * cos - x2 * sin).to(ty), mask=hmask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(ty), mask=hmask)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_q, stride_k, n_q, n_k,
                      HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * (2 * HALF) + dims)[None, :]
    sin = tl.load(sin_ptr + pos * (2 * HALF) + dims)[None, :]
    _rotate_heads(q_ptr + tok * stride_q, cos, sin, n_q, HALF, BLOCK_Q)
    _rotate_heads(k_ptr + tok * stride_k, cos, sin, n_k, HALF, BLOCK_K)


def _check_rotary_layout(x: torch.Tensor) -> None:
    _, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim & (dim - 1):
        raise ValueError("rotary needs x[t] to be a dense [heads, head_dim] block, head_dim a "
                         "power of two")


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, pdl: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place, in one
    launch (rotate-half layout); cos/sin are float32 [max_positions, head_dim] caches. Each
    token's heads must be one dense block (q and k may be views of one fused QKV output)."""
    _check_rotary_layout(q)
    _check_rotary_layout(k)
    tokens, n_q, dim = q.shape
    if tokens:
        _rotary_qk_kernel[(tokens,)](q, k, positions, cos, sin, q.stride(0), k.stride(0), n_q,
                                     k.shape[1], HALF=dim // 2, BLOCK_Q=triton.next_power_of_2(n_q),
                                     BLOCK_K=triton.next_power_of_2(k.shape[1]), PDL=pdl,
                                     **launch_options(pdl))
    return q, k



# --- one-token projections ------------------------------------------------------------------------
# A batch-1 decode step multiplies one row by every weight matrix: pure weight streaming. In a
# sweep of 11 tiles (scripts/bench_kernels.py, H200, 2026-11-30) stripes of 4 output rows read
# 2,048 or 4,096 columns at a time were the fastest, and beat cuBLAS alone on every Llama-3.1-8B
# projection; inside the model, without PDL, they only tied it (benchmarks/RESULTS.md). With PDL
# the first weight tile is in flight before the previous kernel has finished.
_GEMV_ROWS = 4


class GemvTiles(NamedTuple):
    block_k: int
    num_warps: int
    num_stages: int


def gemv_tiles(k: int) -> GemvTiles:
    """All of K in one 4096-wide load when it divides; otherwise 2048-wide, double-buffered."""
    if k % 4096 == 0:
        return GemvTiles(4096, 8, 1)
    return GemvTiles(min(2048, triton.next_power_of_2(k)), 4, 2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, k, stride_wn, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < n
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    cols = tl.arange(0, BLOCK_K)
    # The weights are never written during a forward pass: their first tile may be read before
    # the wait; x (the previous kernel's output) only after it.
    w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols < k)[None, :], other=0.0)
    pdl_enter(PDL)
    x = tl.load(x_ptr + cols, mask=cols < k, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    for k0 in range(BLOCK_K, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask_k = cols < k
        w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=mask_k, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         pdl: bool = False) -> torch.Tensor:
    """x W^T + b for a single row x [..., K] (one token); weight [N, K] with dense rows. Sums in
    float32 and rounds once (the last bit can differ from cuBLAS)."""
    n, k = weight.shape
    if x.numel() != k or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row of {k} features and a row-major weight, got x "
                         f"{tuple(x.shape)}, weight strides {weight.stride()}")
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    tiles = gemv_tiles(k)
    _gemv_kernel[(triton.cdiv(n, _GEMV_ROWS),)](
        x.contiguous(), weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=_GEMV_ROWS, BLOCK_K=tiles.block_k, PDL=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(pdl))
    return out
