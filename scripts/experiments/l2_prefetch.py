"""Issue 22 experiment (batch-1 FP8 decode): fill L2 with the next weights while the batch-1
attention runs.

At batch 1 the decode attention (context 512) is latency-bound: ~6.4 us a layer during which
DRAM is nearly idle, followed by o_proj's GEMV (16.8 MB of FP8 weights, DRAM-bound). If the
attention's window is used to bring o_proj's weights (and the start of gate/up's) into L2
(50 MB on an H200), o_proj then reads L2 instead of DRAM. This measures one Llama-3.1-8B layer's
chain, QKV GEMV -> attention -> o_proj -> gate/up -> down (FP8 weights, FP8 KV, PDL, distinct
weights and KV per layer, so that nothing stays in L2 from one layer to the next), 32 layers in
a CUDA graph, with and without a prefetch kernel launched (PDL) just before the attention:

- `bulk`: `cp.async.bulk.prefetch.L2.global [addr], CHUNK` (sm_90), one per CHUNK bytes;
- `line`: `prefetch.global.L2::evict_last [addr]`, one per 128-byte line.

The prefetch kernel issues its prefetches before its PDL wait (weights are never written, so
they may be read before it: kernels/pdl.py), then waits and lets the attention launch, so the
chain's ordering stays transitive. Outputs are checked equal to the chain without prefetch.

    python3 scripts/experiments/l2_prefetch.py --compile-only   # here: the PTX holds the prefetch
    python3 scripts/experiments/l2_prefetch.py                  # on the H200
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Tuple

import triton
import triton.language as tl

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
LINE = 128


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROG: tl.constexpr,
                     BULK: tl.constexpr, LATE: tl.constexpr):
    if LATE:  # issue the prefetches once QKV is done: inside the attention's window
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = (pid * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * CHUNK
    live = (offs < nbytes).to(tl.int32)
    addr = ptr + offs
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,r", [addr, live, tl.full([PER_PROG], CHUNK, tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
            "=r,l,r", [addr, live], dtype=tl.int32, is_pure=False, pack=1)
    if not LATE:
        # early: issued while QKV may still stream; the attention after this may launch once
        # the kernel before (QKV) has finished, so that the chain's ordering stays transitive
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def prefetch(spans: List[Tuple[object, int]], chunk: int, bulk: bool, late: bool,
             per_prog: int = 64) -> None:
    """Issue L2 prefetches over each (tensor, bytes) span, from the tensor's first byte."""
    for t, nbytes in spans:
        chunks = triton.cdiv(nbytes, chunk)
        _prefetch_kernel[(triton.cdiv(chunks, per_prog),)](
            t, nbytes, CHUNK=chunk, PER_PROG=per_prog, BULK=bulk, LATE=late, num_warps=2,
            launch_pdl=True)


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for bulk in (True, False):
        src = ASTSource(_prefetch_kernel, {"ptr": "*u8", "nbytes": "i64", "CHUNK": "constexpr",
                                           "PER_PROG": "constexpr", "BULK": "constexpr",
                                           "LATE": "constexpr"},
                        {"CHUNK": 4096 if bulk else LINE, "PER_PROG": 64, "BULK": bulk,
                         "LATE": True})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
        ptx = k.asm["ptx"]
        lines = [ln.strip() for ln in ptx.splitlines()]
        lines = [ln for ln in lines if ("prefetch" in ln or "griddepcontrol" in ln)
                 and not ln.startswith((".", "//", "@_"))]
        print(f"bulk={bulk}:", *lines[:6], sep="\n  ")


