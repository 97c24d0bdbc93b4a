"""Rotary embedding in Triton (rotate-half layout): q and k of every token in one launch, in place,
optionally with the K/V store of attention fused in (the rotated k and a copy of v written to the
KV cache instead of k rotated in place). This module imports triton: only GPU paths (and the CPU
interpreter tests) import it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8 import quantize_kv
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.rmsnorm import rms_apply, rms_inv
from minisgl.kernels.types import HeadNorms, KVStore, KVTarget, ProductScales


@triton.jit
def _unscale(x, rs, cs_ptr, offs, mask, SCALED: tl.constexpr):
    """SCALED: x (an unscaled FP8 product's columns `offs`) times rs and cs[offs] in float32,
    rounded to x's dtype, as fp8.rescale rounds them; else x."""
    if SCALED:
        x = (x.to(tl.float32) * rs * tl.load(cs_ptr + offs, mask=mask, other=0.0)).to(x.dtype)
    return x


@triton.jit
def _head_norm(x1, x2, w_ptr, dims, eps, HALF: tl.constexpr):
    """Each head's RMSNorm (rows of x1 | x2, one [2 * HALF] vector split in halves) with the
    weight at w_ptr [2 * HALF], rounded as the RMSNorm layer rounds (rmsnorm.rms_apply)."""
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    inv = rms_inv(tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1), 2 * HALF, eps)[:, None]
    return (rms_apply(x1f, inv, tl.load(w_ptr + dims)[None, :], x1.dtype),
            rms_apply(x2f, inv, tl.load(w_ptr + HALF + dims)[None, :], x2.dtype))


@triton.jit
def _rotate_heads(src, dst, cos, sin, n_heads, scale, rs, cs_ptr, w_ptr, eps, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, QUANT: tl.constexpr, SCALED: tl.constexpr,
                  NORM: tl.constexpr):
    """Rotate `n_heads` dense [head_dim] vectors starting at `src` into `dst` (may be `src`),
    rounded to src's dtype; QUANT (an FP8 cache): then divided by `scale` and quantized.
    SCALED: src holds an unscaled product, whose scales (rs, cs_ptr[heads' columns]) are
    applied first (`_unscale`). NORM: each head is RMS-normed with the weight at w_ptr (after
    the scales, before the rotation)."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    hmask = heads[:, None] < n_heads
    offs = heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = _unscale(tl.load(src + offs, mask=hmask, other=0.0), rs, cs_ptr, offs, hmask, SCALED)
    x2 = _unscale(tl.load(src + offs + HALF, mask=hmask, other=0.0), rs, cs_ptr, offs + HALF,
                  hmask, SCALED)
    if NORM:
        x1, x2 = _head_norm(x1, x2, w_ptr, dims, eps, HALF)
    r1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
    r2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
    if QUANT:
        r1 = quantize_kv(r1, scale)
        r2 = quantize_kv(r2, scale)
    ty = dst.dtype.element_ty
    tl.store(dst + offs, r1.to(ty), mask=hmask)
    tl.store(dst + offs + HALF, r2.to(ty), mask=hmask)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr,
                      v_cache_ptr, rs_ptr, cs_ptr, qw_ptr, kw_ptr, stride_q, stride_k, stride_v,
                      stride_cs, n_q, n_k, k_scale, v_scale, eps, HALF: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, STORE: tl.constexpr,
                      QUANT: tl.constexpr, SCALED: tl.constexpr, NORM: tl.constexpr,
                      PDL: tl.constexpr):
    """Program t: rotate token t's q heads in place; its k heads in place, or (STORE) into
    k_cache[slots[t]] with v[t] copied to v_cache[slots[t]] (caches [slots, n_k, 2 * HALF]);
    QUANT (FP8 caches): k / k_scale and v / v_scale, quantized as store_kv does. SCALED (with
    STORE): q, k, v are the columns of an unscaled FP8 QKV product [q | k | v], scaled by
    rs[t] and cs[column] first; q is left scaled and rotated, k and v as they were. NORM: q's
    heads are RMS-normed with qw, k's with kw, before the rotation (q is left normed)."""
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * (2 * HALF) + dims)[None, :]
    sin = tl.load(sin_ptr + pos * (2 * HALF) + dims)[None, :]
    rs = tl.load(rs_ptr + tok) if SCALED else 1.0
    q = q_ptr + tok * stride_q
    _rotate_heads(q, q, cos, sin, n_q, 1.0, rs, cs_ptr, qw_ptr, eps, HALF, BLOCK_Q, False, SCALED,
                  NORM)
    k = k_ptr + tok * stride_k
    if STORE:
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        cs_k = cs_ptr + n_q * 2 * HALF
        _rotate_heads(k, k_cache_ptr + slot * stride_cs, cos, sin, n_k, k_scale, rs, cs_k, kw_ptr,
                      eps, HALF, BLOCK_K, QUANT, SCALED, NORM)
        offs = tl.arange(0, BLOCK_K * 2 * HALF)
        mask = offs < n_k * 2 * HALF
        v = _unscale(tl.load(v_ptr + tok * stride_v + offs, mask=mask), rs,
                     cs_k + n_k * 2 * HALF, offs, mask, SCALED)
        if QUANT:
            v = quantize_kv(v, v_scale).to(v_cache_ptr.dtype.element_ty)
        tl.store(v_cache_ptr + slot * stride_cs + offs, v, mask=mask)
    else:
        _rotate_heads(k, k, cos, sin, n_k, 1.0, rs, cs_ptr, kw_ptr, eps, HALF, BLOCK_K, False,
                      False, NORM)


