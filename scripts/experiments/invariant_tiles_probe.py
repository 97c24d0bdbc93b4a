#!/usr/bin/env python3
"""Does a row of the invariant GEMM keep its bits when the output tile changes size (BLOCK_K
and the K order fixed)? Rows of 1-64-row products at (64, 64) tiles against the same rows of
a 4,096-row product at larger tiles; and the larger tiles' microseconds against cuBLAS."""

from __future__ import annotations

import torch
import triton

import minisgl.kernels.invariant_mm as mm

BIG = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 4, 3),
       (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 64, 64, 8, 3), (128, 128, 64, 4, 4)]


def with_tiles(t, x, w):
    mm.invariant_tiles = lambda dtype: mm.InvariantTiles(*t)
    return mm.invariant_linear(x, w)


def main() -> None:
    torch.manual_seed(0)
    for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        small = {(r, m): with_tiles(BIG[0], x[r:r + m], w) for r, m in ((0, 1), (77, 1), (5, 16), (1000, 64))}
        for t in BIG:
            full = with_tiles(t, x, w)
            same = all(torch.equal(v, full[r:r + m]) for (r, m), v in small.items())
            us = triton.testing.do_bench(lambda: with_tiles(t, x, w), warmup=5, rep=30) * 1000
            cub = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w), warmup=5, rep=30) * 1000
            print(f"{n}x{k} tiles {t}: rows equal to (64,64) small products: {same}; 4096 rows "
                  f"{us:.0f} us (cuBLAS {cub:.0f})", flush=True)


if __name__ == "__main__":
    main()
