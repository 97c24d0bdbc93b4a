"""Fused elementwise kernels for the GPU decode path: RMSNorm (with the residual add), SiLU-and-mul
and rotary embedding (q and k together), each one launch instead of the 5 to 15 small kernels of
the torch version.

At batch 1 a decode step is some 1,400 tiny kernels, each costing a few microseconds even inside
a CUDA graph; fusing these three halves that count. They compute in float32 and round once, so
results can differ from the torch path in the last bit of bfloat16; the CPU path (exact against
the reference in float32) never calls them. This module imports triton; layers import it only
for CUDA tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res,
                    eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype),
             mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with dense rows (a copy only where no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None
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
                                    BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] (contiguous) -> silu(gate) * up."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, BLOCK=block)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rotate_heads(base, cos, sin, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate `n_heads` dense [head_dim] vectors starting at `base`, in place."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    hmask = heads[:, None] < n_heads
    ptrs = base + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(ptrs, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=hmask, other=0.0).to(tl.float32)
    ty = base.dtype.element_ty
    tl.store(ptrs, (x1 * cos - x2 * sin).to(ty), mask=hmask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(ty), mask=hmask)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_q, stride_k, n_q, n_k,
                      HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * (2 * HALF) + dims)[None, :]
    sin = tl.load(sin_ptr + pos * (2 * HALF) + dims)[None, :]
    _rotate_heads(q_ptr + tok * stride_q, cos, sin, n_q, HALF, BLOCK_Q)
    _rotate_heads(k_ptr + tok * stride_k, cos, sin, n_k, HALF, BLOCK_K)


def _check_rotary_layout(x: torch.Tensor) -> None:
    _, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim & (dim - 1):
        raise ValueError("rotary needs x[t] to be a dense [heads, head_dim] block, head_dim a "
                         "power of two")


def rotary_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place, in one
    launch (rotate-half layout); cos/sin are float32 [max_positions, head_dim] caches. Each
    token's heads must be one dense block (q and k may be views of one fused QKV output)."""
    _check_rotary_layout(q)
    _check_rotary_layout(k)
    tokens, n_q, dim = q.shape
    if tokens:
        _rotary_qk_kernel[(tokens,)](q, k, positions, cos, sin, q.stride(0), k.stride(0), n_q,
                                     k.shape[1], HALF=dim // 2, BLOCK_Q=triton.next_power_of_2(n_q),
                                     BLOCK_K=triton.next_power_of_2(k.shape[1]))
    return q, k

