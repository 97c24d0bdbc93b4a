"""One decode token's attention and the projection after it (o_proj) in one launch.

At batch 1 the split decode attention is latency-bound (a few microseconds for ~1 MB of KV)
and o_proj is a weight stream that depends on all of it. Here one grid holds both: its first
programs, by ticket, run `attention._split_attention` and publish each KV head's merged output;
the rest are the GEMV's programs, which load their first weight tile at once, so that o_proj's
weights stream while the attention computes, then wait for every KV head's output and finish
the product.

Tickets, not program ids, give the roles: a program draws one from a counter as it starts, the
first `kv_heads * splits` tickets are the attention's. A GEMV program that waits has therefore
been preceded by every attention program (each drew its ticket, so each is running), and the
attention programs wait on nothing but the PDL wait: the wait always ends, whatever order the
hardware starts programs in and however few fit at once. The last program to finish zeroes the
counters for the next launch (kernels are ordered on a stream; under PDL a launch starts only
once the kernel before it has passed its own wait, so the previous launch of this kernel has
finished).

This module imports triton: only the Triton attention backend (a GPU path) and tests import it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from minisgl.kernels.attention import (_LOG2E, _block_d, _f16, _f32_dot, _split_attention,
                                       decode_tiles)
from minisgl.kernels.gemv import (GemvTiles, _check_gemv, _fp8, _gemv_store, _gemv_tile,
                                  _row_params, gemv_tiles)
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.types import DecodeTiles

# counters[0]: tickets drawn; [1]: KV heads whose output is published; [2]: programs finished.
COUNTERS = 3
_WARPS = 4  # one launch, one warp count: the GEMV's (the split attention's 2 measured alike)


class FusedTiles(NamedTuple):
    attention: DecodeTiles
    gemv: GemvTiles


def fused_tiles(q: torch.Tensor, k_cache: torch.Tensor, weight: torch.Tensor,
                num_splits: int) -> FusedTiles:
    """The tiles of `decode_attention_gemv`'s two roles: the decode and GEMV defaults at
    the launch's warp count."""
    a = decode_tiles(q.dtype, q.shape[2], num_splits, q.shape[0], _f16(None, q, k_cache))
    g = gemv_tiles(weight.shape[1], _fp8(weight))
    return FusedTiles(a._replace(num_warps=_WARPS), g._replace(num_warps=_WARPS,
                                                                 num_stages=a.num_stages))


