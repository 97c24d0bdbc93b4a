"""Triton one-token projections (GEMV) for the batch-1 decode step, which is pure weight
streaming: every weight matrix multiplied by one row. With `pdl` (pdl.py) each program
loads its first weight tile before waiting for the previous kernel, so weight streaming overlaps
that kernel's tail.

- `gemv`: x W^T + b.
- `norm_gemv`: the RMSNorm (with the residual add) before the projection, inside it.
- `norm_gate_up_act`: the same for the MLP's gate/up projection, with the gated activation
  (SiLU or GELU) and the multiply in the epilogue.
- `norm_qkv_rope`: the same for the QKV projection, with the rotary embedding and the K/V store
  in the epilogue.

They sum in float32 and round where the separate kernels round, so their results equal those
kernels' up to summation order. Each takes FP8 (float8_e4m3fn) weights too, with `weight_scale`
their float32 scale per output row: the row's dot product with the (unquantized) input is
multiplied by its scale before the bias, so that a batch-1 step streams half the bytes. This
module imports triton; layers import it only for CUDA tensors.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from minisgl.kernels.activation import gated_f32
from minisgl.kernels.types import SILU
from minisgl.kernels.fp8 import quantize_kv
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.rmsnorm import rmsnorm_row_w
from minisgl.kernels.types import Normed, QKVRope
from minisgl.utils import checked_out


# --- plain ----------------------------------------------------------------------------------------
# Stripes of 4 output rows, reading 2,048 or 4,096 columns at a time, were the fastest tiles of a
# sweep (scripts/bench_kernels.py). Inside the model they pay only with PDL: the first weight
# tile is then in flight before the previous kernel has finished.
_GEMV_ROWS = 4


class GemvTiles(NamedTuple):
    """The plain GEMV's tiling: columns per load, warps, pipeline stages, rows per program."""

    block_k: int
    num_warps: int
    num_stages: int
    rows: int = _GEMV_ROWS


def gemv_tiles(k: int, fp8: bool = False) -> GemvTiles:
    """bf16 weights: all of K in one 4096-wide load when it divides; otherwise 2048-wide,
    double-buffered. FP8 weights (half the bytes a load): 2048-wide, double-buffered, at every
    K (at K = 4,096: 5.94 us against 6.74 for the one 4096-wide load on o_proj, 9.02 against
    9.66 on QKV; RESULTS.md, thirteenth session). At K >= 8,192 otherwise (Llama's down,
    14,336): 8 rows a program and 8 warps (Llama-3.1-8B's batch-1 step on an H100: FP8 3.111
    ms against 3.128 with 4 rows and 4 warps, bf16 5.257 against 5.453; 4 rows with 8 warps
    3.193: RESULTS.md, fifty-first session)."""
    if k % 4096 == 0 and not fp8:
        return GemvTiles(4096, 8, 1)
    if k >= 8192:
        return GemvTiles(2048, 8, 2, 8)
    return GemvTiles(min(2048, triton.next_power_of_2(k)), 4, 2)


