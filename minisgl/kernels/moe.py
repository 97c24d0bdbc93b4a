"""The fused mixture-of-experts kernels: routing, the sort of (token, expert) pairs by expert,
and the two grouped GEMMs of the experts.

One MoE layer on M token rows with top-k routing over E experts runs:

1. `route`: per row, softmax of the router logits in float32, the top k (ties: the lower
   expert), optionally renormalized to sum to 1; and, by atomics, how many pairs each expert
   received and each pair's rank among its expert's pairs.
2. `align`: the M*k pairs (pair p = row p // k, choice p % k) sorted by expert, each expert's
   run padded with a sentinel (M*k) up to a multiple of BLOCK_M, and each block's expert.
   Buffers have a worst-case size computed from M, k, E and BLOCK_M on the host; the actual
   padded length stays on the device, so nothing waits for the device and a decode CUDA graph
   captures it all.
3. `grouped_gemm` twice: gate/up of every pair's expert with SiLU-and-mul in the epilogue,
   then down with the pair's routing weight multiplied in; each program computes one block of
   one expert's rows (programs past the padded length return at once).
4. the sum over the k choices of each row.

FP8 experts (`ExpertScales`) run W8A8 as the dense FP8 projections do (kernels/fp8.py): each
GEMM's input is quantized first, per token (or by the checkpoint's static scale), or per 1 x Bk
group where the weights are scaled per Bn x Bk block; the products are taken in FP8 and the
scales applied in float32, per K tile with blocks (the K tile is then Bk) or once at the end.

Within an expert's run the pairs' order follows the atomics and may vary between runs; every
output row is computed on its own, so the results do not. They sum in float32 and round once
per GEMM, so they equal the torch path (layers/moe.py) up to rounding. This module imports
triton: only GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from minisgl.kernels.activation import ACT_SILU, gated_f32
from minisgl.kernels.dot import dot, f32_dot
from minisgl.kernels.fp8 import Quantized, quantize_groups, quantize_tokens
from minisgl.kernels.int_mm import (centred, check_packed, group_params, kernel_group,
                                    packed_values)
from minisgl.kernels.types import FP8, ExpertScales, GemmTiles, MoETiles, PackedGemm

_COUNT_BLOCK = 1024  # pairs per program of the count and scatter kernels
FP8_MIN_K = 32  # the smallest K tile of an FP8 tl.dot on the GPU (Hopper's FP8 MMA)
_OFFSETS_CHUNK = 128  # blocks (and sentinel stores / 8) per step of the one offsets program

# Tiles by the rows an expert receives on average, M * k / E, at which the tile stops paying:
# blocks of 16 rows for decode (an expert sees a few rows: the step streams weights, and small
# blocks waste the least), 128 for long prefill chunks (compute-bound; larger tiles reuse each
# loaded weight tile over more rows). Chosen for the H200 (132 SMs, 228 KiB shared memory per
# SM) by the sweep of scripts/bench_kernels.py --what moe --moe-sweep over Qwen3-30B-A3B's
# experts at 1, 64, 256 and 8,192 rows (the fastest of each bucket's rows, where it beat the
# others by more than noise; benchmarks/RESULTS.md).
_TILES = (
    (8.0, MoETiles(16, GemmTiles(64, 128, 4, 4), GemmTiles(64, 128, 4, 3))),
    (24.0, MoETiles(32, GemmTiles(64, 128, 4, 3), GemmTiles(128, 64, 4, 3))),
    (96.0, MoETiles(64, GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 4, 3))),
    (float("inf"), MoETiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3))),
)


def moe_tiles(rows: int, top_k: int, num_experts: int) -> MoETiles:
    """The tiles for `rows` token rows routed to `top_k` of `num_experts` experts."""
    per_expert = rows * top_k / num_experts
    return next(tiles for bound, tiles in _TILES if per_expert <= bound)


class Routing(NamedTuple):
    """Each row's chosen experts and weights, and what `align` sorts them by. `owned`: the
    experts that run here are 0 .. owned - 1, and expert `owned` stands for every other
    rank's (expert parallelism: `routing_of`); None: all of them run here."""

    weights: torch.Tensor  # [M, k] float32
    ids: torch.Tensor  # [M, k] int32, each row's experts in descending weight
    counts: torch.Tensor  # [E] int32: pairs per expert
    ranks: torch.Tensor  # [M, k] int32: the pair's index among its expert's pairs
    owned: Optional[int] = None


