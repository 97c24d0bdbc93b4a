#!/usr/bin/env python3
"""The invariant GEMM's prefill speed (forty-seventh session): the kernel with swizzled tiles
and pointer steps against the forty-sixth session's (invariant_mm_v0.py, a snapshot kept
untracked for the probe), at several large tiles, against cuBLAS; and whether every variant's
rows are the bits of a row alone (the decode path)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).parent))
import invariant_mm_v0 as v0  # noqa: E402

import minisgl.kernels.invariant_mm as mm  # noqa: E402
from minisgl.kernels.dot import swizzled_tile  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
         (128, 256, 64, 8, 4)]


@triton.jit(do_not_specialize=["m"])
def _tma_kernel(x_desc, w_desc, out_ptr, m, n, k, splits, span, stride_om,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SWIZZLE: tl.constexpr):
    pid_m, pid_n = swizzled_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, SWIZZLE)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(0, splits):
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(r * span, tl.minimum(r * span + span, k), BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            acc += tl.dot(a, w.T)
        total += acc
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             total.to(out_ptr.dtype.element_ty), mask=mask)


def tma_linear(x, w, t):
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages = t
    splits = mm.k_splits(n, k, bk, torch.cuda.get_device_properties(0).multi_processor_count)
    span = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, span)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _tma_kernel[grid](xd, wd, out, m, n, k, splits, span, out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, SWIZZLE=8, num_warps=warps, num_stages=stages)
    return out


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1000


def main() -> None:
    torch.manual_seed(0)
    real = mm.invariant_tiles
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        alone = [mm.invariant_linear(x[r:r + 1], w) for r in (0, 1000, 2047)]
        for rows in (1, 16, 64):
            print(f"{name} {rows} rows: v0 {us(lambda: v0.invariant_linear(x[:rows], w)):.1f} us, "
                  f"new {us(lambda: mm.invariant_linear(x[:rows], w)):.1f}, cuBLAS "
                  f"{us(lambda: torch.nn.functional.linear(x[:rows], w)):.1f}", flush=True)
        for rows in (2048, 8192):
            xs = x[:rows]
            old = v0.invariant_linear(xs, w)
            same_v0 = all(torch.equal(a, old[r:r + 1]) for a, r in zip(alone, (0, 1000, 2047)))
            new = mm.invariant_linear(xs, w)
            line = (f"{name} {rows} rows: cuBLAS {us(lambda: torch.nn.functional.linear(xs, w)):.0f} us, "
                    f"v0 {us(lambda: v0.invariant_linear(xs, w)):.0f} (rows equal alone: {same_v0}), "
                    f"production {us(lambda: mm.invariant_linear(xs, w)):.0f} eq {torch.equal(new, old)}")
            if len(sys.argv) < 2:
                print(line, flush=True)
                continue
            for t in TILES:
                mm.invariant_tiles = lambda dtype, r, n, cap, t=t: mm.InvariantTiles(*t, False)
                try:
                    out = mm.invariant_linear(xs, w)
                    eq = torch.equal(out, old)
                    line += f"; {t[:2]}w{t[3]}s{t[4]} {us(lambda: mm.invariant_linear(xs, w)):.0f} eq {eq}"
                except Exception as e:  # noqa: BLE001 (a probe: record and go on)
                    line += f"; {t} failed {type(e).__name__}: {str(e)[:80]}"
                mm.invariant_tiles = real
            for t in TILES[:3]:
                try:
                    out = tma_linear(xs, w, t)
                    eq = torch.equal(out, old)
                    line += f"; TMA {t[:2]}w{t[3]}s{t[4]} {us(lambda: tma_linear(xs, w, t)):.0f} eq {eq}"
                except Exception as e:  # noqa: BLE001 (a probe: record and go on)
                    line += f"; TMA {t} failed {type(e).__name__}: {str(e)[:120]}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