def run_on_gpu(layers: int, context: int) -> None:
    import torch
    sys.path.insert(0, "scripts")
    sys.path.insert(0, ".")
    from bench_kernels import Shape, paged_kv, time_graph
    from minisgl.kernels import gemv as G
    from minisgl.kernels.attention import decode_attention
    out_dir = os.environ.get("OUT", "/tmp/out")
    log = open(f"{out_dir}/l2_prefetch.txt", "a")

    def say(*a: object) -> None:
        s = " ".join(str(v) for v in a)
        print(s, flush=True)
        log.write(s + "\n")
        log.flush()

    torch.manual_seed(0)
    dev = "cuda"
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def fp8(n: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        return w, torch.rand(n, device=dev) + 0.5

    mats = [dict(qkv=fp8(qkv_rows, HIDDEN), o=fp8(HIDDEN, HIDDEN), gu=fp8(2 * INTER, HIDDEN),
                 down=fp8(HIDDEN, INTER)) for _ in range(layers)]
    shape = Shape(HEADS, KV_HEADS, HEAD_DIM)
    kvs = [paged_kv(shape, [context], 16, i, "fp8") for i in range(layers)]
    seq_lens = torch.tensor([context], dtype=torch.int32, device=dev)
    splits = 32
    o_part = torch.empty((1, HEADS, splits, HEAD_DIM), dtype=torch.float32, device=dev)
    lse = torch.empty((1, HEADS, splits), dtype=torch.float32, device=dev)
    arrivals = torch.zeros((1, KV_HEADS), dtype=torch.int32, device=dev)
    attn = torch.empty((1, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    x0 = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16) * 0.1
    scale = HEAD_DIM ** -0.5

    def step(pre: Callable[[dict], None]) -> torch.Tensor:
        x = x0
        for m, kv in zip(mats, kvs):
            qkv = G.gemv(x, m["qkv"][0], pdl=True, weight_scale=m["qkv"][1])
            q = qkv[:HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
            pre(m)
            decode_attention(q, kv.k, kv.v, kv.page_table, kv.rows, seq_lens, o_part, lse,
                             attn, scale, 64, pdl=True, arrivals=arrivals)
            o = G.gemv(attn.view(HIDDEN), m["o"][0], pdl=True, weight_scale=m["o"][1])
            gu = G.gemv(o, m["gu"][0], pdl=True, weight_scale=m["gu"][1])
            x = G.gemv(gu[:INTER], m["down"][0], pdl=True, weight_scale=m["down"][1])
        return x

    def none(m: dict) -> None:
        return None

    ref = step(none).float()
    torch.cuda.synchronize()
    base = time_graph(lambda: step(none), 1, 30)
    say(f"{layers} layers, context {context}: no prefetch {base:8.1f} us "
        f"({base / layers:.2f} us a layer)")
    o_bytes = HIDDEN * HIDDEN
    variants = [(True, 4096, 0, True), (True, 4096, 0, False), (True, 65536, 0, True),
                (False, LINE, 0, True), (True, 4096, 8, True), (True, 4096, 16, True),
                (False, LINE, 16, True)]
    for bulk, size, extra_mb, late in variants:
        def pre(m: dict, size: int = size, bulk: bool = bulk, extra_mb: int = extra_mb,
                late: bool = late) -> None:
            spans = [(m["o"][0], o_bytes)]
            if extra_mb:
                spans.append((m["gu"][0], extra_mb << 20))
            prefetch(spans, size, bulk, late)
        try:
            got = step(pre).float()
            torch.cuda.synchronize()
            diff = (got - ref).abs().max().item()
            us = time_graph(lambda: step(pre), 1, 30)
            say(f"{'bulk' if bulk else 'line'} {'late ' if late else 'early'} chunk {size:6d} "
                f"o_proj + {extra_mb:2d} MB of "
                f"gate/up: {us:8.1f} us ({us / layers:.2f} a layer, {us - base:+.1f} us)  "
                f"max |diff| {diff:.3g}")
        except Exception as e:  # a variant that does not compile or launch: say so, go on
            say(f"{'bulk' if bulk else 'line'} chunk {size} +{extra_mb} MB: FAIL "
                f"{type(e).__name__}: {str(e)[:300]}")
    again = time_graph(lambda: step(none), 1, 30)
    say(f"no prefetch again {again:8.1f} us")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
    else:
        run_on_gpu(args.layers, args.context)
