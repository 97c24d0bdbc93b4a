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
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype),
             mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm over the last dimension of a contiguous x; with `residual`, normalizes x + residual
    and also returns that sum (the new residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, shape[-1]) if residual is not None else x2
    block = triton.next_power_of_2(shape[-1])
    _rmsnorm_kernel[(x2.shape[0],)](x2, res, weight, out, res_out, shape[-1], eps,
                                    HAS_RES=residual is not None, BLOCK=block,
                                    num_warps=min(16, max(1, block // 256)))
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
                                     k.shape[1], HALF=dim // 2,
                                     BLOCK_Q=triton.next_power_of_2(n_q),
                                     BLOCK_K=triton.next_power_of_2(k.shape[1]))
    return q, k


# --- small-batch matrix-vector products ----------------------------------------------------------
# At decode batch sizes of a few requests every projection reads its whole weight matrix to
# produce a handful of rows: pure memory bandwidth. One program streams a [BLOCK_N, K] stripe of
# the weight; the gated variant reads the gate and up stripes of the fused gate/up matrix and
# writes silu(gate) * up directly, so the intermediate never goes to memory.
GEMV_MAX_M = 4  # larger batches go to cuBLAS (tensor-core GEMMs pay off there)

_GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                 for bn, bk, w, s in [(16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 8, 3),
                                      (64, 256, 8, 3), (16, 256, 4, 4), (8, 1024, 4, 3)]]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows = tl.arange(0, BLOCK_M)
    offs_n64 = offs_n.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n64[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        if GATED:
            w_up = tl.load(w_ptr + (offs_n64 + N)[:, None] * stride_wn + offs_k[None, :],
                           mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            # Rows past M (BLOCK_M is a power of two) re-read the last row; never stored.
            x = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + offs_k, mask=mask_k,
                        other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
            if GATED:
                part_up = tl.sum(w_up * x[None, :], axis=1)
                acc_up += tl.where(rows[:, None] == m, part_up[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & mask_n[None, :])


# Tuned per shape on the GPU (timed once, at the first call: the CUDA-graph warm-up); Triton's
# CPU interpreter cannot time kernels, so there the first configuration runs.
_gemv_tuned = triton.autotune(configs=_GEMV_CONFIGS, key=["M", "N", "K", "GATED"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M, rows dense) times weight [N, K]^T, plus bias. `gated`: weight
    is the fused [gate; up] matrix [2N, K] and the result silu(x gate^T) * (x up^T) [M, N]."""
    m, k = x.shape
    if m > GEMV_MAX_M or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes at most {GEMV_MAX_M} dense rows, got {tuple(x.shape)}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0),
            weight.stride(0), out.stride(0))
    flags = dict(HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=triton.next_power_of_2(m))
    if x.is_cuda:
        _gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:
        cfg = _GEMV_CONFIGS[0]
        _gemv_kernel[(triton.cdiv(n, cfg.kwargs["BLOCK_N"]),)](*args, **flags, **cfg.kwargs)
    return out
