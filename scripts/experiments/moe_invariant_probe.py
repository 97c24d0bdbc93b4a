"""Where a batch-invariant fused MoE loses invariance on CUDA (forty-eighth session, unrun).

That session wired deterministic inference's experts through the fused kernels with fixed tiles
(every K tile 64 deep, blocks of 64 rows, 128 on sm_90 past 96 rows an expert) and each token's
choices added in routing order in float32. On an H100 the kernel-level check passed (a
Qwen3-30B-A3B layer's rows 0, mid and last alone and among 64, 300 and 2,048 tokens: the same
bf16 bits; so did the default tiles), yet the engine test (tests/test_gpu.py
test_gpu_deterministic_inference_with_experts, the tiny Qwen3-MoE: hidden 64, intermediate 32,
8 experts, top 2) failed, and passed with the torch path: the engine keeps the torch path.
This probe checks every row of both shapes, for the routing kernel and for the grouped GEMMs,
alone, in 16-row chunks and in the whole batch; it prints the rows that differ. On the H100
none did (RESULTS.md, forty-eighth session, command 3): the engine's use of the kernels is what
to bisect next, with scripts/experiments/fused_invariant_moe.patch applied (the withdrawn
wiring) and the engine test run with cuda_graph_max_bs 0, prefill_graph_max_tokens 0 and
mixed_steps off, one at a time.

    PYTHONPATH=. python3 scripts/experiments/moe_invariant_probe.py
"""

from __future__ import annotations

from typing import Callable, List

import torch

from minisgl.kernels import moe
from minisgl.kernels.types import GemmTiles, MoETiles
from minisgl.layers.moe import route

SMALL = MoETiles(64, GemmTiles(64, 64, 4, 3), GemmTiles(64, 64, 4, 3))
LARGE = MoETiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3))


def invariant_experts(x: torch.Tensor, routing: moe.Routing, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
    """The fused experts at fixed tiles, each row's choices added in order in float32."""
    m, top_k = routing.ids.shape
    tiles = LARGE if m * top_k / w13.shape[0] > 96 else SMALL
    aligned = moe.align(routing, tiles.block_m)
    act = moe.grouped_gemm(x, w13, aligned, m * top_k, top_k, tiles.gate_up, gated=True)
    out = moe.grouped_gemm(act, w2, aligned, m * top_k, 1, tiles.down, gated=False,
                           weights=routing.weights).view(m, top_k, -1)
    total = out[:, 0].float()
    for j in range(1, top_k):
        total += out[:, j]
    return total.to(x.dtype)


def rows_differing(fn: Callable[[List[int]], torch.Tensor], n: int, chunk: int) -> List[int]:
    """The rows whose fn(all rows) differs from fn over chunks of `chunk` rows."""
    whole = fn(list(range(n)))
    parts = torch.cat([fn(list(range(s, min(s + chunk, n)))) for s in range(0, n, chunk)])
    return torch.nonzero((whole != parts).reshape(n, -1).any(dim=1)).flatten().tolist()


def probe(hidden: int, inter: int, experts: int, top_k: int, tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") * 0.1).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") * 0.1).bfloat16()
    logits = torch.randn(tokens, experts, generator=g, device="cuda").bfloat16()

    def routed(idx: List[int]) -> torch.Tensor:
        r = moe.route(logits[idx], top_k, True)
        return torch.cat([r.weights, r.ids.float()], dim=1)

    def torch_routing(idx: List[int]) -> torch.Tensor:
        t = route(logits[idx].float(), top_k, True)
        return invariant_experts(x[idx], moe.routing_of(t.weights, t.ids, experts), w13, w2)

    def kernel_routing(idx: List[int]) -> torch.Tensor:
        return invariant_experts(x[idx], moe.route(logits[idx], top_k, True), w13, w2)

    for name, fn in (("route", routed), ("experts, torch routing", torch_routing),
                     ("experts, kernel routing", kernel_routing)):
        alone, chunks = rows_differing(fn, tokens, 1), rows_differing(fn, tokens, 16)
        print(f"hidden {hidden} inter {inter} E {experts} k {top_k} tokens {tokens}: {name}: "
              f"{len(alone)} rows differ alone {alone[:8]}, {len(chunks)} in 16s {chunks[:8]}",
              flush=True)


if __name__ == "__main__":
    probe(64, 32, 8, 2, 300)
    # 600 tokens: 150 rows an expert, so the whole batch takes the 128-row tiles on sm_90
    # where its 16-row chunks take the 64-row ones (the engine's padded prefill graphs do so)
    probe(64, 32, 8, 2, 600)
    probe(2048, 768, 128, 8, 64)