@triton.jit
def _gemv_tile(w_ptr, rows, cols, n, k, stride_wn):
    """Weight rows `rows` [BLOCK_N], columns `cols` [BLOCK_K] (zero outside n x k). A step
    reads each weight once, so its lines go first out of L2, ahead of what is read again (the
    KV pool, activations, norm weights): one H200, batch-1 step FP8 2.586 -> 2.565 ms, bf16
    4.138 -> 4.128 (RESULTS.md, twenty-third session)."""
    mask = (rows < n)[:, None] & (cols < k)[None, :]
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :], mask=mask,
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def _row_params(s_ptr, b_ptr, rows, n, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The rows' weight scales and biases in float32 (zeros where there are none). Parameters:
    a kernel loads them before its PDL wait, so that no load follows its sums (measured on
    one H200: RESULTS.md, twenty-third session)."""
    zeros = tl.zeros_like(rows).to(tl.float32)
    scale = zeros
    bias = zeros
    if HAS_SCALE:
        scale = tl.load(s_ptr + rows, mask=rows < n, other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=rows < n, other=0.0).to(tl.float32)
    return scale, bias


@triton.jit
def _scaled(acc, scale, bias, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc * scale + bias, each where there is one (`_row_params`)."""
    if HAS_SCALE:
        acc *= scale
    if HAS_BIAS:
        acc += bias
    return acc


@triton.jit
def _gemv_store(acc, rows, n, scale, bias, out_ptr, HAS_SCALE: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    acc = _scaled(acc, scale, bias, HAS_SCALE, HAS_BIAS)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < n)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, n, k, stride_wn, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    # The weights are never written during a forward pass: their first tile may be read before
    # the wait; x (the previous kernel's output) only after it.
    w = _gemv_tile(w_ptr, rows, cols, n, k, stride_wn)
    scale, bias = _row_params(s_ptr, b_ptr, rows, n, HAS_SCALE, HAS_BIAS)
    pdl_enter(PDL)
    x = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = _gemv_tile(w_ptr, rows, cols, n, k, stride_wn)
        x = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    _gemv_store(acc, rows, n, scale, bias, out_ptr, HAS_SCALE, HAS_BIAS)


def _fp8(weight: torch.Tensor) -> bool:
    """FP8 (float8_e4m3fn) weights: scaled per row, and tiled as such."""
    return weight.dtype == torch.float8_e4m3fn


def _check_gemv(x: torch.Tensor, weight: torch.Tensor,
                weight_scale: Optional[torch.Tensor] = None) -> None:
    n, k = weight.shape
    if x.numel() != k or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row of {k} features and a row-major weight, got x "
                         f"{tuple(x.shape)}, weight strides {weight.stride()}")
    if _fp8(weight) != (weight_scale is not None) or (weight_scale is not None and (
            weight_scale.shape != (n,) or weight_scale.dtype != torch.float32
            or not weight_scale.is_contiguous())):
        got = None if weight_scale is None else (weight_scale.dtype, tuple(weight_scale.shape))
        raise ValueError(f"a gemv's weight_scale is a dense float32 [{n}] for FP8 weights and "
                         f"None otherwise; got {weight.dtype} weights and scale {got}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         pdl: bool = False, weight_scale: Optional[torch.Tensor] = None,
         tiles: Optional[GemvTiles] = None, out: Optional[torch.Tensor] = None
         ) -> torch.Tensor:
    """x W^T + b for a single row x [..., K] (one token); weight [N, K] with dense rows (FP8
    with `weight_scale` [N], see the module's doc). Sums in float32 and rounds once (the last
    bit can differ from cuBLAS). `tiles`: gemv_tiles(K) unless given (scripts/bench_kernels.py
    sweeps them). `out`: where given, the result is written there and returned (x's shape
    with N last, x's dtype, contiguous)."""
    _check_gemv(x, weight, weight_scale)
    n, k = weight.shape
    out = checked_out(out, (*x.shape[:-1], n), x)
    tiles = tiles or gemv_tiles(k, _fp8(weight))
    _gemv_kernel[(triton.cdiv(n, tiles.rows),)](
        x.contiguous(), weight, _or(weight_scale, weight), _or(bias, weight), out, n, k,
        weight.stride(0), HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None,
        BLOCK_N=tiles.rows, BLOCK_K=tiles.block_k, PDL=pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **launch_options(pdl))
    return out


def _or(t: Optional[torch.Tensor], other: torch.Tensor) -> torch.Tensor:
    """An optional tensor argument of a kernel: any pointer stands in for a missing one (the
    kernel's HAS_* flag keeps it unread)."""
    return t if t is not None else other


# --- with the RMSNorm before them fused in --------------------------------------------------------
# Every program normalizes its own copy of the input row (from L2) before its product, instead of
# a norm kernel running first: one launch fewer per projection, and the weights start streaming
# at once (scripts/bench_kernels.py --what normlinear measures both ways). Programs taking
# several stripes of rows, to normalize fewer times, were slower, and 4 warps beat 8.
# A program holds the whole input row in registers (next power of two). Measured at 4,096
# (Llama-3.1-8B); wider rows (Qwen3-32B's 5,120 pads to 8,192, Llama-70B's 8,192) would hold
# twice the registers per thread and have not run on a GPU, so their layers keep the norm kernel.
NORM_GEMV_MAX_K = 4096


@triton.jit
def _norm_weight_early(nw_ptr, cols, k, EARLY: tl.constexpr):
    """The norm's weight (a parameter) loaded before the PDL wait where EARLY, else a
    placeholder that `_norm_weight_late` replaces after it. Early pays with FP8 weights
    (batch-1 step 2.536 -> 2.491 ms) and costs with 16-bit ones (4.088 -> 4.121: twice the
    weight registers held across the wait; one H200, RESULTS.md, twenty-third session)."""
    nw = tl.zeros_like(cols).to(nw_ptr.dtype.element_ty)
    if EARLY:
        nw = tl.load(nw_ptr + cols, mask=cols < k, other=0.0)
    return nw


