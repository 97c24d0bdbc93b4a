"""Triton kernels for attention over the paged KV pool, and their launchers.

Every kernel reads K/V token by token through the page table (`page_table[row, pos]` is the slot
of token `pos`), so any page size works and no gather copy is made. Softmax runs in float32 in
base 2 (the scale is pre-multiplied by log2(e)); outputs are cast back to the query's dtype.

- Decode (one new token per request), flash-decoding: `_decode_split_kernel` runs one program per
  (KV head, KV split, request) over all query heads that share the KV head (GQA: K/V are read once
  per group) and writes a normalised partial output plus its log-sum-exp; the last program of
  a request's KV head to finish merges its splits, in the same launch. With a single split
  (large batches) each program writes its output itself. The split length is derived from each
  request's own length inside the kernel, so the grid depends only on (batch size,
  num_splits), never on the lengths.
- Extend (prefill chunks after a cached prefix): `_extend_kernel` runs one program per (request,
  query head, block of new tokens) and attends causally over the prefix and the new tokens, all
  read from the pool (the new K/V must be stored first).

The K/V store (`store_kv`) writes the new tokens' K/V into their slots first, in one launch.

A sliding-window layer's launches pass its `window` (WINDOW, a compile-time constant: with 0,
full attention, the loops are the unwindowed kernels'): decode splits cover each request's last
`window` tokens; extend blocks start at their first query's window and mask the tiles that lie
before a later query's.

An FP8 (float8_e4m3fn) pool holds K / k_scale and V / v_scale (per layer, per tensor; see
kvcache/pool.py): `store_kv` divides, clamps to +-448 and rounds; the attention kernels convert
each loaded tile to the query's dtype (exact) and fold the scales in where they cost nothing:
k_scale into the softmax scale, v_scale into the normalised output (attention is linear in V).
Other pools pass scales of 1.0, which leave every result bit-identical to unscaled kernels. This
module imports triton: only the Triton attention backend (a GPU path) and tests import it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minisgl.kernels.dot import dot as _dot, f32_dot as _f32_dot
from minisgl.kernels.fp8 import quantize_kv
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.types import DecodeTiles, ExtendTiles

_LOG2E = 1.4426950408889634
_MAX_GRID_Z = 65535  # CUDA's limit on a grid's y and z axes
# A finite "minus infinity": masked scores use it so that no row ever computes inf - inf (NaN);
# any garbage it lets into a row is erased (alpha = 0) by the first real score.
_NEG = tl.constexpr(-1.0e30)
_LOG2E_C = tl.constexpr(_LOG2E)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _online_softmax_step(qk, v, acc, m_i, l_i, F32_DOT: tl.constexpr):
    """Fold one block of base-2 scores `qk` [M, N] and values `v` [N, D] into the running
    (acc, row max, row sum) of flash attention."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
    return acc, m_new, l_i


@triton.jit
def _scores(qk, scale_log2, SOFTCAP: tl.constexpr):
    """Base-2 scores of raw dot products; with SOFTCAP > 0 (Gemma's softcapping) the natural
    scores s are capped to SOFTCAP * tanh(s / SOFTCAP) first (tanh(x) = 2 sigmoid(2x) - 1)."""
    if SOFTCAP > 0:
        s = qk * (scale_log2 / _LOG2E_C) / SOFTCAP
        return (2.0 * tl.sigmoid(2.0 * s) - 1.0) * (SOFTCAP * _LOG2E_C)
    return qk * scale_log2


