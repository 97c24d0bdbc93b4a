#!/usr/bin/env python3
"""The invariant GEMM's prefill speed (forty-seventh session): the production kernel (tiles in
swizzled order, pointer steps; TMA-loaded large tiles on sm_90) against cuBLAS, and whether its
rows are the bits of a row alone (the decode path). With any argument, also the large tiles'
variants (pointer or TMA loads, 128 or 256 wide, 3 or 4 stages), each checked for the
production kernel's bits. (The forty-sixth session's kernel, compared in RESULTS.md, is
`git show 4622a42:minisgl/kernels/invariant_mm.py`.)"""

from __future__ import annotations

import sys

import torch
import triton

import minisgl.kernels.invariant_mm as mm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
VARIANTS = [(128, 128, 64, 8, 3, False), (128, 128, 64, 8, 4, False), (128, 256, 64, 8, 3, False),
            (256, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4, True),
            (128, 256, 64, 8, 3, True)]


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1000


def variants(xs: torch.Tensor, w: torch.Tensor, production: torch.Tensor) -> str:
    """Each large tiling's microseconds and whether its product is the production kernel's."""
    real, line = mm.invariant_tiles, ""
    for t in VARIANTS:
        mm.invariant_tiles = lambda dtype, rows, n, cap, t=t: mm.InvariantTiles(*t)
        eq = torch.equal(mm.invariant_linear(xs, w), production)
        line += (f"; {'TMA' if t[5] else 'ptr'} {t[:2]}w{t[3]}s{t[4]} "
                 f"{us(lambda: mm.invariant_linear(xs, w)):.0f} eq {eq}")
        mm.invariant_tiles = real
    return line


def main() -> None:
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        alone = [mm.invariant_linear(x[r:r + 1], w) for r in (0, 1000, 2047)]
        for rows in (1, 16, 64):
            print(f"{name} {rows} rows: {us(lambda: mm.invariant_linear(x[:rows], w)):.1f} us, "
                  f"cuBLAS {us(lambda: torch.nn.functional.linear(x[:rows], w)):.1f}", flush=True)
        for rows in (2048, 8192):
            xs = x[:rows]
            new = mm.invariant_linear(xs, w)
            same = all(torch.equal(a, new[r:r + 1]) for a, r in zip(alone, (0, 1000, 2047)))
            line = (f"{name} {rows} rows: cuBLAS {us(lambda: torch.nn.functional.linear(xs, w)):.0f}"
                    f" us, production {us(lambda: mm.invariant_linear(xs, w)):.0f} (rows equal "
                    f"alone {same})")
            print(line + (variants(xs, w, new) if len(sys.argv) > 1 else ""), flush=True)


if __name__ == "__main__":
    main()
