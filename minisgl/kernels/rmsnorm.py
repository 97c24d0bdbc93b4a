"""The tail of every RMSNorm Triton kernel: normalize one row held in registers (and store it).

Shared by layers/triton_ops.py (the norm after a finished all-reduce), layers/triton_gemv.py
(the norm inside the one-token GEMV) and distributed/symm_kernels.py (the norm fused into the
all-reduce), so that all round in exactly the same places. It must stay the only copy of this
arithmetic. The reduction order of `tl.sum` also follows the kernel's launch width: the norm
kernels launch with `rmsnorm_warps`, so a fused all-reduce step gives the same bits as the
two-kernel one; the GEMV launches with its own width, so its norm can differ from theirs in the
last bit. This module imports triton: only GPU kernel modules (and the CPU interpreter tests)
import it.
"""

from __future__ import annotations

import triton
import triton.language as tl


def rmsnorm_warps(block: int) -> int:
    """Warps of an RMSNorm kernel whose program holds one row of `block` columns."""
    return min(16, max(1, block // 256))


@triton.jit
def rmsnorm_row(x, w_ptr, cols, mask, n_cols, eps):
    """rmsnorm(x) * w in x's dtype: x [BLOCK] in the output dtype (masked lanes zero); float32
    math, x * rsqrt(mean(x^2) + eps) rounded to the dtype, then times the weight in float32 and
    rounded again (the reference implementation's two roundings)."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)


@triton.jit
def rmsnorm_row_store(x, w_ptr, out_row_ptr, cols, mask, n_cols, eps):
    """Store `rmsnorm_row(x, ...)` at out_row_ptr[cols]."""
    tl.store(out_row_ptr + cols, rmsnorm_row(x, w_ptr, cols, mask, n_cols, eps), mask=mask)