def _check_rotary_layout(x: torch.Tensor) -> None:
    _, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim & (dim - 1):
        raise ValueError("rotary needs x[t] to be a dense [heads, head_dim] block, head_dim a "
                         "power of two")


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, pdl: bool = False, store: Optional[KVStore] = None,
               scales: Optional[ProductScales] = None, norms: Optional[HeadNorms] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place, in one
    launch (rotate-half layout); cos/sin are float32 [max_positions, head_dim] caches. Each
    token's heads must be one dense block (q and k may be views of one fused QKV output).
    `store`: k is left as it is and its rotation goes to the KV cache with v (the K/V store of
    attention, fused in; quantized as store_kv does for an FP8 cache). `scales` (with a
    store): q, k and v are views of one unscaled FP8 product [q | k | v]
    (fp8.unscaled_mm), scaled first as fp8.rescale would; q ends scaled and rotated.
    `norms`: each q and k head is RMS-normed first (after the scales), as q_norm / k_norm
    would; q ends normed and rotated."""
    _check_rotary_layout(q)
    _check_rotary_layout(k)
    tokens, n_q, dim = q.shape
    if scales is not None:
        width = (n_q + 2 * k.shape[1]) * dim
        if store is None or scales.col.numel() != width or scales.row.numel() != tokens:
            raise ValueError(f"rotary of an unscaled QKV product takes a K/V store, {tokens} "
                             f"row scales and {width} column scales; got "
                             f"{scales.row.numel()} and {scales.col.numel()}")
    if norms is not None and (norms.q_weight.shape != (dim,) or norms.k_weight.shape != (dim,)):
        raise ValueError(f"rotary's head norms take [{dim}] weights; got "
                         f"{tuple(norms.q_weight.shape)} and {tuple(norms.k_weight.shape)}")
    if store is not None:
        _check_rotary_layout(store.v)
        cache_strides = store.target.k_cache.stride()
        if cache_strides[1:] != (dim, 1) or store.target.v_cache.stride() != cache_strides:
            raise ValueError("rotary K/V store needs contiguous [slots, kv_heads, head_dim] caches")
    if tokens:
        # Without a store, scales or norms the kernel never touches the tensors standing in
        # for them (STORE, SCALED, NORM False): any tensors do.
        v, target = store if store is not None else (k, KVTarget(k, k, positions))
        rs, cs = scales if scales is not None else (cos, cos)
        qw, kw, eps = norms if norms is not None else (cos, cos, 0.0)
        _rotary_qk_kernel[(tokens,)](
            q, k, v, positions, cos, sin, target.slots, target.k_cache, target.v_cache, rs, cs,
            qw, kw, q.stride(0), k.stride(0), v.stride(0), target.k_cache.stride(0), n_q,
            k.shape[1], target.k_scale, target.v_scale, eps, HALF=dim // 2,
            BLOCK_Q=triton.next_power_of_2(n_q), BLOCK_K=triton.next_power_of_2(k.shape[1]),
            STORE=store is not None, QUANT=store is not None and target.quantized,
            SCALED=scales is not None, NORM=norms is not None, PDL=pdl, **launch_options(pdl))
    return q, k
