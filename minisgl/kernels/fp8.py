"""FP8 (float8_e4m3fn) kernels of the W8A8 projections: activation quantization and the scaled
GEMMs.

- `quantize_tokens`: one scale per row (token), amax / 448, or a given per-tensor (static) scale,
  and the row divided by it, saturated to +-448 and cast, in one launch.
- `quantize_groups`: the same per group of `group` columns (1 x 128 groups: the activations of
  block-scaled weights).
- `quantize_row_store`: the per-row quantization as a device function, for the kernels that
  produce a projection's input to quantize it on the way out (kernels/rmsnorm.py,
  kernels/activation.py).
- `scaled_mm`: out = (a_q * a_scale) (w_q * w_scale)^T + bias for fp8 a_q [M, K], w_q [N, K],
  with a_scale per row and w_scale per output row (rowwise), or a_scale per 1 x Bk group and
  w_scale per Bn x Bk block (block-wise; Bk is the GEMM's K tile, so each tile has one scale
  per row of a and per row of w). Accumulates in float32 and rounds once.
- `rowwise_mm`: the rowwise product by torch._scaled_mm (cuBLASLt / CUTLASS), which needs a
  bfloat16 output and K, N multiples of 16.
- `unscaled_mm` + `rescale`: the same product by torch._scaled_mm's (much faster) tensorwise
  kernels, unscaled, and the scales applied after; `rowwise_plan` picks among the three.

Nothing here reads a value back to the host or sizes a tensor from data, so the decode CUDA
graphs capture them. This module imports triton; layers import it only for CUDA tensors (and
tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.dot import swizzled_tile
from minisgl.kernels.types import FP8, FP8_MAX, FP8_MIN_AMAX as MIN_AMAX


class Quantized(NamedTuple):
    """FP8 activations and their float32 scales (x ~= values * scales, broadcast per row or per
    group)."""

    values: torch.Tensor  # [M, K] float8_e4m3fn, contiguous
    scales: torch.Tensor  # [M, 1] (per token) or [M, K / group] (per group), float32


# Triton's interpreter (the CPU tests) casts float32 to float8 wrongly (127.9 -> 64, ties away
# from zero, subnormals to zero), so there the values are rounded by hand first; a compiled
# kernel's cast is the GPU's instruction, which rounds to nearest even as torch's cast does. By
# hand it cost some twenty ALU operations a value, and the quantizing SiLU kernel was bound by
# them (RESULTS.md, fourteenth session).
_ROUND_BY_HAND = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower()
                              in ("1", "true", "on", "yes"))


@triton.jit
def _round_e4m3(y):
    """y (|y| <= 448, float32) rounded to the nearest float8_e4m3fn value, ties to even, as
    torch's cast rounds, where the cast after it would not (`_ROUND_BY_HAND`); else y."""
    if not _ROUND_BY_HAND:
        return y
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the smallest normal's step, 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    q = a / step  # exact: a power of two
    whole = tl.floor(q)
    rest = q - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    r = tl.where((rest > 0.5) | ((rest == 0.5) & odd), whole + 1.0, whole) * step
    return tl.where(y < 0, -r, r)


_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def amax_scale(amax):
    """A row's dynamic scale from its largest magnitude: amax / 448 (a tiny floor for zeros)."""
    return tl.maximum(amax, _MIN_AMAX) / _MAX


@triton.jit
def quantize_values(x, scale):
    """x (float32) / scale, saturated to +-448 and rounded onto the float8_e4m3fn grid (still
    float32; the cast after it is exact): the one formula of every per-row quantization here."""
    return _round_e4m3(tl.minimum(tl.maximum(x / scale, -_MAX), _MAX))


