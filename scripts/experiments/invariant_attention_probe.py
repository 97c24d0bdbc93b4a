#!/usr/bin/env python3
"""Does the extend kernel give a token the same bits at other tiles (BLOCK_N fixed at 64)?
One 1,500-token request attended whole at each tiling against single tokens attended as
one-token extends (a decode row) at the small tiling, bf16, a GQA of 32 / 8 heads of 128."""

from __future__ import annotations

import torch

from minisgl.kernels.attention import extend_attention
from minisgl.kernels.types import ExtendTiles

TILES = [ExtendTiles(64, 64, 4, 2), ExtendTiles(128, 64, 4, 3), ExtendTiles(64, 64, 8, 2),
         ExtendTiles(128, 64, 8, 3), ExtendTiles(32, 64, 4, 2)]


def main() -> None:
    torch.manual_seed(0)
    dev, dt, t, h, kvh, d = "cuda", torch.bfloat16, 1500, 32, 8, 128
    k = torch.randn(t + 16, kvh, d, device=dev, dtype=dt)
    v = torch.randn(t + 16, kvh, d, device=dev, dtype=dt)
    q = torch.randn(t, h, d, device=dev, dtype=dt)
    pt = torch.arange(t + 16, device=dev, dtype=torch.int32)[None].repeat(2, 1)
    i32 = lambda *xs: torch.tensor(xs, device=dev, dtype=torch.int32)  # noqa: E731
    singles = {}
    for p in (0, 1, 63, 64, 65, 700, 1023, 1024, 1499):
        out = torch.empty(1, h, d, device=dev, dtype=dt)
        extend_attention(q[p:p + 1], k, v, pt, i32(0), i32(p), i32(1), i32(0), 1, out,
                         d ** -0.5, tiles=TILES[0])
        singles[p] = out[0]
    for tiles in TILES:
        out = torch.empty(t, h, d, device=dev, dtype=dt)
        extend_attention(q, k, v, pt, i32(0), i32(0), i32(t), i32(0), t, out, d ** -0.5,
                         tiles=tiles)
        same = {p: torch.equal(out[p], s) for p, s in singles.items()}
        print(f"{tiles}: whole-request rows equal to one-token extends: {same}", flush=True)


if __name__ == "__main__":
    main()
