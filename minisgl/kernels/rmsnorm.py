"""RMSNorm in Triton: `rmsnorm`, the RMSNorm layer's kernel on CUDA (with the residual add), and
the tail every RMSNorm kernel shares: normalize one row held in registers (and store it).

The tail is shared by `rmsnorm` (the norm after a finished all-reduce), gemv.py (the norm inside
the one-token GEMV), allreduce.py (the norm fused into the all-reduce) and rotary.py (the per-head
q/k norms before the rotation), so that all round in exactly the same places. It must stay the
only copy of this arithmetic. The reduction order of `tl.sum` also follows the kernel's launch
width: the norm kernels launch with `rmsnorm_warps`, so a fused all-reduce step gives the same
bits as the two-kernel one; the GEMV and the rotary kernel sum in their own order, so their norms
can differ from the RMSNorm kernel's in the last bit. This module imports triton: only GPU
paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8 import Quantized, empty_quantized, quantize_row_store
from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.types import ProductScales


def rmsnorm_warps(block: int) -> int:
    """Warps of an RMSNorm kernel whose program holds one row of `block` columns."""
    return min(16, max(1, block // 256))


@triton.jit
def rms_inv(sum_squares, n_cols, eps):
    """1 / sqrt(mean(x^2) + eps) from the float32 sum of squares of a row's n_cols values."""
    return 1.0 / tl.sqrt(sum_squares / n_cols + eps)


@triton.jit
def rms_apply(xf, inv, w, dtype: tl.constexpr):
    """xf (float32) times its row's `inv` rounded to `dtype`, then times the weight w in
    float32 and rounded again (the reference implementation's two roundings)."""
    normed = (xf * inv).to(dtype)
    return (normed.to(tl.float32) * w.to(tl.float32)).to(dtype)


@triton.jit
def rmsnorm_row(x, w_ptr, cols, mask, n_cols, eps):
    """rmsnorm(x) * w in x's dtype: x [BLOCK] in the output dtype (masked lanes zero); float32
    math (`rms_inv`, `rms_apply`)."""
    return rmsnorm_row_w(x, tl.load(w_ptr + cols, mask=mask, other=0.0), n_cols, eps)


@triton.jit
def rmsnorm_row_w(x, w, n_cols, eps):
    """`rmsnorm_row` with its weight already loaded (w [BLOCK], masked lanes zero): a kernel
    under PDL loads it before its wait (a parameter), not after the sum of squares."""
    xf = x.to(tl.float32)
    inv = rms_inv(tl.sum(xf * xf, axis=0), n_cols, eps)
    return rms_apply(xf, inv, w, x.dtype)


@triton.jit
def rmsnorm_row_store(x, w_ptr, out_row_ptr, cols, mask, n_cols, eps):
    """Store `rmsnorm_row(x, ...)` at out_row_ptr[cols]."""
    tl.store(out_row_ptr + cols, rmsnorm_row(x, w_ptr, cols, mask, n_cols, eps), mask=mask)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, rs_ptr, cs_ptr,
                    n_cols, stride_x, stride_res, eps, HAS_RES: tl.constexpr,
                    QUANT: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """Program `row`: the row's norm into out; QUANT: quantized per row instead (out FP8, its
    scale at scale_ptr[row]), the values rounded to x's dtype first as the stored norm is.
    SCALED: x is an FP8 product taken unscaled, first multiplied by rs[row] and cs[cols] in
    float32 and rounded to its dtype, as fp8.rescale would."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SCALED:
        y = x.to(tl.float32) * tl.load(rs_ptr + row) * tl.load(cs_ptr + cols, mask=mask,
                                                                other=0.0)
        x = y.to(x.dtype)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    if QUANT:
        normed = rmsnorm_row(x, w_ptr, cols, mask, n_cols, eps).to(tl.float32)
        quantize_row_store(normed, cols, mask, out_ptr + row * n_cols, scale_ptr + row)
    else:
        rmsnorm_row_store(x, w_ptr, out_ptr + row * n_cols, cols, mask, n_cols, eps)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with dense rows (a copy only where no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None, pdl: bool = False,
            scales: Optional[ProductScales] = None
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm over the last dimension of x; with `residual`, normalizes x + residual and also
    returns that sum (the new residual). Outputs are contiguous. Rows may be strided: the
    per-head q/k norms see views of the fused QKV output, and with one head per rank
    `reshape` keeps such a view (row stride = the QKV width) instead of copying it.
    `scales`: x [M, N] is an unscaled FP8 product (fp8.unscaled_mm) whose value is
    x * row [M, 1] * col [N], applied here exactly as fp8.rescale applies them."""
    shape = x.shape
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = _launch(x2, weight, eps, residual, pdl, out, out, scales)
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


def rmsnorm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: Optional[torch.Tensor] = None, pdl: bool = False,
                      scales: Optional[ProductScales] = None
                      ) -> Tuple[Quantized, Optional[torch.Tensor]]:
    """`rmsnorm` with its output quantized per row (fp8.quantize_tokens of it, exactly) in the
    same launch: the input of a W8A8 projection as FP8 rows [M, K] and scales [M, 1]; the new
    residual as `rmsnorm` returns it. `scales` as for `rmsnorm`."""
    shape = x.shape
    x2 = _rows(x)
    out = empty_quantized(x2.shape[0], x2.shape[1], x.device)
    res_out = _launch(x2, weight, eps, residual, pdl, out.values, out.scales, scales)
    return out, (res_out.view(shape) if residual is not None else None)


def _launch(x2: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor], pdl: bool, out: torch.Tensor,
            out_scales: torch.Tensor, scales: Optional[ProductScales]) -> torch.Tensor:
    """The norm kernel over rows x2 into `out` (FP8 with per-row `out_scales`, or x2's dtype);
    returns the new residual (`out` where there is none)."""
    m, n = x2.shape
    if scales is not None and (scales.row.numel() != m or scales.col.numel() != n):
        raise ValueError(f"an unscaled product [{m}, {n}] takes {m} row scales and {n} column "
                         f"scales, got {scales.row.numel()} and {scales.col.numel()}")
    res_out = torch.empty_like(x2) if residual is not None else out
    res = _rows(residual) if residual is not None else x2
    rs, cs = scales if scales is not None else (out_scales, out_scales)
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(m,)](x2, res, weight, out, res_out, out_scales, rs, cs, n, x2.stride(0),
                          res.stride(0), eps, HAS_RES=residual is not None,
                          QUANT=out.dtype == torch.float8_e4m3fn, SCALED=scales is not None,
                          BLOCK=block, PDL=pdl, num_warps=rmsnorm_warps(block),
                          **launch_options(pdl))
    return res_out
