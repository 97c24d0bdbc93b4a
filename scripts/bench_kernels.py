#!/usr/bin/env python3
"""Kernel micro-benchmarks on the GPU: the tiles behind the attention kernels' defaults, and the
batch-1 projections (cuBLAS, cuBLASLt, the model's Triton GEMV) that dominate a decode step.

Each case is captured in a CUDA graph (many calls, replayed) and timed with CUDA events, median of
a few replays; every call reads inputs larger than the L2 cache, as in a real step.

- `decode`: the paged decode kernel at each batch size, contexts drawn as in the offline
  workload (seeded, pages shuffled; requests longest first unless --decode-order drawn), for
  every (block_n, warps, stages, splits).
- `extend`: the causal extend kernel on a prefill chunk of fresh prompts.
- `linear`: y = x W^T for one token (or --linear-rows tokens) and every projection of the model
  at tp 1 and 2.
- `normlinear`: the one-token projections that follow an RMSNorm, with the norm (and the
  rotary / SiLU after them) as kernels of their own and fused into the GEMV.
- `gemm`: the same projections for a whole prefill chunk (cuBLAS).
- `fp8linear`: every projection (tp 1) with FP8 weights at each --linear-rows: bf16 cuBLAS for
  reference, the activation quantization alone, torch._scaled_mm rowwise alone and after the
  quantization, _scaled_mm per tensor, the Triton scaled GEMM (its tiles swept with
  --fp8-sweep), "auto" (the model's choice on Hopper, kernels/fp8.rowwise_plan); at one row
  the FP8 GEMV over its rows per program.
- `fp8normlinear`: the batch-1 norm GEMVs (QKV with rotary and an FP8 K/V store, gate/up with
  SiLU; tp 1) with FP8 weights over their rows (pairs) per program and warps.
- `silu`: the FP8 MLP's quantizing SiLU-and-mul on an unscaled gate/up product at each
  --linear-rows, over its (columns per pass, warps).
- `intlinear`: every projection (tp 1) with 4-bit packed weights in groups of 128 (AWQ's
  layout after loading) at each --linear-rows: bf16 cuBLAS for reference, int_mm at its
  default tiles, and with --int-sweep every tile of its sweep (the split of K at each).
- `moe`: one MoE layer of the model (a mixture-of-experts config) at each of --moe-rows token
  rows: the fused kernel with its default tiles (kernels/moe.py) and its pieces; with
  --moe-sweep, every tile of the sweep for each grouped GEMM.

    PYTHONPATH=. python scripts/bench_kernels.py --what decode,extend,linear
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton

from minisgl.kernels import activation, gemv, moe, rmsnorm
from minisgl.kernels import fp8 as fp8_kernels
from minisgl.kernels.attention import decode_attention, extend_attention
from minisgl.kernels.int_mm import IntTiles, arrival_slots, int_mm
from minisgl.kernels.rotary import rotary_qk_
from minisgl.kernels.types import (DecodeTiles, ExtendTiles, GemmTiles, KVStore, KVTarget,
                                   QKVRope)
from minisgl.layers.fp8 import Fp8Spec, Fp8Weight, rowwise_product
from minisgl.layers.packed import pack, unpack
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="configs/models/llama-3.1-8b")
    p.add_argument("--what", default="decode,extend,linear,gemm")
    p.add_argument("--batch-sizes", default="1,137,256", help="decode batch sizes")
    p.add_argument("--context", default="100-1700", help="decode contexts: N or LO-HI")
    p.add_argument("--decode-order", choices=("longest", "drawn"), default="longest",
                   help="decode: requests longest first (the scheduler's order) or as drawn")
    p.add_argument("--batch1-context", type=int, default=512,
                   help="context of the batch-1 decode case (the latency benchmark's)")
    p.add_argument("--linear-rows", type=lambda v: [int(r) for r in v.split(",")], default=[1],
                   help="linear: token rows per projection, e.g. 1,64,137,144,256")
    p.add_argument("--chunk", type=int, default=8192, help="extend: tokens in the chunk")
    p.add_argument("--extend-prompts", type=lambda v: [int(n) for n in v.split(",")], default=[],
                   help="extend: also sweep one fresh prompt of each of these lengths")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="decode, extend: the KV cache's dtype (fp8: float8_e4m3fn, scales 1.0)")
    p.add_argument("--reps", type=int, default=5, help="timed graph replays per case")
    p.add_argument("--moe-rows", type=lambda v: [int(r) for r in v.split(",")],
                   default=[1, 8, 64, 256, 1024, 8192], help="moe: token rows per case")
    p.add_argument("--moe-tp", type=int, default=1, help="moe: this rank's expert slice of tp")
    p.add_argument("--fp8-sweep", action="store_true",
                   help="fp8linear: sweep the Triton scaled GEMM's tiles")
    p.add_argument("--int-sweep", action="store_true",
                   help="intlinear: sweep the packed product's tiles and K splits")
    p.add_argument("--moe-sweep", action="store_true",
                   help="moe: also time every tile of the sweep for each grouped GEMM")
    return p.parse_args(argv)


def time_graph(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median microseconds of one `fn()` when `calls` of them run back to back in a graph (what
    `fn` returns is dropped)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def report(kind: str, case: Dict[str, object], us: float, **extra: object) -> None:
    fields = " ".join(f"{k}={v}" for k, v in {**case, **extra}.items())
    print(f"{kind:7s} {us:9.2f} us  {fields}", flush=True)
    print("RESULT " + json.dumps({"kind": kind, "us": round(us, 3), **case, **extra}))


# --- attention ------------------------------------------------------------------------------------
class Paged(NamedTuple):
    k: torch.Tensor  # [slots, kv_heads, d]
    v: torch.Tensor
    page_table: torch.Tensor  # [batch, max pages * page_size] int32
    rows: torch.Tensor
    lens: List[int]


def paged_kv(shape: Shape, lens: Sequence[int], page_size: int, seed: int,
             kv_dtype: str = "bf16") -> Paged:
    """K/V for requests of `lens` tokens in shuffled pages (a pool after some churn), in bf16 or
    (kv_dtype "fp8") float8_e4m3fn."""
    pages = [-(-n // page_size) for n in lens]
    order = list(range(sum(pages)))
    random.Random(seed).shuffle(order)
    width = max(pages) * page_size
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        own = torch.tensor(order[used:used + n], dtype=torch.int32)
        used += n
        slots = (own[:, None] * page_size + torch.arange(page_size, dtype=torch.int32)).flatten()
        table[i, :slots.numel()] = slots
    cache = (sum(pages) * page_size, shape.kv_heads, shape.head_dim)
    dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16
    k = torch.randn(cache, dtype=torch.bfloat16, device="cuda").to(dtype)
    v = torch.randn(cache, dtype=torch.bfloat16, device="cuda").to(dtype)
    rows = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    return Paged(k, v, table.cuda(), rows, list(lens))


def draw_lens(n: int, spec: str, seed: int) -> List[int]:
    lo, _, hi = spec.partition("-")
    rng = random.Random(seed)
    return [rng.randint(int(lo), int(hi or lo)) for _ in range(n)]


def bench_decode(shape: Shape, args: argparse.Namespace) -> None:
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        lens = [args.batch1_context] if bs == 1 else draw_lens(bs, args.context, bs)
        if args.decode_order == "longest":  # the scheduler's decode order (scheduler/decode.py)
            lens.sort(reverse=True)
        kv = paged_kv(shape, lens, args.page_size, bs, args.kv_dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn((bs, shape.heads, shape.head_dim), dtype=torch.bfloat16, device="cuda")
        gb = 2 * sum(lens) * shape.kv_heads * shape.head_dim * kv.k.element_size() / 1e9
        # Above batch 64 one split won every earlier sweep (fifth session).
        split_choices = (8, 16, 32) if bs == 1 else (1,)
        ref: Optional[torch.Tensor] = None
        # Sweeps so far (RESULTS.md): 256-token tiles and 8 warps lost at large batches; longest
        # first, (64, 2, 3) (now the default) beat (128, 4, 3) by 1-1.5%.
        # FP8: float16 tiles (kernels/attention._tile_dtype; they beat bfloat16 tiles by
        # 1.2-1.5x at every tile, thirteenth session) over fewer tiles, so that batch 256 fits
        # in a few minutes (27 tiles ran past 100 s, twelfth session).
        fp8 = args.kv_dtype == "fp8"
        grid = (((64, 128, 256), (2, 4), (2, 3), split_choices, (True,)) if fp8 else
                ((32, 64, 128), (1, 2, 4), (2, 3, 4), split_choices, (None,)))
        for block_n, warps, stages, splits, f16 in itertools.product(*grid):
            o_part = torch.empty((bs, shape.heads, splits, shape.head_dim), dtype=torch.float32,
                                 device="cuda")
            lse = torch.empty((bs, shape.heads, splits), dtype=torch.float32, device="cuda")
            arrivals = torch.zeros((bs, shape.kv_heads), dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            tiles = DecodeTiles(block_n, warps, stages)
            scale = shape.head_dim ** -0.5

            def run() -> None:
                decode_attention(q, kv.k, kv.v, kv.page_table, kv.rows, seq_lens, o_part, lse,
                                 out, scale, 64, tiles, f16_tiles=f16, arrivals=arrivals)
            try:
                us = time_graph(run, 20, args.reps)
            except Exception as exc:  # a tile that does not compile (resources) is skipped
                print(f"decode bs={bs} {tiles} splits={splits}: {type(exc).__name__}: "
                      f"{str(exc)[:120]}")
                continue
            ref = out.clone() if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            report("decode", {"batch": bs, "kv": args.kv_dtype, "block_n": block_n,
                              "warps": warps, "stages": stages, "splits": splits,
                              "f16_tiles": f16}, us,
                   gb_s=round(gb / us * 1e6, 1), max_err=round(err, 4))


def bench_extend(shape: Shape, args: argparse.Namespace) -> None:
    """Extend-kernel tiles on a chunk of mixed prompts (100-1024 tokens, filling --chunk), then
    on one fresh prompt of each --extend-prompts length (the time-to-first-token case)."""
    rng = random.Random(0)
    lens: List[int] = []
    while sum(lens) < args.chunk:
        lens.append(min(rng.randint(100, 1024), args.chunk - sum(lens)))
    for case in [lens] + [[n] for n in args.extend_prompts]:
        sweep_extend(shape, args, case)


def sweep_extend(shape: Shape, args: argparse.Namespace, lens: List[int]) -> None:
    kv = paged_kv(shape, lens, args.page_size, 7, args.kv_dtype)
    t = sum(lens)
    q = torch.randn((t, shape.heads, shape.head_dim), dtype=torch.bfloat16, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    zeros = torch.zeros_like(lens_t)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int32,
                          device="cuda")
    flops = sum(4 * n * (n + 1) / 2 * shape.head_dim * shape.heads for n in lens)
    ref: Optional[torch.Tensor] = None
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8),
                                                             (2, 3)):
        tiles = ExtendTiles(block_m, block_n, warps, stages)
        out = torch.empty_like(q)

        def run() -> None:
            extend_attention(q, kv.k, kv.v, kv.page_table, kv.rows, zeros, lens_t, starts,
                             max(lens), out, shape.head_dim ** -0.5, tiles)
        try:
            us = time_graph(run, 3, args.reps)
        except Exception as exc:
            print(f"extend {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        ref = out.clone() if ref is None else ref
        err = (out.float() - ref.float()).abs().max().item()
        report("extend", {"tokens": t, "requests": len(lens), "kv": args.kv_dtype,
                          "block_m": block_m, "block_n": block_n, "warps": warps,
                          "stages": stages}, us,
               tflops=round(flops / us / 1e6, 1), max_err=round(err, 4))


    if len(lens) == 1:  # a reference: torch's fused attention on dense (unpaged) K/V
        dense = torch.randn((1, shape.kv_heads, t, shape.head_dim), dtype=torch.bfloat16,
                            device="cuda")
        qd = q.transpose(0, 1).unsqueeze(0)

        def sdpa() -> None:
            torch.nn.functional.scaled_dot_product_attention(qd, dense, dense, is_causal=True,
                                                             enable_gqa=True)
        try:
            us = time_graph(sdpa, 3, args.reps)
            report("sdpa", {"tokens": t, "requests": 1}, us, tflops=round(flops / us / 1e6, 1))
        except Exception as exc:  # enable_gqa or the flash backend missing in this torch
            print(f"sdpa: {type(exc).__name__}: {str(exc)[:120]}")


# --- batch-1 projections --------------------------------------------------------------------------
# The tile sweep behind gemv.gemv_tiles (11 tiles, split-K with atomics among them; commit
# 480d653, benchmarks/RESULTS.md) is done; what stays is the model's GEMV against cuBLAS.
def projections(cfg: ModelConfig, tp: int) -> Iterator[Tuple[str, int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * max(1, cfg.num_kv_heads // tp) * tp) * d // tp
    yield "qkv", qkv, h
    yield "o", h, cfg.num_heads * d // tp
    yield "gate_up", 2 * cfg.intermediate_size // tp, h
    yield "down", h, cfg.intermediate_size // tp
    yield "lm_head", cfg.vocab_size // tp, h


def bench_linear(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """Every projection at tp 1 and 2 for each row count of --linear-rows: cuBLAS and cuBLASLt,
    and at one row the Triton GEMV. At the offline workload's decode batches (about 137 rows)
    the projections ran at 2.3 to 3.5 TB/s (fifth session): the largest gap to the roofline
    left in a decode step there."""
    for tp, rows in itertools.product((1, 2), args.linear_rows):
        for name, n, k in projections(cfg, tp):
            copies = max(2, -(-(512 << 20) // (n * k * 2)))  # > 512 MiB: never from L2
            ws = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
                  for _ in range(copies)]
            x = torch.randn((rows, k), dtype=torch.bfloat16, device="cuda")
            gb = n * k * 2 / 1e9
            ref = torch.nn.functional.linear(x, ws[0]).float()
            case = {"proj": name, "tp": tp, "rows": rows, "n": n, "k": k}
            variants: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
            variants["cublas"] = lambda w: torch.nn.functional.linear(x, w)
            if rows == 1:
                variants["triton_gemv"] = lambda w: gemv.gemv(x, w)
                if torch.cuda.get_device_capability()[0] >= 9:
                    variants["triton_gemv_pdl"] = lambda w: gemv.gemv(x, w, pdl=True)
            for label, fn in variants.items():
                state = iter(itertools.cycle(ws))

                def run(fn: Callable[[torch.Tensor], torch.Tensor] = fn) -> None:
                    fn(next(state))
                try:
                    us = time_graph(run, copies, args.reps)
                    err = (fn(ws[0]).float() - ref).abs().max().item()
                except Exception as exc:
                    print(f"linear {name} tp{tp} {label}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                report("linear", {**case, "impl": label}, us, tb_s=round(gb / us * 1e3, 2),
                       tflops=round(2 * rows * n * k / us / 1e6, 1), max_err=round(err, 4))
            lt = _cublaslt_us(x, ws, copies, args.reps)
            if lt is not None:
                report("linear", {**case, "impl": "cublaslt"}, lt, tb_s=round(gb / lt * 1e3, 2),
                       tflops=round(2 * rows * n * k / lt / 1e6, 1))
            del ws


class NormInputs(NamedTuple):
    """One token's input to a norm GEMV (bf16) and the rotary tables of a QKV projection."""

    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    rotary: RotaryEmbedding
    position: torch.Tensor
    slot: torch.Tensor