class Aligned(NamedTuple):
    """The pairs sorted by expert and padded to whole blocks of `block_m` rows; `complete`:
    every pair is in a block (else the grouped GEMMs zero the rows of those that are not)."""

    sorted_ids: torch.Tensor  # [blocks * block_m] int32 pair indices, sentinel M*k as padding
    expert_ids: torch.Tensor  # [blocks] int32: each block's expert
    total: torch.Tensor  # [1] int32: the padded length actually used
    block_m: int
    complete: bool = True


def padded_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every expert that receives a pair (at most min(pairs, E))
    pads by at most block_m - 1, rounded up to whole blocks."""
    worst = pairs + min(pairs, num_experts) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, ranks_ptr, num_experts,
                  stride_l, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=experts < num_experts,
                     other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    probs = p / tl.sum(p, 0)
    # A row of NaN (an overflowed activation, or junk in a CUDA graph's padding rows) must
    # still pick experts in range: NaN equals nothing, so `pick` would be BLOCK_E and the
    # counts' atomic add would write past their end. NaN ranks below every probability (-1),
    # lanes past the experts and experts already picked below that (-2); the row's output
    # stays NaN (its experts see its NaN activations).
    probs = tl.where(probs == probs, probs, -1.0)
    probs = tl.where(experts < num_experts, probs, -2.0)
    choices = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        pick = tl.min(tl.where(probs == best, experts, BLOCK_E), 0)  # ties: the lower expert
        top = tl.where(choices == j, best, top)
        top_ids = tl.where(choices == j, pick, top_ids)
        probs = tl.where(experts == pick, -2.0, probs)
    if RENORMALIZE:
        top = top / tl.sum(tl.where(choices < TOP_K, top, 0.0), 0)
    live = choices < TOP_K
    tl.store(weights_ptr + row * TOP_K + choices, top, mask=live)
    tl.store(ids_ptr + row * TOP_K + choices, top_ids, mask=live)
    ranks = tl.atomic_add(counts_ptr + top_ids, 1, mask=live, sem="relaxed")
    tl.store(ranks_ptr + row * TOP_K + choices, ranks, mask=live)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Top-k routing of router `logits` [M, E] (softmax over all E in float32)."""
    m, e = logits.shape
    dev = logits.device
    weights = torch.empty((m, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=dev)
    counts = torch.zeros(e, dtype=torch.int32, device=dev)
    ranks = torch.empty((m, top_k), dtype=torch.int32, device=dev)
    if m:
        _route_kernel[(m,)](logits, weights, ids, counts, ranks, e, logits.stride(0),
                            TOP_K=top_k, RENORMALIZE=renormalize,
                            BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=max(2, triton.next_power_of_2(top_k)))
    return Routing(weights, ids, counts, ranks)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, ranks_ptr, pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < pairs
    ids = tl.load(ids_ptr + offs, mask=live, other=0)
    ranks = tl.atomic_add(counts_ptr + ids, 1, mask=live, sem="relaxed")
    tl.store(ranks_ptr + offs, ranks, mask=live)


def routing_of(weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
               owned: Optional[int] = None) -> Routing:
    """The Routing of experts chosen elsewhere (ids [M, k], weights [M, k]): their counts and
    ranks, as `route` makes them. `owned` (expert parallelism: layers/moe.owned_topk made the
    choices): experts 0 .. owned - 1 run here, expert `owned` = num_experts - 1 holds the
    pairs of other ranks' experts, which `align` lays out no block for."""
    ids = ids.to(torch.int32).contiguous()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    ranks = torch.empty_like(ids)
    if ids.numel():
        _count_kernel[(triton.cdiv(ids.numel(), _COUNT_BLOCK),)](
            ids, counts, ranks, ids.numel(), BLOCK=_COUNT_BLOCK)
    return Routing(weights.float().contiguous(), ids, counts, ranks, owned)


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, expert_ids_ptr, total_ptr, sorted_ptr, num_experts,
                    blocks, sentinel, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    CHUNK: tl.constexpr):
    """One program: each expert's padded start, each block's expert, the padded total, and
    the sentinel in every row of the sorted buffer (the scatter kernel then fills the pairs)."""
    experts = tl.arange(0, BLOCK_E)
    live = experts < num_experts
    counts = tl.load(counts_ptr + experts, mask=live, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + experts, ends - padded, mask=live)
    tl.store(total_ptr, tl.sum(padded, 0))
    for b0 in range(0, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # a block's expert: how many experts end at or before the block's first row
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & live[None, :]
        owner = tl.minimum(tl.sum(before.to(tl.int32), 1), num_experts - 1)
        tl.store(expert_ids_ptr + b, owner, mask=b < blocks)
    fill = tl.full([CHUNK * 8], sentinel, dtype=tl.int32)
    for r0 in range(0, blocks * BLOCK_M, CHUNK * 8):
        r = r0 + tl.arange(0, CHUNK * 8)
        tl.store(sorted_ptr + r, fill, mask=r < blocks * BLOCK_M)


@triton.jit
def _scatter_kernel(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, pairs, num_experts,
                    BLOCK: tl.constexpr):
    """Each pair of the first `num_experts` experts to its place (other experts' stay out)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=0)
    live = (offs < pairs) & (ids < num_experts)
    dest = tl.load(starts_ptr + ids, mask=live, other=0) + tl.load(ranks_ptr + offs, mask=live,
                                                                    other=0)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=live)


def align(routing: Routing, block_m: int) -> Aligned:
    """The pairs of `routing` sorted by expert, each expert's run padded to whole blocks (the
    experts that run here: `routing.owned`)."""
    pairs = routing.ids.numel()
    e = routing.counts.numel() if routing.owned is None else routing.owned
    dev = routing.ids.device
    rows = padded_capacity(pairs, e, block_m)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    starts = torch.empty(e, dtype=torch.int32, device=dev)
    _offsets_kernel[(1,)](routing.counts, starts, expert_ids, total, sorted_ids, e,
                          rows // block_m, pairs, BLOCK_M=block_m,
                          BLOCK_E=triton.next_power_of_2(e), CHUNK=_OFFSETS_CHUNK)
    if pairs:
        _scatter_kernel[(triton.cdiv(pairs, _COUNT_BLOCK),)](
            routing.ids, routing.ranks, starts, sorted_ids, pairs, e, BLOCK=_COUNT_BLOCK)
    return Aligned(sorted_ids, expert_ids, total, block_m, routing.owned is None)


@triton.jit
def _block_pid(n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of this program: GROUP_M row blocks sweep the output
    features together (L2 reuse of the weights)."""
    pid = tl.program_id(0)
    blocks_m = tl.num_programs(0) // tl.cdiv(n, BLOCK_N)
    blocks_n = tl.cdiv(n, BLOCK_N)
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    return (first_m + (pid % (GROUP_M * blocks_n)) % group_size,
            (pid % (GROUP_M * blocks_n)) // group_size)


@triton.jit
def _block_rows(sorted_ptr, expert_ids_ptr, pid_m, pid_n, pairs, n, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The block's pairs (int64; `live` where not padding), its expert, its output columns
    and which of them exist."""
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return (pair.to(tl.int64), pair < pairs, tl.load(expert_ids_ptr + pid_m).to(tl.int64),
            cols, cols < n)


@triton.jit
def _finish_block(acc, acc_up, c_ptr, weights_ptr, pair, live, cols, col_ok, stride_cm,
                  GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    """The block's epilogue: silu(gate) * up where GATED, the routing weight where
    MUL_WEIGHT, stored at the pairs' rows."""
    if GATED:
        acc = gated_f32(acc, acc_up, ACT_SILU)  # every MoE family's
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=live, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=live[:, None] & col_ok[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ptr, expert_ids_ptr,
                         total_ptr, as_ptr, ws_ptr, pairs, n, k, stride_am, stride_we,
                         stride_wn, stride_cm, stride_as, stride_se, stride_sn, up_rows,
                         A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                         MUL_WEIGHT: tl.constexpr, F32_DOT: tl.constexpr, SCALES: tl.constexpr,
                         GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c[pair, :n] = a[pair // A_ROW_DIV] W[expert]^T for one block of one expert's pairs:
    with GATED, W's rows [0, n) are the gate and [n, 2n) the up projection, and c is
    silu(gate) * up; with MUL_WEIGHT, c is scaled by the pair's routing weight.

    SCALES 0: a and W in the compute dtype. 1: FP8, a scaled per row (as[row]) and W per
    output row (ws[expert, r]), applied once after the sum over K. 2: FP8 in blocks, a scaled
    per row and K tile (as[row, kt]) and W per GROUP_N rows and K tile (ws[expert, r //
    GROUP_N, kt]; BLOCK_K is the block's width), applied to each tile's product. The up
    projection's scales start `up_rows` scale rows after the gate's."""
    pid_m, pid_n = _block_pid(n, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair, live, expert, cols, col_ok = _block_rows(sorted_ptr, expert_ids_ptr, pid_m, pid_n,
                                                   pairs, n, BLOCK_M, BLOCK_N)
    a_rows = pair // A_ROW_DIV
    red = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + red[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + red[:, None]
    s_gate = ws_ptr + expert * stride_se + (cols // GROUP_N).to(tl.int64) * stride_sn
    s_up = s_gate + up_rows * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        in_k = red < k - k0
        a = tl.load(a_ptrs, mask=live[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & col_ok[None, :]
        if SCALES == 2:
            kt = k0 // BLOCK_K
            a_s = tl.load(as_ptr + a_rows * stride_as + kt, mask=live, other=0.0)[:, None]
            w_s = tl.load(s_gate + kt, mask=col_ok, other=0.0)[None, :]
            acc += dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), F32_DOT) * a_s * w_s
            if GATED:
                w_s = tl.load(s_up + kt, mask=col_ok, other=0.0)[None, :]
                acc_up += dot(a, tl.load(w_ptrs + n * stride_wn, mask=w_mask, other=0.0),
                              F32_DOT) * a_s * w_s
        else:
            acc += dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), F32_DOT)
            if GATED:
                acc_up += dot(a, tl.load(w_ptrs + n * stride_wn, mask=w_mask, other=0.0),
                              F32_DOT)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALES == 1:
        a_s = tl.load(as_ptr + a_rows * stride_as, mask=live, other=0.0)[:, None]
        acc *= a_s * tl.load(s_gate, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= a_s * tl.load(s_up, mask=col_ok, other=0.0)[None, :]
    _finish_block(acc, acc_up, c_ptr, weights_ptr, pair, live, cols, col_ok, stride_cm, GATED,
                  MUL_WEIGHT)


@triton.jit
def _int_tile(q_ptr, s_ptr, z_ptr, g_ptr, k0, k, cols, col_ok, stride_qk, stride_sg,
              BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of one expert's packed integer weights (inputs from k0 of
    columns cols; g_ptr: the expert's g_idx; GROUP: int_mm.group_params'), dequantized in
    float32 and rounded to `dtype`."""
    q = packed_values(q_ptr, k0, tl.cdiv(k, 32 // BITS), cols, col_ok, stride_qk, BITS,
                      BLOCK_K, BLOCK_N)
    s, z = group_params(s_ptr, z_ptr, g_ptr, k0, k, cols, col_ok, stride_sg, BLOCK_K, GROUP)
    return (centred(q, z) * s).to(dtype)


@triton.jit
def _grouped_int_gemm_kernel(a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, c_ptr, weights_ptr,
                             sorted_ptr, expert_ids_ptr, total_ptr, pairs, n, k, stride_am,
                             stride_qe, stride_qk, stride_se, stride_sg, stride_cm,
                             A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                             MUL_WEIGHT: tl.constexpr, F32_DOT: tl.constexpr,
                             BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             GROUP: tl.constexpr):
    """`_grouped_gemm_kernel` over packed integer experts (layers/experts.py's layout, that of
    kernels/int_mm.py per expert): q [E, K / P, n or 2n] int32, scales and zeros [E, G, n or
    2n], g [E, K] each input's group; with GATED the up projection's columns follow the
    gate's."""
    pid_m, pid_n = _block_pid(n, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair, live, expert, cols, col_ok = _block_rows(sorted_ptr, expert_ids_ptr, pid_m, pid_n,
                                                   pairs, n, BLOCK_M, BLOCK_N)
    red = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_ROW_DIV)[:, None] * stride_am + red[None, :]
    q_ptr += expert * stride_qe
    s_ptr += expert * stride_se
    z_ptr += expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_ptr += expert * k
    for k0 in range(0, k, BLOCK_K):
        a = tl.load(a_ptrs, mask=live[:, None] & (k0 + red < k)[None, :], other=0.0)
        acc += dot(a, _int_tile(q_ptr, s_ptr, z_ptr, g_ptr, k0, k, cols, col_ok, stride_qk,
                                stride_sg, BITS, BLOCK_K, BLOCK_N, GROUP, a.dtype), F32_DOT)
        if GATED:
            acc_up += dot(a, _int_tile(q_ptr, s_ptr, z_ptr, g_ptr, k0, k, cols + n, col_ok,
                                       stride_qk, stride_sg, BITS, BLOCK_K, BLOCK_N, GROUP,
                                       a.dtype),
                          F32_DOT)
        a_ptrs += BLOCK_K
    _finish_block(acc, acc_up, c_ptr, weights_ptr, pair, live, cols, col_ok, stride_cm, GATED,
                  MUL_WEIGHT)


def fit_shared_memory(tiles: GemmTiles, dtype: torch.dtype) -> GemmTiles:
    """`tiles` for operands of `dtype`: the table's tiles are sized for 2-byte types, and
    4-byte operands (float32, for exact comparison with the reference) would need twice their
    shared memory per pipeline stage, beyond the SM's; they get half the reduced width and at
    most two stages."""
    if dtype.itemsize <= 2:
        return tiles
    return tiles._replace(block_k=max(16, tiles.block_k // 2),
                          num_stages=min(tiles.num_stages, 2))


class WeightScales(NamedTuple):
    """An FP8 grouped GEMM's weight scales: [E, N] per output row, or [E, ceil(N / Bn),
    ceil(K / Bk)] per `block` (Bn, Bk); for a gated GEMM [E, 2, ...], the gate's then the
    up projection's."""

    scales: torch.Tensor
    block: Optional[Tuple[int, int]]


def _scale_operands(w_scales: WeightScales, gated: bool, e: int, n: int, k: int
                    ) -> Tuple[torch.Tensor, int]:
    """The weight scales as [E, rows, ...] (gated: gate's rows, then up's) and where up's
    rows start; ValueError naming the shapes where they do not fit the weight."""
    s, block = w_scales
    per = (n,) if block is None else (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    want = (e, 2, *per) if gated else (e, *per)
    if tuple(s.shape) != want or not s.is_contiguous():
        raise ValueError(f"FP8 expert weights [{e}, {'2 x ' if gated else ''}{n}, {k}] with "
                         f"{'block ' + str(block) if block else 'per-row'} scales want dense "
                         f"scales {want}, got {tuple(s.shape)} (strides {s.stride()})")
    return (s.flatten(1, 2) if gated else s), per[0]


def _output(pairs: int, n: int, dtype: torch.dtype, device: torch.device, aligned: Aligned
            ) -> torch.Tensor:
    """A grouped GEMM's [pairs, n] output: zeros where some pair is in no block (another
    rank's expert: its row sums into the combine as nothing), else left for the GEMM to fill."""
    make = torch.empty if aligned.complete else torch.zeros
    return make((pairs, n), dtype=dtype, device=device)


def grouped_gemm(a: Union[torch.Tensor, Quantized], w: torch.Tensor, aligned: Aligned,
                 pairs: int, a_row_div: int, tiles: GemmTiles, gated: bool,
                 weights: Optional[torch.Tensor] = None,
                 w_scales: Optional[WeightScales] = None,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """[pairs, n]: row p is a[p // a_row_div] times the weights w[expert of p] [E, n or 2n, K]
    (gated: silu(gate) * up with n = w.shape[1] // 2), times weights[p] where given.
    FP8 weights take `w_scales` and `a` quantized (kernels/fp8.py: per row, or per 1 x Bk
    group with block scales); the output is `out_dtype` (default: a's dtype)."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    e, k = w.shape[0], w.shape[2]
    values = a.values if isinstance(a, Quantized) else a
    if values.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"grouped_gemm needs row-major operands, got strides {values.stride()} "
                         f"and {w.stride()}")
    if (w_scales is None) != (w.dtype != FP8) or isinstance(a, Quantized) != (w.dtype == FP8):
        raise ValueError(f"grouped_gemm multiplies FP8 weights (with their scales) by quantized "
                         f"activations, or neither; got {w.dtype} weights, scales "
                         f"{'given' if w_scales else 'none'}, activations "
                         f"{'quantized' if isinstance(a, Quantized) else values.dtype}")
    out = _output(pairs, n, out_dtype or values.dtype, values.device, aligned)
    blocks = aligned.expert_ids.numel()
    if pairs == 0:
        return out
    tiles = fit_shared_memory(tiles, values.dtype)
    scales, up_rows, a_scales, mode, group_n = out, 0, out, 0, 1
    if w_scales is not None and isinstance(a, Quantized):
        scales, up_rows = _scale_operands(w_scales, gated, e, n, k)
        a_scales = a.scales
        mode = 1 if w_scales.block is None else 2
        # FP8 tensor-core products take K tiles of 32 or more; with blocks the K tile is Bk
        tiles = tiles._replace(block_k=max(FP8_MIN_K, tiles.block_k))
        if w_scales.block is not None:
            group_n = w_scales.block[0]
            tiles = tiles._replace(block_k=w_scales.block[1])
    grid = (blocks * triton.cdiv(n, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        values, w, out, weights if weights is not None else out, aligned.sorted_ids,
        aligned.expert_ids, aligned.total, a_scales, scales, pairs, n, k, values.stride(0),
        w.stride(0), w.stride(1), out.stride(0), a_scales.stride(0), scales.stride(0),
        scales.stride(1) if mode else 0, up_rows, A_ROW_DIV=a_row_div, GATED=gated,
        MUL_WEIGHT=weights is not None, F32_DOT=f32_dot(values), SCALES=mode,
        GROUP_N=group_n, BLOCK_M=aligned.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out


def grouped_int_gemm(a: torch.Tensor, w: PackedGemm, aligned: Aligned, pairs: int,
                     a_row_div: int, tiles: GemmTiles, gated: bool,
                     weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`grouped_gemm` over packed integer experts: [pairs, n] in a's dtype."""
    cols = w.qweight.shape[2]
    n = cols // 2 if gated else cols
    k = a.shape[1]
    check_packed(a, w.qweight, w.scales, w.zeros, w.g_idx, w.bits, experts=w.qweight.shape[0])
    out = _output(pairs, n, a.dtype, a.device, aligned)
    if pairs == 0:
        return out
    tiles = fit_shared_memory(tiles, a.dtype)
    grid = (aligned.expert_ids.numel() * triton.cdiv(n, tiles.block_n),)
    _grouped_int_gemm_kernel[grid](
        a, w.qweight, w.scales, w.zeros, w.g_idx, out, weights if weights is not None else out,
        aligned.sorted_ids, aligned.expert_ids, aligned.total, pairs, n, k, a.stride(0),
        w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
        out.stride(0), A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=weights is not None,
        F32_DOT=f32_dot(a), BITS=w.bits, BLOCK_M=aligned.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        GROUP=kernel_group(w.group_run, tiles.block_k), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out


def fused_packed_experts(x: torch.Tensor, routing: Routing, w13: PackedGemm, w2: PackedGemm,
                         tiles: Optional[MoETiles] = None) -> torch.Tensor:
    """`fused_experts` over packed integer experts (weight-only: x stays in its dtype)."""
    m, top_k = routing.ids.shape
    tiles = tiles or moe_tiles(m, top_k, w13.qweight.shape[0])
    aligned = align(routing, tiles.block_m)
    pairs = m * top_k
    act = grouped_int_gemm(x, w13, aligned, pairs, top_k, tiles.gate_up, gated=True)
    out = grouped_int_gemm(act, w2, aligned, pairs, 1, tiles.down, gated=False,
                           weights=routing.weights)
    return out.view(m, top_k, -1).sum(dim=1)


def _quantize(x: torch.Tensor, block: Optional[Tuple[int, int]],
              static: Optional[torch.Tensor]) -> Quantized:
    """A grouped GEMM's FP8 input: per 1 x Bk group for block scales, else per row (or by the
    static scale)."""
    x = x.contiguous()
    return quantize_groups(x, block[1]) if block is not None else quantize_tokens(x, static)


def fused_experts(x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor,
                  tiles: Optional[MoETiles] = None,
                  scales: Optional[ExpertScales] = None) -> torch.Tensor:
    """sum over j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j]:
    x [M, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] -> [M, H] in x's dtype.
    FP8 experts take their `scales`; each GEMM's input is then quantized (W8A8)."""
    m, top_k = routing.ids.shape
    tiles = tiles or moe_tiles(m, top_k, w13.shape[0])
    aligned = align(routing, tiles.block_m)
    pairs = m * top_k
    if scales is None:
        act = grouped_gemm(x, w13, aligned, pairs, top_k, tiles.gate_up, gated=True)
        out = grouped_gemm(act, w2, aligned, pairs, 1, tiles.down, gated=False,
                           weights=routing.weights)
        return out.view(m, top_k, -1).sum(dim=1)
    act = grouped_gemm(_quantize(x, scales.block, scales.w13_input), w13, aligned, pairs,
                       top_k, tiles.gate_up, gated=True,
                       w_scales=WeightScales(scales.w13, scales.block), out_dtype=x.dtype)
    out = grouped_gemm(_quantize(act, scales.block, scales.w2_input), w2, aligned, pairs, 1,
                       tiles.down, gated=False, weights=routing.weights,
                       w_scales=WeightScales(scales.w2, scales.block), out_dtype=x.dtype)
    return out.view(m, top_k, -1).sum(dim=1)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool, tiles: Optional[MoETiles] = None,
              scales: Optional[ExpertScales] = None) -> torch.Tensor:
    """The MoE layer's experts on x [M, H] with router logits [M, E]: `route` then
    `fused_experts`."""
    return fused_experts(x, route(logits, top_k, renormalize), w13, w2, tiles, scales)