@triton.jit
def _norm_weight_late(nw, nw_ptr, cols, k, EARLY: tl.constexpr):
    """After the wait: `nw` from `_norm_weight_early`, or the weight loaded now."""
    if not EARLY:
        nw = tl.load(nw_ptr + cols, mask=cols < k, other=0.0)
    return nw


@triton.jit
def _normed_row(x_ptr, res_ptr, nw, res_out_ptr, cols, k, eps, HAS_RES: tl.constexpr):
    """The norm GEMV's input in float32: rmsnorm(h) * nw for h = x + res (x alone without
    HAS_RES), rounded as the RMSNorm kernel rounds; program 0 also stores h at res_out. `nw`:
    `_norm_weight_early`."""
    mask = cols < k
    h = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RES:
        h = h + tl.load(res_ptr + cols, mask=mask, other=0.0)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + cols, h, mask=mask)
    return rmsnorm_row_w(h, nw, k, eps).to(tl.float32)


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_out_ptr, n, k,
                      stride_wn, eps, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EARLY_NW: tl.constexpr, PDL: tl.constexpr):
    """Program p: rows [p * BLOCK_N, +BLOCK_N) of rmsnorm(h) W^T + b for h = x + res (x alone
    without HAS_RES); program 0 also stores h at res_out."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w = _gemv_tile(w_ptr, rows, cols, n, k, stride_wn)  # before the wait, as in _gemv_kernel
    scale, bias = _row_params(s_ptr, b_ptr, rows, n, HAS_SCALE, HAS_BIAS)
    nw = _norm_weight_early(nw_ptr, cols, k, EARLY_NW)
    pdl_enter(PDL)
    nw = _norm_weight_late(nw, nw_ptr, cols, k, EARLY_NW)
    x = _normed_row(x_ptr, res_ptr, nw, res_out_ptr, cols, k, eps, HAS_RES)
    _gemv_store(tl.sum(w.to(tl.float32) * x[None, :], axis=1), rows, n, scale, bias, out_ptr,
                HAS_SCALE, HAS_BIAS)


class _NormGemvIO(NamedTuple):
    x: torch.Tensor
    residual: torch.Tensor  # to read (x itself where there is none: the kernel skips it)
    out: torch.Tensor
    residual_out: torch.Tensor  # x itself where there is no residual


def _norm_gemv_io(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                  weight: torch.Tensor, out_features: int,
                  weight_scale: Optional[torch.Tensor]) -> _NormGemvIO:
    """Checked inputs and new outputs of a norm GEMV."""
    _check_gemv(x, weight, weight_scale)
    k = weight.shape[1]
    if k > NORM_GEMV_MAX_K or norm_weight.numel() != k:
        raise ValueError(f"a norm GEMV takes rows of at most {NORM_GEMV_MAX_K} features and a "
                         f"norm weight of the same width, got {k} and {norm_weight.numel()}")
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    if residual is None:
        return _NormGemvIO(x, x, out, x)
    return _NormGemvIO(x, residual.contiguous(), out, torch.empty_like(x))


def norm_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              pdl: bool = False, num_warps: int = 4, num_stages: int = 1,
              weight_scale: Optional[torch.Tensor] = None, rows: int = _GEMV_ROWS) -> Normed:
    """`gemv(rmsnorm(x + residual), weight, bias)` in one launch, for one row x of K <=
    NORM_GEMV_MAX_K features (the norm's roundings are `rmsnorm`'s), and the new residual
    x + residual (a new tensor; x itself without a residual). `num_warps`, `num_stages`,
    `rows` (output rows a program, a power of two): the tiling, there for
    scripts/bench_kernels.py's sweep (the layers take the defaults). FP8 weights with
    `weight_scale`, as `gemv`."""
    n, k = weight.shape
    x, res, out, res_out = _norm_gemv_io(x, residual, norm_weight, weight, n, weight_scale)
    _norm_gemv_kernel[(triton.cdiv(n, rows),)](
        x, res, norm_weight, weight, _or(weight_scale, weight), _or(bias, weight), out, res_out,
        n, k, weight.stride(0), eps, HAS_RES=residual is not None,
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None,
        BLOCK_N=rows, BLOCK_K=triton.next_power_of_2(k), EARLY_NW=_fp8(weight), PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch_options(pdl))
    return Normed(out, res_out)


# The two kernels below give each program PAIRS pairs of rows (lo[i], hi[i]) that its epilogue
# combines: a rotary pair (rows j and j + head_dim / 2 of a head) or a gate row and its up row.
# The products are rounded to the output dtype first, as the GEMV's output would be, so the
# results equal the separate rotary / SiLU kernels'.
def default_pairs(weight: torch.Tensor) -> int:
    """Row pairs a program for the two pair kernels: 2 for 16-bit weights, 4 for FP8 (a program
    then streams as many weight bytes as the 16-bit tiling; Llama-3.1-8B shape on one H200,
    4 warps: gate/up 32.3 us against 34.7 at 2 pairs, QKV with rotary 10.8 against 11.0;
    RESULTS.md, sixteenth session)."""
    return 4 if _fp8(weight) else 2


@triton.jit
def _pair_tiles(w_ptr, lo_rows, hi_rows, cols, n, k, stride_wn):
    """The weight rows of both halves of the program's pairs (loaded before the wait)."""
    return (_gemv_tile(w_ptr, lo_rows, cols, n, k, stride_wn),
            _gemv_tile(w_ptr, hi_rows, cols, n, k, stride_wn))


