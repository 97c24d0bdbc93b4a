"""LoRA's expand product in Triton: y + (low * mask) B^T in one kernel, where torch takes two
(the mask's multiply, then addmm). `low` [T, S * C] is every token's low-rank input under each of
S adapters (the shrink product, cuBLAS's), `mask` [T, S] keeps each token's own adapter's C
columns, B [N, S * C] is the adapters' expand matrices side by side (layers/lora.py). The low
rank is small (S * C of at most a few hundred columns), so a program holds a whole row block
of `low` and the B tile it needs: no loop, one dot. On a decode step this is a few hundred
launches fewer. This module imports triton: only GPU paths (and the CPU interpreter tests)
import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.dot import dot, f32_dot

MAX_LOW_COLUMNS = 512  # S * C beyond which the torch path runs (a program holds them all)


@triton.jit
def _expand_add_kernel(low_ptr, mask_ptr, b_ptr, y_ptr, out_ptr, t, n, kc, c,
                       stride_low, stride_mask, stride_b, stride_y, stride_out,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       F32_DOT: tl.constexpr):
    """Program (row block, column block): out = y + (low * mask[:, column // c]) B^T on its
    tile, accumulated in float32 and rounded once (as addmm)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    row_ok, col_ok, r_ok = rows < t, cols < n, r < kc
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    low_ok = row_ok[:, None] & r_ok[None, :]
    low = tl.load(low_ptr + rows64[:, None] * stride_low + r[None, :], mask=low_ok, other=0.0)
    keep = tl.load(mask_ptr + rows64[:, None] * stride_mask + (r // c)[None, :], mask=low_ok,
                   other=0.0)
    low = (low * keep).to(b_ptr.dtype.element_ty)
    b = tl.load(b_ptr + cols64[:, None] * stride_b + r[None, :],
                mask=col_ok[:, None] & r_ok[None, :], other=0.0)
    acc = dot(low, tl.trans(b), F32_DOT)
    tile = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptr + rows64[:, None] * stride_y + cols64[None, :], mask=tile, other=0.0)
    tl.store(out_ptr + rows64[:, None] * stride_out + cols64[None, :],
             (y.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=tile)


def expand_add(y: torch.Tensor, low: torch.Tensor, mask: torch.Tensor, b: torch.Tensor,
               columns: int) -> torch.Tensor:
    """y [T, N] + (low [T, S * columns] with each row's columns of adapter s scaled by
    mask[t, s]) @ b [N, S * columns]^T: a new tensor in y's dtype. The caller keeps S * columns
    within MAX_LOW_COLUMNS; all operands are on one device, their last dimensions contiguous."""
    t, kc = low.shape
    n = y.shape[1]
    if kc > MAX_LOW_COLUMNS or b.shape != (n, kc) or mask.shape != (t, kc // columns):
        raise ValueError(f"LoRA expand: low {tuple(low.shape)}, mask {tuple(mask.shape)}, "
                         f"B {tuple(b.shape)}, y {tuple(y.shape)}, {columns} columns an "
                         f"adapter (at most {MAX_LOW_COLUMNS} in all)")
    y, mask = y.contiguous(), mask.contiguous()
    out = torch.empty_like(y)
    block_t = 16 if t <= 16 else 32
    block_n = 64
    block_r = max(16, triton.next_power_of_2(kc))
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    _expand_add_kernel[grid](low, mask, b, y, out, t, n, kc, columns,
                             low.stride(0), mask.stride(0), b.stride(0), y.stride(0),
                             out.stride(0), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r,
                             F32_DOT=f32_dot(b))
    return out
