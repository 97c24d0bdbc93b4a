#!/usr/bin/env python3
"""Deterministic inference's GEMM (kernels/invariant_mm.py) at other column tiles, on the 8B
shape's projections: microseconds at 1-4,096 rows against cuBLAS, and whether each tiling's
rows stay the same bits at 1 row and at 4,096 (the invariance the engine relies on)."""

from __future__ import annotations

import torch
import triton

import minisgl.kernels.invariant_mm as mm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def bench(fn, reps: int = 50) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=reps) * 1000


def main() -> None:
    torch.manual_seed(0)
    base = mm.invariant_tiles
    for block_n in (64, 32, 16):
        mm.invariant_tiles = lambda dtype, bn=block_n: mm.InvariantTiles(64, bn, 64, 4, 3)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
            full = mm.invariant_linear(x, w)
            same = all(torch.equal(mm.invariant_linear(x[r:r + m], w), full[r:r + m])
                       for r, m in ((0, 1), (77, 1), (5, 16), (1000, 64)))
            row = []
            for m in (1, 16, 64, 512, 4096):
                t = bench(lambda: mm.invariant_linear(x[:m], w))
                c = bench(lambda: torch.nn.functional.linear(x[:m], w))
                row.append(f"{m}:{t:.1f}/{c:.1f}")
            print(f"block_n {block_n} {name:8s} invariant {same} us (ours/cublas) " + " ".join(row),
                  flush=True)
    mm.invariant_tiles = base


if __name__ == "__main__":
    main()