@triton.jit
def _pair_products(w_lo, w_hi, x, s_lo, b_lo, s_hi, b_hi, HAS_SCALE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ty: tl.constexpr):
    """Both halves' products (scaled, + bias: each half's `_row_params`), rounded to `ty` as
    the GEMV output is, in float32."""
    lo = _scaled(tl.sum(w_lo.to(tl.float32) * x[None, :], axis=1), s_lo, b_lo, HAS_SCALE,
                 HAS_BIAS)
    hi = _scaled(tl.sum(w_hi.to(tl.float32) * x[None, :], axis=1), s_hi, b_hi, HAS_SCALE,
                 HAS_BIAS)
    return lo.to(ty).to(tl.float32), hi.to(ty).to(tl.float32)


@triton.jit
def _norm_gate_up_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_out_ptr, d,
                         k, stride_wn, eps, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                         HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
                         PAIRS: tl.constexpr, EARLY_NW: tl.constexpr, PDL: tl.constexpr):
    """Program p: out[i] = act(gate_i) * up_i (activation.gated_f32) for i in [PAIRS p, PAIRS (p + 1)), gate_i / up_i
    the rows i and d + i of rmsnorm(h) W^T + b (W = [gate; up], 2d rows; where d is not a
    multiple of PAIRS the last program's gate rows past d are up rows, whose results are not
    stored)."""
    i = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    cols = tl.arange(0, BLOCK_K)
    w_gate, w_up = _pair_tiles(w_ptr, i, d + i, cols, 2 * d, k, stride_wn)  # before the wait
    s_gate, b_gate = _row_params(s_ptr, b_ptr, i, 2 * d, HAS_SCALE, HAS_BIAS)
    s_up, b_up = _row_params(s_ptr, b_ptr, d + i, 2 * d, HAS_SCALE, HAS_BIAS)
    nw = _norm_weight_early(nw_ptr, cols, k, EARLY_NW)
    pdl_enter(PDL)
    nw = _norm_weight_late(nw, nw_ptr, cols, k, EARLY_NW)
    x = _normed_row(x_ptr, res_ptr, nw, res_out_ptr, cols, k, eps, HAS_RES)
    gate, up = _pair_products(w_gate, w_up, x, s_gate, b_gate, s_up, b_up, HAS_SCALE,
                              HAS_BIAS, out_ptr.dtype.element_ty)
    act = gated_f32(gate, up, ACT)
    tl.store(out_ptr + i, act.to(out_ptr.dtype.element_ty), mask=i < d)


