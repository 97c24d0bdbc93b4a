"""The product by packed integer weights (AWQ, GPTQ, compressed-tensors W4A16 / W8A16,
repacked at load by layers/packed.py): out = x W^T + b with W dequantized tile by tile in
registers, never whole in memory.

The weight of N outputs and K inputs is held as
- `qweight` [ceil(K / P), N] int32: P = 32 / bits values a word along the inputs, input k of
  output n at bits (k % P) * bits of word [k // P, n] (GPTQ's own layout, whatever the
  checkpoint's);
- `scales` [G, N] float32 and `zeros` [G, N] float16 (whole numbers): group g's factor and zero
  point for each output;
- `g_idx` [K] int32: each input's group (act-order checkpoints permute them; else k // size).
W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], in float32, then rounded to x's
dtype for the tensor-core product (as a dense checkpoint dequantized to that dtype is), which
accumulates in float32.

Nothing reads a value back to the host, so decode CUDA graphs capture it. This module imports
triton: only GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from minisgl.kernels.dot import dot, f32_dot, swizzled_tile


class IntTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def int_tiles(m: int) -> IntTiles:
    """Tiles by the batch's rows: a decode batch of a few rows wastes little of a 16-row tile
    (not yet tuned on a GPU)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return IntTiles(block_m, 64 if m <= 64 else 128, 64, 4 if block_m <= 64 else 8, 3)


@triton.jit
def _int_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, m, n, k, stride_xm,
                   stride_qk, stride_sg, stride_om, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out: each K tile's weights unpacked from their words
    (a word serves P consecutive inputs), dequantized by their group's scale and zero point,
    and multiplied."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m, pid_n = swizzled_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, SWIZZLE)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        in_k = kk < k
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & col_ok[None, :]
        words = tl.load(q_ptr + (kk // PER_WORD).to(tl.int64)[:, None] * stride_qk
                        + cols[None, :], mask=w_mask, other=0)
        q = (words >> ((kk % PER_WORD) * BITS)[:, None]) & MASK
        group = tl.load(g_ptr + kk, mask=in_k, other=0).to(tl.int64)
        at = group[:, None] * stride_sg + cols[None, :]
        s = tl.load(s_ptr + at, mask=w_mask, other=0.0)
        z = tl.load(z_ptr + at, mask=w_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - z) * s).to(a.dtype)
        acc += dot(a, w, F32_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def check_packed(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 experts: Optional[int] = None) -> None:
    """ValueError naming the shapes unless x [M, K] (dense rows) and the packed operands fit
    together (see the module's docstring; `experts`: each with a leading [E] of them)."""
    k = x.shape[1]
    lead = () if experts is None else (experts,)
    n, groups = qweight.shape[-1], scales.shape[-2]
    words = -(-k // (32 // bits)) if bits in (4, 8) else -1
    shapes = [tuple(t.shape) for t in (qweight, scales, zeros, g_idx)]
    want = [(*lead, words, n), (*lead, groups, n), (*lead, groups, n), (*lead, k)]
    dense = all(t.is_contiguous() for t in (qweight, scales, zeros, g_idx))
    if shapes != want or qweight.dtype != torch.int32 or x.stride(1) != 1 or not dense:
        raise ValueError(f"x {tuple(x.shape)} (strides {x.stride()}) by {bits}-bit packed "
                         f"weights wants dense qweight (int32), scales, zeros, g_idx of shapes "
                         f"{want}; got {qweight.dtype} {shapes}")


def int_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           g_idx: torch.Tensor, bits: int, bias: Optional[torch.Tensor] = None,
           tiles: Optional[IntTiles] = None) -> torch.Tensor:
    """x [M, K] times the packed weight (see the module's docstring) transposed, plus bias:
    [M, N] in x's dtype. ValueError naming the shapes where the parts do not fit."""
    m, k = x.shape
    n = qweight.shape[1]
    check_packed(x, qweight, scales, zeros, g_idx, bits)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = tiles or int_tiles(m)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _int_mm_kernel[grid](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else scales, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), BITS=bits,
        HAS_BIAS=bias is not None, F32_DOT=f32_dot(x), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SWIZZLE=8, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    return out