@triton.jit
def _wait_count(count_ptr, target):
    """Spin until *count_ptr >= target, then read what its publishers wrote (acquire)."""
    seen = tl.load(count_ptr, volatile=True)
    while seen < target:
        seen = tl.load(count_ptr, volatile=True)
    tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _attention_gemv_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, rows_ptr, seq_lens_ptr, o_part_ptr, lse_part_ptr,
        arrivals_ptr, attn_ptr, w_ptr, s_ptr, y_ptr, counters_ptr, scale_log2, v_scale,
        num_splits, min_split, num_kv_heads, n, k, stride_wn,
        stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
        stride_oh, stride_os, stride_lh,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        F32_DOT: tl.constexpr, DIRECT: tl.constexpr, F16_TILES: tl.constexpr,
        HAS_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Ticket t < kv_heads * splits: attention split (t // kv_heads) of KV head t % kv_heads,
    writing attn [heads * d]; a KV head's publisher then counts it. Ticket t after them: rows
    [r ROWS, (r + 1) ROWS) of y = attn W^T (scaled per row for FP8 weights), r = t - that."""
    ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
    num_attn = num_kv_heads * num_splits
    # The GEMV's first weight tile (none for the attention's programs: negative rows) and the
    # attention's row and length: parameters and step inputs, read before the wait (pdl.py).
    rows = (ticket - num_attn) * ROWS + tl.arange(0, ROWS)
    rows = tl.where(rows >= 0, rows, n)
    cols = tl.arange(0, BLOCK_K)
    w = _gemv_tile(w_ptr, rows, cols, n, k, stride_wn)
    scale, bias = _row_params(s_ptr, s_ptr, rows, n, HAS_SCALE, False)
    row = tl.load(rows_ptr).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr)
    pdl_enter(PDL)
    if ticket < num_attn:
        published = _split_attention(
            q_ptr, k_ptr, v_ptr, page_table_ptr, o_part_ptr, lse_part_ptr, arrivals_ptr,
            attn_ptr, scale_log2, v_scale, num_splits, min_split, ticket % num_kv_heads,
            ticket // num_kv_heads, 0, row, seq_len, num_kv_heads, 0, stride_qh, stride_ks,
            stride_kh, stride_vs, stride_vh, stride_pt, 0, stride_oh, stride_os, 0, stride_lh,
            0, HEAD_DIM, GROUP, BLOCK_H, BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_S, F32_DOT, DIRECT,
            F16_TILES)
        if published:
            tl.debug_barrier()  # every thread's output stored before the count (release)
            tl.atomic_add(counters_ptr + 1, 1, sem="release", scope="gpu")
    else:
        _wait_count(counters_ptr + 1, num_kv_heads)
        # attn was written by other multiprocessors in this launch: read it at L2 (.cg).
        x = tl.load(attn_ptr + cols, mask=cols < k, other=0.0, cache_modifier=".cg")
        acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        for k0 in range(BLOCK_K, k, BLOCK_K):
            kc = k0 + cols
            w = _gemv_tile(w_ptr, rows, kc, n, k, stride_wn)
            x = tl.load(attn_ptr + kc, mask=kc < k, other=0.0, cache_modifier=".cg")
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        _gemv_store(acc, rows, n, scale, bias, y_ptr, HAS_SCALE, False)
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)
        tl.store(counters_ptr + 2, 0)


def decode_attention_gemv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          page_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                          o_part: torch.Tensor, lse_part: torch.Tensor,
                          arrivals: Optional[torch.Tensor], counters: torch.Tensor,
                          weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
                          scale: float, min_split_tokens: int = 0, pdl: bool = False,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`gemv(decode_attention(q, ...).reshape(1, -1), weight, weight_scale=weight_scale)` for
    one request (q [1, heads, d]) in one launch; the arguments are decode_attention's and
    gemv's (no bias), plus `counters`, int32 [COUNTERS] of zeros, which every launch leaves
    zero. The attention runs decode_tiles' tile and the product gemv_tiles', both at 4 warps:
    equal bit for bit to the two kernels at those tiles (`fused_tiles`). Returns y [1, N] in
    q's dtype."""
    batch, num_heads, head_dim = q.shape
    n, k = weight.shape
    if batch != 1 or k != num_heads * head_dim or q.stride(2) != 1:
        raise ValueError(f"decode_attention_gemv takes one request's q [1, heads, d] (last dim "
                         f"dense) and a weight of heads * d columns, got q {tuple(q.shape)} "
                         f"strides {q.stride()}, weight {tuple(weight.shape)}")
    if (counters.dtype != torch.int32 or counters.shape != (COUNTERS,)
            or not counters.is_contiguous()):
        raise ValueError(f"decode_attention_gemv needs `counters`, a contiguous int32 "
                         f"[{COUNTERS}] of zeros; got {counters.dtype} {tuple(counters.shape)}")
    attn = torch.empty(k, dtype=q.dtype, device=q.device)
    _check_gemv(attn, weight, weight_scale)
    num_kv_heads = k_cache.shape[1]
    num_splits = o_part.shape[2]
    direct = num_splits == 1
    if not direct and (arrivals is None or arrivals.dtype != torch.int32
                       or arrivals.shape != (1, num_kv_heads) or not arrivals.is_contiguous()):
        raise ValueError(f"decode_attention_gemv over {num_splits} splits needs `arrivals`, a "
                         f"contiguous int32 [1, {num_kv_heads}] of zeros")
    tiles, gemv = fused_tiles(q, k_cache, weight, num_splits)
    min_split = triton.cdiv(max(min_split_tokens, 1), tiles.block_n) * tiles.block_n
    y = torch.empty((1, n), dtype=q.dtype, device=q.device)
    programs = num_kv_heads * num_splits + triton.cdiv(n, gemv.rows)
    _attention_gemv_kernel[(programs,)](
        q, k_cache, v_cache, page_table, rows, seq_lens, o_part, lse_part,
        o_part if arrivals is None else arrivals, attn, weight,
        weight if weight_scale is None else weight_scale, y, counters,
        scale * k_scale * _LOG2E, v_scale, num_splits, min_split, num_kv_heads, n, k,
        weight.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0), o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_H=max(16, triton.next_power_of_2(
            num_heads // num_kv_heads)), BLOCK_N=tiles.block_n, HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim), BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        F32_DOT=_f32_dot(q), DIRECT=direct, F16_TILES=_f16(None, q, k_cache),
        HAS_SCALE=weight_scale is not None, ROWS=gemv.rows, BLOCK_K=gemv.block_k, PDL=pdl,
        num_warps=_WARPS, num_stages=tiles.num_stages, **launch_options(pdl))
    return y