def norm_gate_up_act(x: torch.Tensor, residual: Optional[torch.Tensor],
                     norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, pdl: bool = False,
                     weight_scale: Optional[torch.Tensor] = None,
                     pairs: Optional[int] = None, num_warps: int = 4, act: int = SILU
                     ) -> Normed:
    """The gated MLP's first half for one token in one launch: act(gate) * up (`act`:
    kernels/types.SILU or GELU_TANH) for [gate | up] = rmsnorm(x + residual) W^T + b, W =
    [gate rows; up rows] (an even number of rows); equal to `norm_gemv` followed by
    `activation.act_and_mul`. Also the new residual, as `norm_gemv`.
    FP8 weights with `weight_scale`, as `gemv`. `pairs` ((gate, up) row pairs a program, a
    power of two; default_pairs unless given), `num_warps`: the tiling
    (scripts/bench_kernels.py sweeps it)."""
    pairs = pairs or default_pairs(weight)
    n, k = weight.shape
    if n % 2:
        raise ValueError(f"gate/up weight needs an even number of rows, got {n}")
    d = n // 2
    x, res, out, res_out = _norm_gemv_io(x, residual, norm_weight, weight, d, weight_scale)
    _norm_gate_up_kernel[(triton.cdiv(d, pairs),)](
        x, res, norm_weight, weight, _or(weight_scale, weight), _or(bias, weight), out, res_out,
        d, k, weight.stride(0), eps, ACT=act, HAS_RES=residual is not None,
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None,
        BLOCK_K=triton.next_power_of_2(k), PAIRS=pairs, EARLY_NW=_fp8(weight), PDL=pdl,
        num_warps=num_warps, **launch_options(pdl))
    return Normed(out, res_out)