@triton.jit
def quantize_row_store(x, cols, mask, q_row_ptr, s_ptr):
    """A row held whole in registers (float32, masked lanes zero), quantized as
    `quantize_tokens` quantizes it: its FP8 values stored at q_row_ptr[cols], its scale at
    s_ptr. The kernels that produce a W8A8 projection's input (the RMSNorm, SiLU-and-mul)
    call it instead of storing the row, so the quantization costs no launch of its own."""
    scale = amax_scale(tl.max(tl.abs(x), axis=0))
    tl.store(q_row_ptr + cols, quantize_values(x, scale).to(q_row_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr, scale)


@triton.jit
def quantize_kv(x, scale):
    """An FP8 KV cache's value (kvcache.pool.quantize; every writer of the pool calls this
    one): x / scale in float32 (IEEE division, as torch divides), clamped to +-448 and rounded
    onto the float8_e4m3fn grid as torch's cast rounds (`_round_e4m3`), still as float32: the
    caller's cast is then exact on every target."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return _round_e4m3(tl.minimum(tl.maximum(y, -_MAX), _MAX))


def empty_quantized(m: int, k: int, device: torch.device) -> Quantized:
    """Uninitialised FP8 rows [m, k] and their per-row scales [m, 1]."""
    return Quantized(torch.empty((m, k), dtype=FP8, device=device),
                     torch.empty((m, 1), dtype=torch.float32, device=device))


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, k, stride_x, stride_s, GROUP,
                       STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, g): columns [g * GROUP, (g + 1) * GROUP) of row `row` (GROUP = k: the
    whole row). The scale is amax / FP8_MAX over them, or *static_ptr with STATIC; it is stored
    at s[row, g], and x / scale, saturated, at q."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    stop = tl.minimum(start + GROUP, k)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * k
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(start, stop, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < stop, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = amax_scale(tl.max(amax, axis=0))
    for k0 in range(start, stop, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < stop
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + cols, quantize_values(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + g, scale)


def _quantize(x: torch.Tensor, group: int, static_scale: Optional[torch.Tensor]) -> Quantized:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"FP8 quantization takes rows [M, K] with dense rows, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    m, k = x.shape
    groups = triton.cdiv(k, group)
    values = torch.empty((m, k), dtype=FP8, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return Quantized(values, scales)
    block = min(triton.next_power_of_2(group), 4096)
    static = static_scale if static_scale is not None else scales
    _quant_rows_kernel[(m, groups)](
        x, values, scales, static, k, x.stride(0), scales.stride(0), group,
        STATIC=static_scale is not None, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return Quantized(values, scales)


def quantize_tokens(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None) -> Quantized:
    """x [M, K] -> FP8 rows and their scales [M, 1]: per row (dynamic, amax / 448), or the
    per-tensor `static_scale` (a 1-element float32 tensor on x's device) for every row."""
    return _quantize(x, x.shape[-1], static_scale)


def quantize_groups(x: torch.Tensor, group: int) -> Quantized:
    """x [M, K] -> FP8 rows and scales [M, ceil(K / group)], one per 1 x group columns."""
    return _quantize(x, group, None)


class ScaledMmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_tiles(m: int, block_k: int) -> ScaledMmTiles:
    """Rows per tile by the batch's rows (a decode batch of a few rows wastes little of a 16-row
    tile); 128 x 128 weight tiles. `block_k`: the K tile, the weight-scale block's width for
    block-wise scales."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return ScaledMmTiles(block_m, 128, block_k, 4 if block_m <= 64 else 8, 3)


class RowwisePlan(NamedTuple):
    """How a rowwise-scaled FP8 product runs: "triton" (`scaled_mm` with `tiles`),
    "cublaslt" (`rowwise_mm`) or "tensorwise" (`unscaled_mm`, then the row and column scales
    applied by the kernel that reads the product, or by `rescale`)."""

    kind: str
    tiles: Optional[ScaledMmTiles] = None


TENSORWISE_MAX_ROWS = 512  # above: the rescale's pass over a wide output costs what it saves


def rowwise_plan(m: int, n: int) -> RowwisePlan:
    """The fastest way on an H200 to multiply m rows by an FP8 weight of n rows with per-row
    scales on both (RESULTS.md, thirteenth session; Llama-3.1-8B's projections, which are
    bound by their weight bytes at these sizes). cuBLASLt's rowwise kernel takes 128 x 128
    tiles at every shape (too few programs for few rows or a narrow weight) and its choice at
    137 rows is poor (gate/up 78.5 us against 38.2 for the same product unscaled); its
    tensorwise kernels are much faster.
    - up to 64 rows: Triton, weight tiles of 32 rows for n <= 4,096 (o, down: 8.8 / 23.6 us
      against cuBLASLt's 13.8 / 37.7 at 64 rows), 64 for n <= 8,192 (QKV: 10.5 against
      14.1), 256-wide K tiles; 128 x 128 tiles for wider weights (gate/up: 35.3 against
      42.8). The unscaled product and a rescale launch would cost more here;
    - 65 to TENSORWISE_MAX_ROWS rows: tensorwise (at 137 rows: down 21.1, gate/up 38.2, QKV
      12.2, o 8.7 us against the best rowwise kernels' 37.3, 56.5, 18.4, 13.2; a rescale
      launch takes about 3 us, none where SiLU-and-mul applies the scales);
    - more rows (prefill): cuBLASLt rowwise, bound by compute."""
    if m <= 64:
        block_m = gemm_tiles(m, 128).block_m
        if n <= 8192:
            return RowwisePlan("triton", ScaledMmTiles(block_m, 32 if n <= 4096 else 64, 256,
                                                       4, 4))
        return RowwisePlan("triton", ScaledMmTiles(block_m, 128, 128, 4, 3))
    if m <= TENSORWISE_MAX_ROWS:
        return RowwisePlan("tensorwise")
    return RowwisePlan("cublaslt")


@triton.jit
def _scaled_mm_kernel(a_ptr, w_ptr, out_ptr, as_ptr, ws_ptr, bias_ptr, m, n, k, stride_am,
                      stride_wn, stride_om, stride_as, stride_ws, GROUP_N,
                      BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out. Rowwise: the fp8 products accumulate over all of K
    and the scales multiply once at the end. BLOCKWISE: each K tile (BLOCK_K = the scale
    block's width) is scaled by a's group scale per row and w's block scale (row // GROUP_N)
    before it is added."""
    pid_m, pid_n = swizzled_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, SWIZZLE)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    a_tile = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(k, BLOCK_K)):
        left = k - kt * BLOCK_K
        a = tl.load(a_tile, mask=row_ok[:, None] & (ks[None, :] < left), other=0.0)
        w = tl.load(w_tile, mask=(ks[:, None] < left) & col_ok[None, :], other=0.0)
        if BLOCKWISE:
            a_s = tl.load(as_ptr + rows * stride_as + kt, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptr + (cols // GROUP_N) * stride_ws + kt, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            acc = tl.dot(a, w, acc)
        a_tile += BLOCK_K
        w_tile += BLOCK_K
    if not BLOCKWISE:
        a_s = tl.load(as_ptr + rows * stride_as, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def scaled_mm(a: Quantized, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype,
              block: Optional[Tuple[int, int]] = None,
              tiles: Optional[ScaledMmTiles] = None) -> torch.Tensor:
    """(a.values * a.scales) (weight * weight_scale)^T + bias, [M, N] in `out_dtype`.

    Rowwise (block None): a.scales [M, 1], weight_scale [N]. Block-wise (block (Bn, Bk)):
    a.scales [M, ceil(K / Bk)] (quantize_groups with group Bk), weight_scale
    [ceil(N / Bn), ceil(K / Bk)]. `tiles`: gemm_tiles unless given (block-wise, their block_k
    must be Bk; scripts/bench_kernels.py sweeps them)."""
    m, k = a.values.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or weight.dtype != FP8:
        raise ValueError(f"scaled_mm takes an FP8 weight [N, {k}] with dense rows, got "
                         f"{weight.dtype} {tuple(weight.shape)}, strides {weight.stride()}")
    want_a: Tuple[int, ...]
    want_w: Tuple[int, ...]
    if block is None:
        want_a, want_w = (m, 1), (n,)
    else:
        want_a = (m, triton.cdiv(k, block[1]))
        want_w = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(a.scales.shape) != want_a or tuple(weight_scale.shape) != want_w:
        raise ValueError(f"scaled_mm with {'block ' + str(block) if block else 'rowwise'} "
                         f"scales wants activation scales {want_a} and weight scales {want_w}, "
                         f"got {tuple(a.scales.shape)} and {tuple(weight_scale.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.values.device)
    if m == 0:
        return out
    tiles = tiles or gemm_tiles(m, block[1] if block is not None else 128)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    ws = weight_scale if block is not None else weight_scale.contiguous()
    _scaled_mm_kernel[grid](
        a.values, weight, out, a.scales, ws, bias if bias is not None else ws, m, n, k,
        a.values.stride(0), weight.stride(0), out.stride(0), a.scales.stride(0),
        ws.stride(0) if block is not None else 0, block[0] if block is not None else 1,
        BLOCKWISE=block is not None, HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SWIZZLE=8, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out


def rowwise_mm_applies(k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether `rowwise_mm` takes this shape and dtype (torch._scaled_mm's rowwise scaling needs
    a bfloat16 output and K, N multiples of 16)."""
    return out_dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0


def rowwise_mm(a: Quantized, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`scaled_mm` rowwise by torch._scaled_mm, bfloat16 out (see rowwise_mm_applies). The
    weight [N, K] row-major is the column-major [K, N] operand cuBLASLt wants, as is."""
    return torch._scaled_mm(a.values, weight.t(), scale_a=a.scales,
                            scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=torch.bfloat16)


def unscaled_mm(a: torch.Tensor, weight: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """a [M, K] (FP8) times weight [N, K] (FP8)^T, unscaled, in bfloat16 [M, N], by
    torch._scaled_mm's tensorwise kernels (cuBLASLt); `unit` is a 1-element float32 one on the
    device (a persistent tensor: a graph captures no fill for it). The row and column scales
    are applied by the reader (`rescale`, or the SiLU kernel); the extra rounding to bfloat16
    before them is far below the activations' FP8 rounding. K and N multiples of 16."""
    return torch._scaled_mm(a, weight.t(), scale_a=unit, scale_b=unit,
                            out_dtype=torch.bfloat16)


@triton.jit
def _rescale_kernel(x_ptr, rs_ptr, cs_ptr, b_ptr, out_ptr, n, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Program (row, block): out = x * rs[row] * cs[cols] (+ b[cols]) in float32, rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.load(rs_ptr + row) * tl.load(cs_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rescale(x: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
            bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, N] (dense) * row_scale [M, 1] * col_scale [N] (+ bias [N]) in `out_dtype`, one
    launch: the scales of an `unscaled_mm` product."""
    m, n = x.shape
    if not x.is_contiguous() or row_scale.numel() != m or col_scale.numel() != n:
        raise ValueError(f"rescale takes a dense [M, N] product, M row scales and N column "
                         f"scales; got {tuple(x.shape)} (strides {x.stride()}), "
                         f"{row_scale.numel()} and {col_scale.numel()}")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        block = min(2048, triton.next_power_of_2(n))
        _rescale_kernel[(m, triton.cdiv(n, block))](
            x, row_scale, col_scale, bias if bias is not None else col_scale, out, n,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
