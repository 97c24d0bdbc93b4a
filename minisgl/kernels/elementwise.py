"""Triton kernels for the GPU decode path: fused RMSNorm (with the residual add), SiLU-and-mul and
rotary embedding (q and k together), each one launch instead of the 5 to 15 small kernels of the
torch version, and the sampler's argmax. The one-token projections are in triton_gemv.py.

At batch 1 a decode step is some 400 small kernels, each costing a few microseconds even inside
a CUDA graph; fusing these three halved the count. They compute in float32 and round once, so
results can differ from the torch path in the last bit of bfloat16; the CPU path (exact against
the reference in float32) never calls them. This module imports triton; layers import it only
for CUDA tensors.

With `pdl` (minisgl/pdl.py) each kernel waits for its predecessor first thing and then lets its
successor launch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.attention.base import KVTarget
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.rmsnorm import rmsnorm_row_store, rmsnorm_warps


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
def silu_mul_f32(gate, up):
    """silu(gate) * up in float32: the one copy of the formula, shared by the SiLU kernel and
    the gate/up GEMV's epilogue (layers/triton_gemv.py), so both round alike."""
    gate = gate.to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
    out = silu_mul_f32(gate, up)
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
def _rotate_heads(src, dst, cos, sin, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate `n_heads` dense [head_dim] vectors starting at `src` into `dst` (may be `src`)."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    hmask = heads[:, None] < n_heads
    offs = heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(src + offs, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs + HALF, mask=hmask, other=0.0).to(tl.float32)
    ty = dst.dtype.element_ty
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(ty), mask=hmask)
    tl.store(dst + offs + HALF, (x2 * cos + x1 * sin).to(ty), mask=hmask)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr,
                      v_cache_ptr, stride_q, stride_k, stride_v, stride_cs, n_q, n_k,
                      HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                      STORE: tl.constexpr, PDL: tl.constexpr):
    """Program t: rotate token t's q heads in place; its k heads in place, or (STORE) into
    k_cache[slots[t]] with v[t] copied to v_cache[slots[t]] (caches [slots, n_k, 2 * HALF])."""
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * (2 * HALF) + dims)[None, :]
    sin = tl.load(sin_ptr + pos * (2 * HALF) + dims)[None, :]
    q = q_ptr + tok * stride_q
    _rotate_heads(q, q, cos, sin, n_q, HALF, BLOCK_Q)
    k = k_ptr + tok * stride_k
    if STORE:
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        _rotate_heads(k, k_cache_ptr + slot * stride_cs, cos, sin, n_k, HALF, BLOCK_K)
        offs = tl.arange(0, BLOCK_K * 2 * HALF)
        mask = offs < n_k * 2 * HALF
        v = tl.load(v_ptr + tok * stride_v + offs, mask=mask)
        tl.store(v_cache_ptr + slot * stride_cs + offs, v, mask=mask)
    else:
        _rotate_heads(k, k, cos, sin, n_k, HALF, BLOCK_K)


def _check_rotary_layout(x: torch.Tensor) -> None:
    _, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim & (dim - 1):
        raise ValueError("rotary needs x[t] to be a dense [heads, head_dim] block, head_dim a "
                         "power of two")


class KVStore(NamedTuple):
    """What `rotary_qk_` writes instead of rotating k in place: the rotated k and a copy of v,
    to the target's caches at its slots."""

    v: torch.Tensor  # [tokens, kv_heads, head_dim], each token's heads one dense block
    target: KVTarget


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, pdl: bool = False, store: Optional[KVStore] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place, in one
    launch (rotate-half layout); cos/sin are float32 [max_positions, head_dim] caches. Each
    token's heads must be one dense block (q and k may be views of one fused QKV output).
    `store`: k is left as it is and its rotation goes to the KV cache with v (the K/V store of
    attention, fused in)."""
    _check_rotary_layout(q)
    _check_rotary_layout(k)
    tokens, n_q, dim = q.shape
    if store is not None:
        _check_rotary_layout(store.v)
        cache_strides = store.target.k_cache.stride()
        if cache_strides[1:] != (dim, 1) or store.target.v_cache.stride() != cache_strides:
            raise ValueError("rotary K/V store needs contiguous [slots, kv_heads, head_dim] caches")
    if tokens:
        # Without a store the kernel never touches these four (STORE=False): any tensors do.
        v, (k_cache, v_cache, slots) = store if store is not None else (k, (k, k, positions))
        _rotary_qk_kernel[(tokens,)](
            q, k, v, positions, cos, sin, slots, k_cache, v_cache, q.stride(0), k.stride(0),
            v.stride(0), k_cache.stride(0), n_q, k.shape[1], HALF=dim // 2,
            BLOCK_Q=triton.next_power_of_2(n_q), BLOCK_K=triton.next_power_of_2(k.shape[1]),
            STORE=store is not None, PDL=pdl, **launch_options(pdl))
    return q, k



@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, n, stride_x, num_chunks,
                         BLOCK: tl.constexpr):
    """Program (row, chunk): the largest value of x[row, chunk*BLOCK:(chunk+1)*BLOCK] and its
    first index."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n, other=float("-inf"))
    val, idx = tl.max(x.to(tl.float32), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, val)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + idx)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """Program row: the chunk with the largest value, the earliest on ties (chunks are in index
    order, so this is the first index of the row's maximum, as torch.argmax returns)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    vals = tl.load(val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    _, best = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + best).to(tl.int64))


_ARGMAX_BLOCK = 4096


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [B, N] (rows with unit column stride), int64 [B]: the first
    index of each row's maximum. Two launches: chunks of 4,096 columns in parallel, then a merge;
    torch's one-block-per-row reduction took 36 us on a 128,256-wide row of an H200. Rows holding
    NaN are unspecified (the sampler's logits are finite)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows takes [rows, columns] with unit column stride, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    rows, n = x.shape
    chunks = triton.cdiv(n, _ARGMAX_BLOCK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](x, vals, idx, n, x.stride(0), chunks,
                                         BLOCK=_ARGMAX_BLOCK, num_warps=8)
    _argmax_merge_kernel[(rows,)](vals, idx, out, chunks,
                                  BLOCK_C=max(2, triton.next_power_of_2(chunks)))
    return out