@triton.jit
def _norm_qkv_rope_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_out_ptr,
                          pos_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, n, k,
                          stride_wn, stride_cs, eps, n_q, n_kv, k_scale, v_scale,
                          HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr,
                          QUANT: tl.constexpr, PAIRS: tl.constexpr, EARLY_NW: tl.constexpr,
                          PDL: tl.constexpr):
    """Program p: rotary pairs j .. j + PAIRS - 1 of head p // (HALF // PAIRS), j = PAIRS *
    (p % (HALF // PAIRS)), of the fused QKV projection of rmsnorm(h): q pairs rotated into
    out, k pairs rotated into the k cache at this token's slot, v pairs copied to the v cache
    there (k and v also into out, unrotated, as the separate kernels leave them). QUANT (FP8 caches): k / k_scale and
    v / v_scale quantized as store_kv does."""
    head = tl.program_id(0) // (HALF // PAIRS)
    j = (tl.program_id(0) % (HALF // PAIRS)) * PAIRS + tl.arange(0, PAIRS)
    cols = tl.arange(0, BLOCK_K)
    lo_rows = head * (2 * HALF) + j
    w_lo, w_hi = _pair_tiles(w_ptr, lo_rows, lo_rows + HALF, cols, n, k, stride_wn)
    # The rotary factors (two dependent reads) and the slot before the wait too: the position
    # and slot are the step's inputs, complete before the forward pass's first (ordinary)
    # launch, and the tables are constant (pdl.py)
    pos = tl.load(pos_ptr).to(tl.int64)
    c = tl.load(cos_ptr + pos * (2 * HALF) + j)
    s = tl.load(sin_ptr + pos * (2 * HALF) + j)
    slot = tl.load(slots_ptr).to(tl.int64)
    s_lo, b_lo = _row_params(s_ptr, b_ptr, lo_rows, n, HAS_SCALE, HAS_BIAS)
    s_hi, b_hi = _row_params(s_ptr, b_ptr, lo_rows + HALF, n, HAS_SCALE, HAS_BIAS)
    nw = _norm_weight_early(nw_ptr, cols, k, EARLY_NW)
    pdl_enter(PDL)
    nw = _norm_weight_late(nw, nw_ptr, cols, k, EARLY_NW)
    x = _normed_row(x_ptr, res_ptr, nw, res_out_ptr, cols, k, eps, HAS_RES)
    ty = out_ptr.dtype.element_ty
    lo, hi = _pair_products(w_lo, w_hi, x, s_lo, b_lo, s_hi, b_hi, HAS_SCALE, HAS_BIAS, ty)
    rot_lo = (lo * c - hi * s).to(ty)
    rot_hi = (hi * c + lo * s).to(ty)
    heads = head + tl.zeros_like(j)  # the pair's shape for the masks
    is_q = heads < n_q
    tl.store(out_ptr + lo_rows, tl.where(is_q, rot_lo, lo.to(ty)))
    tl.store(out_ptr + lo_rows + HALF, tl.where(is_q, rot_hi, hi.to(ty)))
    v_lo, v_hi = lo.to(ty), hi.to(ty)
    if QUANT:
        rot_lo, rot_hi = quantize_kv(rot_lo, k_scale), quantize_kv(rot_hi, k_scale)
        v_lo, v_hi = quantize_kv(v_lo, v_scale), quantize_kv(v_hi, v_scale)
    cache_ty = k_cache_ptr.dtype.element_ty
    is_k = (heads >= n_q) & (heads < n_q + n_kv)
    k_row = k_cache_ptr + slot * stride_cs + (heads - n_q) * (2 * HALF) + j
    tl.store(k_row, rot_lo.to(cache_ty), mask=is_k)
    tl.store(k_row + HALF, rot_hi.to(cache_ty), mask=is_k)
    is_v = heads >= n_q + n_kv
    v_row = v_cache_ptr + slot * stride_cs + (heads - n_q - n_kv) * (2 * HALF) + j
    tl.store(v_row, v_lo.to(cache_ty), mask=is_v)
    tl.store(v_row + HALF, v_hi.to(cache_ty), mask=is_v)


def norm_qkv_rope(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor], rope: QKVRope,
                  pdl: bool = False, weight_scale: Optional[torch.Tensor] = None,
                  pairs: Optional[int] = None, num_warps: int = 4) -> Normed:
    """One token's attention input in one launch: qkv = rmsnorm(x + residual) W^T + b as
    `norm_gemv`, then q rotated in place (rotate-half), and the rotated k and v written to the
    KV cache as `rotary.rotary_qk_(..., store=...)` does, quantized for FP8 caches (k and v
    stay unrotated in qkv). W's
    rows are the q heads, then k, then v, head_dim (a power of two, at least 4) rows each. FP8
    weights with `weight_scale`, as `gemv`. `pairs` (rotary pairs a program, a power of two of
    at most head_dim / 2; default_pairs unless given), `num_warps`: the tiling
    (scripts/bench_kernels.py sweeps it)."""
    n, k = weight.shape
    dim = rope.cos.shape[1]
    pairs = pairs or min(default_pairs(weight), max(1, dim // 2))
    heads = rope.n_q + 2 * rope.n_kv
    if dim & (dim - 1) or dim < 2 * pairs or n != heads * dim:
        raise ValueError(f"norm_qkv_rope takes {heads} heads of a power-of-two head_dim ({dim}, "
                         f"at least {2 * pairs}) in its weight, got {n} rows")
    k_cache, v_cache, slots = rope.target.k_cache, rope.target.v_cache, rope.target.slots
    caches = (k_cache, v_cache)
    if (any(c.shape[1:] != (rope.n_kv, dim) or not c.is_contiguous() for c in caches)
            or v_cache.shape != k_cache.shape):
        got = [(tuple(c.shape), c.stride()) for c in caches]
        raise ValueError(f"norm_qkv_rope needs contiguous k / v caches of one shape [slots, "
                         f"{rope.n_kv}, {dim}], got (shape, strides) {got}")
    if (rope.sin.shape != rope.cos.shape or not rope.cos.is_contiguous()
            or not rope.sin.is_contiguous() or rope.positions.numel() != 1
            or slots.numel() != 1):
        raise ValueError(f"norm_qkv_rope needs contiguous cos / sin of one shape and one "
                         f"position and slot, got {tuple(rope.cos.shape)}, "
                         f"{tuple(rope.sin.shape)}, {rope.positions.numel()} positions, "
                         f"{slots.numel()} slots")
    x, res, out, res_out = _norm_gemv_io(x, residual, norm_weight, weight, n, weight_scale)
    _norm_qkv_rope_kernel[(n // (2 * pairs),)](
        x, res, norm_weight, weight, _or(weight_scale, weight), _or(bias, weight), out, res_out,
        rope.positions, rope.cos, rope.sin, slots, k_cache, v_cache, n, k,
        weight.stride(0), k_cache.stride(0), eps, rope.n_q, rope.n_kv, rope.target.k_scale,
        rope.target.v_scale, HAS_RES=residual is not None,
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None, HALF=dim // 2,
        BLOCK_K=triton.next_power_of_2(k), QUANT=rope.target.quantized, PAIRS=pairs,
        EARLY_NW=_fp8(weight), PDL=pdl, num_warps=num_warps, **launch_options(pdl))
    return Normed(out, res_out)