@triton.jit
def _tile_dtype(q, F16_TILES: tl.constexpr):
    """The dtype the K/V tiles are converted to is the query's: with F16_TILES (an FP8 pool
    read by a bfloat16 query), float16, saturated at its +-65504. Every float8_e4m3fn value is
    exact in float16 and the conversion is one instruction for two values on sm_89+, where the
    one to bfloat16 takes several: the FP8 decode kernel was bound by it (RESULTS.md, twelfth
    session, command 8). The scores and P @ V still accumulate in float32."""
    if F16_TILES:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _split_len(seq_len, num_splits, min_split, BLOCK_N: tl.constexpr):
    """Tokens a split of a request of `seq_len` tokens covers (whole tiles, at least
    min_split): the split kernel and the merge share this arithmetic."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split)


@triton.jit
def _merge_head(o_part_ptr, lse_part_ptr, out_ptr, b, h, num_valid, stride_ob, stride_oh,
                stride_os, stride_lb, stride_lh, stride_out_t, stride_out_h,
                BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[b, h] = the first `num_valid` splits' partial outputs weighted by their log-sum-exp.
    Reads at L2 (.cg): the partials were written by other multiprocessors during this launch."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_valid
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(lse_part_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=_NEG, cache_modifier=".cg")
    w = tl.where(mask_s, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    o = tl.load(o_part_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0,
                cache_modifier=".cg")
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_out_t + h * stride_out_h + offs_d,
             merged.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, rows_ptr, seq_lens_ptr, o_part_ptr, lse_part_ptr,
        arrivals_ptr, out_ptr, scale_log2, v_scale, num_splits, min_split,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_t, stride_out_h,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        F32_DOT: tl.constexpr, DIRECT: tl.constexpr, F16_TILES: tl.constexpr,
        PDL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program (kv_head, split, b): partial attention of the GROUP query heads of `kv_head`.
    DIRECT (a single split): the partial result is the answer; write it to `out`. Otherwise
    the partials go to the scratch and the request's last split program to finish (counted in
    `arrivals[b, kv_head]`, which it resets to 0 for the next launch) merges them into `out`:
    no second launch. `scale_log2` includes the K scale; the partial output is multiplied by
    `v_scale`. WINDOW > 0 (a sliding-window layer): the splits cover only the last WINDOW
    tokens.

    Under PDL the rows and lengths are read before the wait (the step's inputs, pdl.py); an L2
    prefetch of the first tile there was measured slower (bf16 batch 1 +3%; RESULTS.md).

    The KV head is the fastest grid axis and the request the slowest, so blocks start request
    by request in batch order: a batch ordered longest first is scheduled longest job first (the
    last wave holds the short requests), and a request's heads, which share each token's DRAM
    rows, are read at the same time."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    # A padded entry (seq_len 0) reads token 0 of its row instead of dividing by zero.
    seq_len = tl.maximum(tl.load(seq_lens_ptr + b), 1)
    lo = seq_len * 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    split_len = _split_len(seq_len - lo, num_splits, min_split, BLOCK_N)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    pt_row = page_table_ptr + row * stride_pt
    pdl_enter(PDL)
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q = _tile_dtype(q, F16_TILES)

    m_i = tl.full([BLOCK_H], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        slots = tl.load(pt_row + pos, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_ptr + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(q.dtype)  # [D, N]
        qk = _dot(q, k, F32_DOT)
        qk = tl.where(mask_n[None, :], _scores(qk, scale_log2, SOFTCAP), _NEG)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)  # [N, D]
        acc, m_i, l_i = _online_softmax_step(qk, v, acc, m_i, l_i, F32_DOT)

    # An empty split (no token) writes finite junk that the merge masks out.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    lse = m_i + tl.log2(l_safe)
    if DIRECT:
        tl.store(out_ptr + b * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    else:
        o_ptrs = (o_part_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
                  + offs_d[None, :])
        tl.store(o_ptrs, o, mask=mask_h[:, None] & mask_d[None, :])
        tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)
        # Every thread's partial is stored before the count is published (release), and the
        # last program's reads follow its count (acquire).
        tl.debug_barrier()
        counter = arrivals_ptr + b * tl.num_programs(0) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)
            num_valid = tl.cdiv(seq_len - lo, split_len)
            for g in range(GROUP):  # not unrolled: one head's partials in registers at a time
                _merge_head(o_part_ptr, lse_part_ptr, out_ptr, b, kvh * GROUP + g, num_valid,
                            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                            stride_out_t, stride_out_h, BLOCK_S, HEAD_DIM, BLOCK_D)


@triton.jit
def _extend_step(q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, n0, hi, q_pos, scale_log2, kvh,
                 stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, F32_DOT: tl.constexpr,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold keys [n0, n0 + BLOCK_N) into the running softmax of one block of queries.
    MASKED: the block holds keys at or past `hi`, after some query (the causal diagonal) or,
    with WINDOW > 0, before some query's window; otherwise every query sees every key and no
    mask is computed."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if MASKED:
        mask_n = offs_n < hi
        slots = tl.load(pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_ptr + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0).to(q.dtype)  # [D, N]
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)  # [N, D]
        qk = _dot(q, k, F32_DOT)
        causal = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            causal = causal & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        qk = tl.where(causal, _scores(qk, scale_log2, SOFTCAP), _NEG)
    else:
        slots = tl.load(pt_row + offs_n).to(tl.int64)
        k = tl.load(k_ptr + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                    mask=mask_d[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=mask_d[None, :], other=0.0).to(q.dtype)
        qk = _scores(_dot(q, k, F32_DOT), scale_log2, SOFTCAP)
    return _online_softmax_step(qk, v, acc, m_i, l_i, F32_DOT)


@triton.jit
def _extend_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, page_table_ptr, rows_ptr, prefix_lens_ptr, extend_lens_ptr,
        q_starts_ptr, scale_log2, v_scale,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
        stride_ot, stride_oh,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
        F16_TILES: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program (b, head, m): new tokens [m_block*BLOCK_M, +BLOCK_M) of request b, causal, where
    m_block counts down from the last block as m counts up. Programs start in grid order, and a
    block's work grows with its position (causal), so the longest start first and the last wave
    is short (as with the decode batch's longest-first order).
    `scale_log2` includes the K scale; the output is multiplied by `v_scale`. WINDOW > 0 (a
    sliding-window layer): keys start at the block's first query's window, and the tiles
    that lie before some later query's window run masked."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    row = tl.load(rows_ptr + b).to(tl.int64)
    prefix = tl.load(prefix_lens_ptr + b)
    ext = tl.load(extend_lens_ptr + b)
    q_start = tl.load(q_starts_ptr + b).to(tl.int64)
    kvh = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q = _tile_dtype(q, F16_TILES)

    # Keys up to the last query of this block; a block past the request's end runs no iteration.
    # Keys before the block's first query are seen by every query: those whole blocks of keys
    # run unmasked, the rest (the causal diagonal and the end) masked.
    hi = tl.minimum(prefix + ext, prefix + m0 + BLOCK_M)
    hi = tl.where(m0 < ext, hi, 0)
    full = tl.minimum((prefix + m0) // BLOCK_N * BLOCK_N, hi // BLOCK_N * BLOCK_N)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pt_row = page_table_ptr + row * stride_pt
    # With a window: keys from the tile of the first query's window on (`tail` starts the
    # diagonal's tiles no earlier); those before `edge`, the first tile inside every query's
    # window, run masked. Without one (compiled out) the loops are the plain two.
    edge = full * 0
    tail = full
    if WINDOW > 0:
        start = tl.maximum(prefix + m0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        edge = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(hi - WINDOW, 0), BLOCK_N) * BLOCK_N,
                                     start), full)
        tail = tl.maximum(full, start)
        for n0 in range(start, edge, BLOCK_N):
            acc, m_i, l_i = _extend_step(q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, n0, hi, q_pos,
                                         scale_log2, kvh, stride_ks, stride_kh, stride_vs,
                                         stride_vh, BLOCK_N, BLOCK_D, HEAD_DIM, F32_DOT, True,
                                         WINDOW, SOFTCAP)
    for n0 in range(edge, full, BLOCK_N):
        acc, m_i, l_i = _extend_step(q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, n0, hi, q_pos,
                                     scale_log2, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
                                     BLOCK_N, BLOCK_D, HEAD_DIM, F32_DOT, False, WINDOW,
                                     SOFTCAP)
    for n0 in range(tail, hi, BLOCK_N):
        acc, m_i, l_i = _extend_step(q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, n0, hi, q_pos,
                                     scale_log2, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
                                     BLOCK_N, BLOCK_D, HEAD_DIM, F32_DOT, True, WINDOW,
                                     SOFTCAP)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _window(window: int) -> int:
    """The kernels' WINDOW: a layer's sliding window (0: none), checked once here."""
    if window < 0:
        raise ValueError(f"a sliding window must be >= 0 (0: none), got {window}")
    return window


def f16_tiles_apply(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernels read this pool in float16 tiles by default: an FP8 pool and a
    bfloat16 query (see _tile_dtype)."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def _f16(asked: Optional[bool], q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return f16_tiles_apply(q, k_cache) if asked is None else asked


def decode_tiles(dtype: torch.dtype, head_dim: int, num_splits: int, batch: int = 0,
                 f16_tiles: bool = False) -> DecodeTiles:
    """Half types, from tile sweeps (scripts/bench_kernels.py --what decode; 32/8 heads, d 128,
    pages of 16, contexts 100-1700, requests longest first). bf16 pools: unsplit (large
    batches) 64 tokens per iteration, 2 warps, 3 stages came closest to the memory bandwidth,
    ahead of (128, 4, 3) and far ahead of 8 warps or 256 tokens; split (small batches): see
    below. FP8 pools in float16 tiles, unsplit: 128 tokens per iteration,
    4 warps and 3 stages below 128 requests (49.6 us at 64, against 64.4 for (64, 2, 3)),
    2 warps and 2 stages from 128 up (149.9 us at 256; RESULTS.md, thirteenth session); split
    (small batches), (64, 2, 2): timed in the model, where PDL overlaps it with the GEMVs around
    it, the batch-16 FP8 step took 3.87 ms against 4.01 with (64, 8) (RESULTS.md, twentieth
    session). bf16 pools split the same way since the kernel merges its own splits: (64, 8)
    won with a separate reduce launch, (64, 2, 2) with the merge (bf16 step 4.27 -> 4.10 ms at
    batch 1, 5.15 -> 5.03 at 16; twenty-second session).
    float32 (IEEE dots run on FMA units, not tensor cores): the tile that compiles without
    register spills for sm_90."""
    if dtype == torch.float32:
        return DecodeTiles(32, 8)
    if num_splits == 1 and head_dim <= 128:
        if f16_tiles:
            return DecodeTiles(128, 4, 3) if batch < 128 else DecodeTiles(128, 2, 2)
        return DecodeTiles(64, 2, 3)
    if head_dim <= 128:
        return DecodeTiles(64, 2)
    return DecodeTiles(64, 8)


def extend_tiles(dtype: torch.dtype, head_dim: int, max_extend: int = 0) -> ExtendTiles:
    """Half types, head_dim <= 128, from the tile sweeps on an H200 (scripts/bench_kernels.py
    --what extend --extend-prompts 512,2048,8192; benchmarks/RESULTS.md): chunks whose longest
    request has fewer than 1,024 new tokens run (64, 64, 4 warps, 2 stages), the fastest on one
    512-token prompt; longer ones (128, 64, 4, 3), the fastest on one prompt of 2,048 or 8,192
    tokens and on an 8,192-token chunk of mixed prompts. Otherwise the largest tiles that compile
    without register spills for sm_90."""
    if dtype == torch.float32:
        return ExtendTiles(32, 64, 8)
    if head_dim > 128:
        return ExtendTiles(64, 32, 8)
    if max_extend < 1024:
        return ExtendTiles(64, 64, 4, 2)
    return ExtendTiles(128, 64, 4, 3)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                     scale: float, min_split_tokens: int = 0,
                     tiles: Optional[DecodeTiles] = None, pdl: bool = False,
                     k_scale: float = 1.0, v_scale: float = 1.0,
                     f16_tiles: Optional[bool] = None,
                     arrivals: Optional[torch.Tensor] = None, window: int = 0,
                     softcap: float = 0.0) -> None:
    """One query token per request.

    q/out [B, heads, d] (last dim contiguous); k/v_cache [slots, kv_heads, d] (one layer);
    page_table [rows, ctx] int32; rows/seq_lens [B] int32 (seq_len counts the new token, whose
    K/V must already be in the pool); o_part [B, heads, S, d] and lse_part [B, heads, S] float32
    scratch, where S = num_splits; with S > 1 also `arrivals`, int32 [B, kv_heads] of zeros,
    which every launch leaves zero (the merge's counters: the split kernel). Request b's KV is
    cut into at most S splits of max(ceil(seq_len / S), min_split_tokens) tokens (rounded up
    to the tile), computed in the kernel from the device lengths: the launch depends only on
    shapes (graph-capturable). Requests in decreasing length run fastest (longest job first;
    see the split kernel). `pdl`: launch with programmatic dependent launch (pdl.py).
    `k_scale` / `v_scale`: the layer's scales of an FP8 pool (the caches hold K / k_scale,
    V / v_scale); 1.0 otherwise. `f16_tiles`: compute in float16 tiles (see
    _tile_dtype); None: where `f16_tiles_apply`. `window` > 0: a sliding-window layer's,
    attending to each request's last `window` tokens only. `softcap` > 0: scores capped to
    softcap * tanh(s / softcap) (Gemma's).
    """
    batch, num_heads, head_dim = q.shape
    if batch > _MAX_GRID_Z:
        raise ValueError(f"decode_attention runs at most {_MAX_GRID_Z} requests per launch (the "
                         f"grid's third axis), got {batch}")
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_splits = o_part.shape[2]
    direct = num_splits == 1  # one split: the kernel writes the output itself
    if not direct and (arrivals is None or arrivals.dtype != torch.int32
                       or arrivals.shape != (batch, num_kv_heads) or not arrivals.is_contiguous()):
        got = None if arrivals is None else (arrivals.dtype, tuple(arrivals.shape))
        raise ValueError(f"decode_attention over {num_splits} splits needs `arrivals`, a "
                         f"contiguous int32 [{batch}, {num_kv_heads}] of zeros; got {got}")
    block_d = _block_d(head_dim)
    f16 = _f16(f16_tiles, q, k_cache)
    tiles = tiles or decode_tiles(q.dtype, head_dim, num_splits, batch, f16)
    min_split = triton.cdiv(max(min_split_tokens, 1), tiles.block_n) * tiles.block_n
    _decode_split_kernel[(num_kv_heads, num_splits, batch)](
        q, k_cache, v_cache, page_table, rows, seq_lens, o_part, lse_part,
        o_part if arrivals is None else arrivals, out,
        scale * k_scale * _LOG2E, v_scale, num_splits, min_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        F32_DOT=_f32_dot(q), DIRECT=direct, F16_TILES=f16, PDL=pdl, WINDOW=_window(window),
        SOFTCAP=float(softcap),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(pdl))


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int,
                     out: torch.Tensor, scale: float, tiles: Optional[ExtendTiles] = None,
                     k_scale: float = 1.0, v_scale: float = 1.0,
                     f16_tiles: Optional[bool] = None, window: int = 0,
                     softcap: float = 0.0) -> None:
    """New tokens attend causally to their request's cached prefix and to each other.

    q/out [T, heads, d] (last dim contiguous), request i's tokens at rows
    [q_starts[i], q_starts[i] + extend_lens[i]); all K/V (prefix and new) are read from the pool
    through page_table[rows[i], :prefix_lens[i] + extend_lens[i]]; the int32 per-request tensors
    are on q's device; `max_extend` bounds extend_lens (it sizes the grid). `k_scale` /
    `v_scale`, `f16_tiles`: as for `decode_attention`. `window` > 0: a sliding-window
    layer's, where the token at position p attends to positions p - window + 1 .. p only.
    `softcap`: as for `decode_attention`.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    batch = rows.shape[0]
    if batch == 0 or max_extend == 0:
        return
    group = num_heads // k_cache.shape[1]
    tiles = tiles or extend_tiles(q.dtype, head_dim, max_extend)
    grid = (batch, num_heads, triton.cdiv(max_extend, tiles.block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, rows, prefix_lens, extend_lens, q_starts,
        scale * k_scale * _LOG2E, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim), F32_DOT=_f32_dot(q), F16_TILES=_f16(f16_tiles, q, k_cache),
        WINDOW=_window(window), SOFTCAP=float(softcap), num_warps=tiles.num_warps, num_stages=tiles.num_stages)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, stride_kt, stride_vt,
                     stride_cs, n_elems, k_scale, v_scale, BLOCK: tl.constexpr,
                     QUANT: tl.constexpr, PDL: tl.constexpr):
    """Program t: copy token t's K and V ([kv_heads * head_dim], dense) into slot slots[t];
    QUANT (FP8 caches): K / k_scale and V / v_scale, clamped to +-448, rounded to nearest."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_elems
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    if QUANT:
        k = quantize_kv(k, k_scale).to(k_cache_ptr.dtype.element_ty)
        v = quantize_kv(v, v_scale).to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + slot * stride_cs + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cs + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, pdl: bool = False, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] in one launch.

    k/v [T, kv_heads, d] with each token's heads one dense block (views of the fused QKV output
    qualify, so V needs no copy); caches [slots, kv_heads, d] contiguous; slots [T], int32 or
    int64, on the same device. FP8 (float8_e4m3fn) caches get k / k_scale and v / v_scale,
    quantized as kvcache.pool.quantize does; other caches ignore the scales.
    """
    tokens, heads, dim = k.shape
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != dim:
            raise ValueError("store_kv needs each token's K/V heads as one dense block")
    if tokens:
        n = heads * dim
        _store_kv_kernel[(tokens,)](k, v, slots, k_cache, v_cache, k.stride(0), v.stride(0),
                                    k_cache.stride(0), n, k_scale, v_scale,
                                    BLOCK=triton.next_power_of_2(n),
                                    QUANT=k_cache.dtype == torch.float8_e4m3fn, PDL=pdl,
                                    **launch_options(pdl))