def _norm_inputs(cfg: ModelConfig) -> NormInputs:
    h = cfg.hidden_size
    x, res = (torch.randn((1, h), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    nw = torch.rand(h, dtype=torch.bfloat16, device="cuda") + 0.5
    rotary = RotaryEmbedding(cfg.head_dim, 4096, cfg.rope_theta, cfg.rope_scaling).cuda()
    pos, slot = (torch.tensor([1000], device="cuda") for _ in range(2))
    return NormInputs(x, res, nw, rotary, pos, slot)


def _rope(inputs: NormInputs, cfg: ModelConfig, tp: int, cache_dtype: torch.dtype) -> QKVRope:
    """The QKV GEMV's rotary and K/V store at the inputs' position and slot, into caches of
    `cache_dtype` (this rank's KV heads at `tp`)."""
    n_q, n_kv = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
    caches = [torch.zeros((2048, n_kv, cfg.head_dim), dtype=cache_dtype, device="cuda")
              for _ in range(2)]
    return QKVRope(inputs.position, inputs.rotary.cos, inputs.rotary.sin, n_q, n_kv,
                   KVTarget(caches[0], caches[1], inputs.slot))


def bench_norm_linear(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """The batch-1 projections that follow an RMSNorm (QKV, gate_up; tp 1 and 2), all with PDL:
    the norm kernel then the GEMV, against the norm inside the GEMV at each launch width; and
    the whole chain (norm, GEMV, then rotary with the K/V store or SiLU-and-mul) against the one
    kernel that fuses it."""
    d = cfg.head_dim
    inputs = _norm_inputs(cfg)
    x, res, nw, rotary, pos, _ = inputs
    for tp in (1, 2):
        n_q, n_kv = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
        rope = _rope(inputs, cfg, tp, torch.bfloat16)
        target = rope.target

        def store(qkv: torch.Tensor) -> object:
            q, k, v = (t.view(1, -1, d) for t in qkv.split([n_q * d, n_kv * d, n_kv * d], -1))
            return rotary_qk_(q, k, pos, rotary.cos, rotary.sin, True,
                                         KVStore(v, target))
        for name, n, k in projections(cfg, tp):
            if name not in ("qkv", "gate_up"):
                continue
            copies = max(2, -(-(512 << 20) // (n * k * 2)))
            ws = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
                  for _ in range(copies)]
            variants: Dict[str, Callable[[torch.Tensor], object]] = {
                "rmsnorm+gemv": lambda w: gemv.gemv(
                    rmsnorm.rmsnorm(x, nw, 1e-5, res, pdl=True)[0], w, pdl=True)}
            for warps, stages in itertools.product((4, 8, 16), (1, 2)):
                def norm_gemv(w: torch.Tensor, nw_: int = warps, st: int = stages) -> object:
                    return gemv.norm_gemv(x, res, nw, 1e-5, w, pdl=True, num_warps=nw_,
                                          num_stages=st)
                variants[f"norm_gemv w{warps} st{stages}"] = norm_gemv
            if name == "qkv":
                variants["rmsnorm+gemv+rotary_store"] = lambda w: store(gemv.gemv(
                    rmsnorm.rmsnorm(x, nw, 1e-5, res, pdl=True)[0], w, pdl=True))
                variants["norm_qkv_rope"] = lambda w: gemv.norm_qkv_rope(
                    x, res, nw, 1e-5, w, None, rope, pdl=True)
            else:
                variants["rmsnorm+gemv+silu"] = lambda w: activation.act_and_mul(
                    gemv.gemv(rmsnorm.rmsnorm(x, nw, 1e-5, res, pdl=True)[0], w,
                                     pdl=True), pdl=True)
                variants["norm_gate_up_act"] = lambda w: gemv.norm_gate_up_act(
                    x, res, nw, 1e-5, w, pdl=True)
            for label, fn in variants.items():
                state = iter(itertools.cycle(ws))

                def run(fn: Callable[[torch.Tensor], object] = fn) -> None:
                    fn(next(state))
                try:
                    us = time_graph(run, copies, args.reps)
                except Exception as exc:
                    print(f"norm_linear {name} tp{tp} {label}: {type(exc).__name__}: "
                          f"{str(exc)[:120]}")
                    continue
                report("normlin", {"proj": name, "tp": tp, "n": n, "k": k, "impl": label}, us,
                       tb_s=round(n * k * 2 / 1e9 / us * 1e3, 2))
            del ws


def bench_prefill_gemm(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """The projections of a whole prefill chunk (cuBLAS, tp 1): compute-bound, so TFLOP/s."""
    x = torch.randn((args.chunk, cfg.hidden_size), dtype=torch.bfloat16, device="cuda")
    for name, n, k in projections(cfg, 1):
        w = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        a = x if k == x.shape[1] else torch.randn((args.chunk, k), dtype=torch.bfloat16,
                                                   device="cuda")
        us = time_graph(lambda: torch.nn.functional.linear(a, w), 5, args.reps)
        report("gemm", {"proj": name, "m": args.chunk, "n": n, "k": k}, us,
               tflops=round(2 * args.chunk * n * k / us / 1e6, 1))


# --- FP8 projections -----------------------------------------------------------------------------
def _fp8_variants(x: torch.Tensor, n: int, k: int, rows: int, sweep: bool
                  ) -> Dict[str, Callable[[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    """The FP8 products of x by a (weight, row scales) pair, by name."""
    a = fp8_kernels.quantize_tokens(x)
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    auto = Fp8Spec(gemm="auto")
    v: Dict[str, Callable[[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {
        "quant_only": lambda w: fp8_kernels.quantize_tokens(x).values,
        "scaled_mm_rowwise": lambda w: fp8_kernels.rowwise_mm(a, w[0], w[1], None),
        "quant+scaled_mm_rowwise": lambda w: fp8_kernels.rowwise_mm(
            fp8_kernels.quantize_tokens(x), w[0], w[1], None),
        "scaled_mm_tensor": lambda w: torch._scaled_mm(a.values, w[0].t(), scale_a=one,
                                                       scale_b=one, out_dtype=torch.bfloat16),
        "triton": lambda w: fp8_kernels.scaled_mm(a, w[0], w[1], None, torch.bfloat16),
        # the layers' Hopper path (their unit_scale buffer is the `one` here)
        "auto": lambda w: rowwise_product(a, Fp8Weight(w[0], w[1], None, auto, one), None,
                                          torch.bfloat16),
    }
    if sweep and rows > 1:
        bm = fp8_kernels.gemm_tiles(rows, 128).block_m
        for bn, bk, (warps, stages) in itertools.product((32, 64, 128), (128, 256),
                                                         ((4, 4), (8, 3))):
            t = fp8_kernels.ScaledMmTiles(bm, bn, bk, warps, stages)

            def triton_scaled_mm(w: Tuple[torch.Tensor, torch.Tensor],
                                 t: fp8_kernels.ScaledMmTiles = t) -> torch.Tensor:
                return fp8_kernels.scaled_mm(a, w[0], w[1], None, torch.bfloat16, tiles=t)
            v[f"triton_{bm}x{bn}x{bk}_w{warps}_s{stages}"] = triton_scaled_mm
    if rows == 1:
        for r, bk, warps in itertools.product((4, 8, 16), (2048, 4096, 8192), (4, 8)):
            if bk > triton.next_power_of_2(k):
                continue
            gt = gemv.GemvTiles(bk, warps, 1 if k % bk == 0 else 2, r)  # `t` is ScaledMmTiles

            def fp8_gemv(w: Tuple[torch.Tensor, torch.Tensor],
                         t: gemv.GemvTiles = gt) -> torch.Tensor:
                return gemv.gemv(x, w[0], pdl=True, weight_scale=w[1], tiles=t)
            v[f"gemv_r{r}_k{bk}_w{warps}"] = fp8_gemv
    return v


def bench_fp8_linear(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """See the module's doc (`fp8linear`). tb_s counts the FP8 weight bytes."""
    for rows in args.linear_rows:
        for name, n, k in projections(cfg, 1):
            if name == "lm_head":  # the LM head stays in the model's dtype
                continue
            copies = max(2, -(-(512 << 20) // (n * k)))  # > 512 MiB of FP8: never from L2
            ws = [_random_fp8_weight(n, k) for _ in range(copies)]
            x = torch.randn((rows, k), dtype=torch.bfloat16, device="cuda")
            dense = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
                     for _ in range(max(2, copies // 2))]
            case = {"proj": name, "rows": rows, "n": n, "k": k}

            def bf16_cublas(st: Iterator[torch.Tensor] = iter(itertools.cycle(dense))
                            ) -> torch.Tensor:
                return torch.nn.functional.linear(x, next(st))
            us = time_graph(bf16_cublas, len(dense), args.reps)
            report("fp8lin", {**case, "impl": "bf16_cublas"}, us,
                   tb_s=round(n * k * 2 / us / 1e6, 2),
                   tflops=round(2 * rows * n * k / us / 1e6, 1))
            del dense, bf16_cublas  # the function's iterator holds the copies too: free both
            ref = (x.float() @ (ws[0][0].float() * ws[0][1][:, None]).t())
            for label, fn in _fp8_variants(x, n, k, rows, args.fp8_sweep).items():
                state = iter(itertools.cycle(ws))

                def run(fn: Callable[[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor] = fn
                        ) -> None:
                    fn(next(state))
                try:
                    us = time_graph(run, copies, args.reps)
                    out = fn(ws[0])
                    err = ((out.float() - ref).abs().max().item()
                           if out.shape == ref.shape else float("nan"))
                except Exception as exc:
                    print(f"fp8lin {name} rows={rows} {label}: {type(exc).__name__}: "
                          f"{str(exc)[:120]}")
                    continue
                report("fp8lin", {**case, "impl": label}, us,
                       tb_s=round(n * k / us / 1e6, 2),
                       tflops=round(2 * rows * n * k / us / 1e6, 1), max_err=round(err, 3))
            del ws


def bench_fp8_norm_linear(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """See the module's doc (`fp8normlinear`); tb_s counts the FP8 weight bytes. With FP8
    weights a program of the bf16 tiling streams half the bytes for the same norm of its input
    row, so wider programs may pay here where they did not in bf16."""
    inputs = _norm_inputs(cfg)
    x, res, nw = inputs.x, inputs.residual, inputs.norm_weight
    rope = _rope(inputs, cfg, 1, fp8_kernels.FP8)
    for name, n, k in projections(cfg, 1):
        if name not in ("qkv", "gate_up"):
            continue
        copies = max(2, -(-(512 << 20) // (n * k)))
        ws = [_random_fp8_weight(n, k) for _ in range(copies)]
        variants: Dict[str, Callable[[Tuple[torch.Tensor, torch.Tensor]], object]] = {}
        for rows, warps in itertools.product((2, 4, 8, 16), (4, 8)):
            def norm_gemv(w: Tuple[torch.Tensor, torch.Tensor], r: int = rows,
                          nw_: int = warps) -> object:
                return gemv.norm_gemv(x, res, nw, 1e-5, w[0], pdl=True, weight_scale=w[1],
                                      rows=r, num_warps=nw_)
            variants[f"norm_gemv r{rows} w{warps}"] = norm_gemv
        for pairs, warps in itertools.product((1, 2, 4, 8), (2, 4, 8)):
            if name == "qkv":
                def norm_qkv_rope(w: Tuple[torch.Tensor, torch.Tensor], p: int = pairs,
                                  nw_: int = warps) -> object:
                    return gemv.norm_qkv_rope(x, res, nw, 1e-5, w[0], None, rope, pdl=True,
                                              weight_scale=w[1], pairs=p, num_warps=nw_)
                variants[f"norm_qkv_rope p{pairs} w{warps}"] = norm_qkv_rope
            else:
                def norm_gate_up_silu(w: Tuple[torch.Tensor, torch.Tensor], p: int = pairs,
                                      nw_: int = warps) -> object:
                    return gemv.norm_gate_up_act(x, res, nw, 1e-5, w[0], pdl=True,
                                                  weight_scale=w[1], pairs=p, num_warps=nw_)
                variants[f"norm_gate_up_silu p{pairs} w{warps}"] = norm_gate_up_silu
        for label, fn in variants.items():
            state = iter(itertools.cycle(ws))

            def run(fn: Callable[[Tuple[torch.Tensor, torch.Tensor]], object] = fn) -> None:
                fn(next(state))
            try:
                us = time_graph(run, copies, args.reps)
            except Exception as exc:
                print(f"fp8normlin {name} {label}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            report("fp8normlin", {"proj": name, "n": n, "k": k, "impl": label}, us,
                   tb_s=round(n * k / us / 1e6, 2))
        del ws


def bench_silu(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """The quantizing SiLU-and-mul of an FP8 MLP at each of --linear-rows, on an unscaled
    gate/up product with its scales (the decode path on Hopper), at each (columns per pass,
    warps); tb_s counts the bytes read once and written."""
    from minisgl.kernels.activation import act_and_mul_quantized
    from minisgl.kernels.types import SILU
    d = cfg.intermediate_size
    for rows in args.linear_rows:
        copies = max(2, -(-(256 << 20) // (rows * 4 * d)))  # > 256 MiB of inputs: not from L2
        xs = [torch.randn((rows, 2 * d), dtype=torch.bfloat16, device="cuda")
              for _ in range(copies)]
        rs = torch.rand((rows, 1), device="cuda") * 0.01
        cs = torch.rand(2 * d, device="cuda") * 0.01
        # One program a row (columns per pass, warps), then each row split over programs
        # (columns per program, warps; two launches).
        cases = [(False, t) for t in ((4096, 16), None)] + [
            (True, t) for t in ((1024, 4), (2048, 4), (2048, 8), (4096, 8))]
        for split, tiles in cases:
            state = iter(itertools.cycle(xs))

            def silu(t: Optional[Tuple[int, int]] = tiles, sp: bool = split) -> object:
                return act_and_mul_quantized(next(state), SILU, False, rs, cs, t, sp)
            us = time_graph(silu, copies, args.reps)
            report("silu", {"rows": rows, "d": d, "split": split,
                            "tiles": str(tiles or "default")}, us,
                   tb_s=round(rows * 5 * d / us / 1e6, 2))
        del xs


def _random_fp8_weight(n: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight [n, k] and its float32 row scales, on the GPU."""
    from minisgl.layers.fp8 import quantize_rows
    w = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
    return quantize_rows(w)


# --- packed integer weights ----------------------------------------------------------------------
def int_sweep(rows: int) -> Iterator[IntTiles]:
    """The packed product's tiles timed with --int-sweep at `rows` token rows."""
    if rows == 1:
        for block_n, block_k, warps, stages, split in itertools.product(
                (16, 32, 64), (64, 128), (2, 4), (2, 4), (1, 2, 4, 8)):
            yield IntTiles(1, block_n, block_k, warps, stages, split)
        return
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    for block_n, block_k, split, swap in itertools.product((64, 128), (64, 128), (1, 2, 4),
                                                           (False, True)):
        yield IntTiles(block_m, block_n, block_k, 4 if block_m <= 64 else 8, 3, split, swap)
    if rows > 64:  # more, smaller row tiles: less of the last one padding, more dequantizing
        for block_n, split in itertools.product((64, 128), (1, 2, 4)):
            yield IntTiles(64, block_n, 64, 4, 3, split)
    if rows > 128:  # one row tile: each weight tile dequantized once, not twice
        for block_n, block_k, split in itertools.product((32, 64), (32, 64), (1, 2)):
            yield IntTiles(256, block_n, block_k, 8, 3, split)


def _random_packed(n: int, k: int, group: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random 4-bit packed weight [n, k] (qweight, scales, zeros, g_idx) in groups of
    `group`, on the GPU."""
    values = torch.randint(0, 16, (k, n), device="cuda")
    scales = torch.rand((k // group, n), device="cuda") * 0.004
    zeros = torch.full((k // group, n), 8.0, device="cuda", dtype=torch.float16)
    g_idx = (torch.arange(k, device="cuda") // group).to(torch.int32)
    return pack(values, 4), scales, zeros, g_idx


def bench_int_linear(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """See the module's doc (`intlinear`). tb_s counts the packed weight's bytes (half a byte
    a weight, scales and zero points beside)."""
    group = 128
    for rows in args.linear_rows:
        for name, n, k in projections(cfg, 1):
            if name == "lm_head":
                continue
            nbytes = n * k // 2 + (k // group) * n * 6
            copies = max(2, -(-(512 << 20) // nbytes))
            ws = [_random_packed(n, k, group) for _ in range(copies)]
            x = torch.randn((rows, k), dtype=torch.bfloat16, device="cuda")
            case = {"proj": name, "rows": rows, "n": n, "k": k}
            dense = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
                     for _ in range(max(2, -(-(512 << 20) // (n * k * 2))))]

            def bf16_cublas(st: Iterator[torch.Tensor] = iter(itertools.cycle(dense))
                            ) -> torch.Tensor:
                return torch.nn.functional.linear(x, next(st))
            us = time_graph(bf16_cublas, len(dense), args.reps)
            report("intlin", {**case, "impl": "bf16_cublas"}, us,
                   tb_s=round(n * k * 2 / us / 1e6, 2))
            del dense, bf16_cublas
            q, sc, z, gi = ws[0]
            ref = x.float() @ ((unpack(q, 4, k).float() - 8.0) * sc[gi.long()])
            choices: List[Optional[IntTiles]] = [None]
            if args.int_sweep:
                choices += list(int_sweep(rows))
            for tiles in choices:
                state = iter(itertools.cycle(ws))

                def run(t: Optional[IntTiles] = tiles) -> None:
                    int_mm(x, *next(state), 4, tiles=t, group_size=group)
                try:
                    us = time_graph(run, copies, args.reps)
                    err = (int_mm(x, *ws[0], 4, tiles=tiles, group_size=group).float()
                           - ref).abs().max().item()
                except Exception as exc:
                    print(f"intlin {name} rows={rows} {tiles}: {type(exc).__name__}: "
                          f"{str(exc)[:120]}")
                    continue
                label = "default" if tiles is None else "m{}n{}k{}w{}s{}x{}{}".format(
                    *tiles[:6], "t" if tiles.swap else "")
                report("intlin", {**case, "impl": label}, us,
                       tb_s=round(nbytes / us / 1e6, 2), max_err=round(err, 4))
                if tiles is None:  # as a layer runs it: its counters sum the K splits
                    counters = torch.zeros(arrival_slots(n), dtype=torch.int32, device="cuda")
                    us = time_graph(lambda: int_mm(x, *next(state), 4, group_size=group,
                                                   arrivals=counters), copies, args.reps)
                    report("intlin", {**case, "impl": "default_counters"}, us,
                           tb_s=round(nbytes / us / 1e6, 2))
            del ws


# --- mixture of experts ---------------------------------------------------------------------------
def moe_sweep(block_m: int) -> Iterator[GemmTiles]:
    """The grouped GEMM tiles timed with --moe-sweep for blocks of `block_m` rows."""
    for block_n, block_k, warps, stages in itertools.product((64, 128), (64, 128), (4, 8),
                                                             (3, 4)):
        if block_m * block_n * block_k <= 128 * 128 * 128:
            yield GemmTiles(block_n, block_k, warps, stages)


def bench_moe(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """One MoE layer (this rank's slice at --moe-tp) on random routing at each row count: the
    whole fused path with its default tiles against the touched experts' bytes (TB/s) and the
    matrix FLOPs (TFLOP/s), then route, align and each grouped GEMM alone; with --moe-sweep,
    each GEMM at every tile of `moe_sweep` for every block_m."""
    if not cfg.num_experts:
        raise SystemExit(f"--what moe needs a mixture-of-experts model; {args.model} has none")
    e, top_k, h = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    inter = cfg.moe_intermediate_size // args.moe_tp
    w13 = torch.randn((e, 2 * inter, h), dtype=torch.bfloat16, device="cuda") * 0.02
    w2 = torch.randn((e, h, inter), dtype=torch.bfloat16, device="cuda") * 0.02
    per_expert = (3 * inter * h) * 2
    for rows in args.moe_rows:
        x = torch.randn((rows, h), dtype=torch.bfloat16, device="cuda")
        logits = torch.randn((rows, e), dtype=torch.bfloat16, device="cuda")
        routing = moe.route(logits, top_k, True)
        touched = int((routing.counts > 0).sum())
        flops = 2 * rows * top_k * 3 * inter * h
        tiles = moe.moe_tiles(rows, top_k, e)
        case = {"rows": rows, "experts": e, "top_k": top_k, "inter": inter, "hidden": h}
        us = time_graph(lambda: moe.fused_moe(x, logits, w13, w2, top_k, True), 5, args.reps)
        report("moe", {**case, "part": "all", "tiles": str(tuple(tiles))}, us,
               tb_s=round(touched * per_expert / us / 1e6, 2),
               tflops=round(flops / us / 1e6, 1), experts_touched=touched)
        report("moe", {**case, "part": "route"},
               time_graph(lambda: moe.route(logits, top_k, True), 20, args.reps))
        report("moe", {**case, "part": "align", "block_m": tiles.block_m},
               time_graph(lambda: moe.align(routing, tiles.block_m), 20, args.reps))
        for block_m in ((16, 32, 64, 128) if args.moe_sweep else (tiles.block_m,)):
            aligned = moe.align(routing, block_m)
            act = torch.randn((rows * top_k, inter), dtype=torch.bfloat16, device="cuda")
            gemms = {"gate_up": (x, w13, top_k, True, None, 2 * inter * h),
                     "down": (act, w2, 1, False, routing.weights, inter * h)}
            for part, (a, w, div, gated, weights, elems) in gemms.items():
                default = tiles.gate_up if part == "gate_up" else tiles.down
                choices = list(moe_sweep(block_m)) if args.moe_sweep else [default]
                for t in choices:
                    def run(a: torch.Tensor = a, w: torch.Tensor = w, div: int = div,
                            gated: bool = gated, weights: Optional[torch.Tensor] = weights,
                            t: GemmTiles = t) -> None:
                        moe.grouped_gemm(a, w, aligned, rows * top_k, div, t, gated, weights)
                    try:
                        us = time_graph(run, 5, args.reps)
                    except Exception as exc:  # a tile that does not compile is skipped
                        print(f"moe {part} block_m={block_m} {t}: {type(exc).__name__}: "
                              f"{str(exc)[:120]}")
                        continue
                    report("moe", {**case, "part": part, "block_m": block_m,
                                   "tiles": str(tuple(t)), "default": t == default
                                   and block_m == tiles.block_m}, us,
                           tb_s=round(touched * elems * 2 / us / 1e6, 2),
                           tflops=round(2 * rows * top_k * elems / us / 1e6, 1))


def _cublaslt_us(x: torch.Tensor, ws: List[torch.Tensor], calls: int, reps: int
                 ) -> Optional[float]:
    """The same product with cuBLASLt preferred (torch's switch; restored after)."""
    blas = torch.backends.cuda
    try:
        before = blas.preferred_blas_library()
        blas.preferred_blas_library("cublaslt")
    except (AttributeError, RuntimeError) as exc:
        print(f"cublaslt: {exc}")
        return None
    try:
        state = iter(itertools.cycle(ws))
        return time_graph(lambda: torch.nn.functional.linear(x, next(state)), calls, reps)
    finally:
        blas.preferred_blas_library(before)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    cfg = ModelConfig.from_dir(args.model)
    shape = Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
          f", model {args.model}", flush=True)
    what = set(args.what.split(","))
    if "linear" in what:
        bench_linear(cfg, args)
    if "normlinear" in what:
        bench_norm_linear(cfg, args)
    if "gemm" in what:
        bench_prefill_gemm(cfg, args)
    if "fp8linear" in what:
        bench_fp8_linear(cfg, args)
    if "fp8normlinear" in what:
        bench_fp8_norm_linear(cfg, args)
    if "silu" in what:
        bench_silu(cfg, args)
    if "decode" in what:
        bench_decode(shape, args)
    if "extend" in what:
        bench_extend(shape, args)
    if "intlinear" in what:
        bench_int_linear(cfg, args)
    if "moe" in what:
        bench_moe(cfg, args)


if __name__ == "__main__":
    main()
