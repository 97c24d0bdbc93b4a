#!/usr/bin/env python3
"""Decode step latency against the memory roofline.

For each batch size (default 1, 64, 256) every request holds a fixed context (default 512 tokens;
`--context 100-1700` draws each request's length uniformly instead, like the offline workload
of random K/V) and the engine runs full decode steps (`Engine.forward`: inputs, model, sampling)
on dummy weights, synchronously (wait for each step's tokens) and overlapped (launch step N+1
before collecting step N, as the scheduler runs by default). The roofline of one step is the
bytes it must read from device memory, this rank's weights plus the batch's KV, over the
device-to-device copy bandwidth measured in the same run (a large copy; bytes read + written
over the time, with CUDA events). For a mixture-of-experts model the weights a step reads are
the dense ones plus the experts the batch's tokens touch: under uniform routing B tokens choosing
k of E experts touch E * (1 - (1 - k/E)^B) of each MoE layer's experts on average. Prints a
table and one line of JSON (prefixed "RESULT ").

`--lora` runs every request with an adapter (slot 0 of `--enable-lora --max-lora-rank R`,
random weights in every slot), as the LoRA family of decode graphs runs it; the roofline stays
the base weights', so the difference to a run without `--lora` is the adapters' cost.

`--json-schema FILE` also times every batch size with each request constrained by that JSON
schema, as the scheduler runs structured output: the forward is launched, the previous step's
tokens are accepted into the requests' xgrammar matchers and the bitmask of this step filled on
the CPU (while the device runs the forward, overlapped), then the masked sampling is launched.
A matcher whose JSON is complete starts again, so every step is masked. The vocabulary comes
from `--tokenizer` (default: the model directory's, else the bundled default model's, padded to
the model's vocabulary size). The columns `json ms` / `json overlap ms` and the overhead against
the unconstrained steps are the structured-output cost.

    PYTHONPATH=. python scripts/bench_latency.py --model configs/models/llama-3.1-8b
    PYTHONPATH=. python scripts/bench_latency.py --batch-sizes 1,64 --json-schema schema.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import time
from pathlib import Path
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

from minisgl.core import Batch, LoraBinding, Phase, Req, SamplingParams, StructuredOutput
from minisgl.distributed import destroy_process_groups, init_process_groups
from minisgl.engine import Engine, EngineConfig
from minisgl.grammar import GrammarCache, TokenizerSource
from minisgl.grammar.matcher import RequestGrammar, fill_bitmask
from minisgl.layers import blas
from minisgl.layers.experts import Experts
from minisgl.layers.lora import LoraSlots
from minisgl.models import ModelConfig
from minisgl.models.default_model import default_model_path
from minisgl.tokenizer.text import has_tokenizer
from minisgl.scheduler.decode import DecodeManager
from minisgl.settings import add_flags, build, from_namespace
from minisgl.distributed.bind import free_port

# Set by the script from the batch sizes and contexts it times.
_SCRIPT_SET = ("max_running_requests", "max_kv_tokens", "load_format")


@dataclass(frozen=True)
class Row:
    batch: int
    context: str  # the --context spec: "512" or "LO-HI"
    step_ms: float  # median wall time of one synchronous decode step (launch, then wait)
    roofline_ms: float
    weight_gb: float  # this rank's weights read per step
    kv_gb: float  # this rank's KV read per step
    graph_ms: Optional[float] = None  # median device time of the decode graph alone (CUDA)
    overlap_ms: Optional[float] = None  # median step with the next one launched first
    # With --json-schema: the same steps with every request constrained by the schema.
    json_step_ms: Optional[float] = None
    json_overlap_ms: Optional[float] = None
    # With --verify K: one speculative verify step (the newest token and K drafts a request)
    verify_ms: Optional[float] = None

    @property
    def json_overhead(self) -> Optional[float]:
        """How much slower the constrained step is, as the server runs it (overlapped)."""
        if self.json_overlap_ms is None:
            return None
        return self.json_overlap_ms / self.served_ms - 1.0

    @property
    def efficiency(self) -> float:
        """Roofline over the step as the server runs it (overlapped where measured)."""
        return self.roofline_ms / self.served_ms

    @property
    def served_ms(self) -> float:
        return self.step_ms if self.overlap_ms is None else self.overlap_ms

    @property
    def tok_s(self) -> float:
        return self.batch / self.served_ms * 1e3


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="configs/models/llama-3.1-8b")
    p.add_argument("--batch-sizes", default=[1, 64, 256], type=batch_sizes,
                   help="decode batch sizes, comma-separated (default 1,64,256)")
    p.add_argument("--context", default="512",
                   help="tokens already in each request: N, or LO-HI for lengths drawn uniformly "
                        "per request (seeded)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="print the device kernels of a few steps at each batch size (and of "
                        "the prefill step, with --prefill)")
    p.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                   help="also time one prefill step of fresh prompts (lengths uniform in "
                        "[100, 1024], seeded) filling this many tokens, as the offline workload's")
    p.add_argument("--lora", action="store_true",
                   help="every request runs with a random adapter (needs --enable-lora)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also time decode with every request constrained by this JSON schema")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the tokenizer of --json-schema's vocabulary (default: the model's, else "
                        "the bundled default model's)")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="also time a speculative verify step at each batch size: every request's "
                        "newest token and K draft tokens, all sampled (Phase.VERIFY, eager); "
                        "speculation pays where the tokens a verify keeps per request exceed "
                        "verify ms / step ms")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="with --verify: a draft model or an EAGLE-3 head (its config says "
                        "which; dummy weights too) proposes the verify step's drafts, timed "
                        "with it; every step also runs it over its tokens, as serving does "
                        "(engine/draft.py, engine/eagle.py)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the bandwidth probe (default 4096 on CUDA, 256 on CPU)")
    add_flags(p, EngineConfig(), skip=_SCRIPT_SET)
    args = p.parse_args(argv)
    try:
        cfg = engine_settings(args)
    except ValueError as e:
        p.error(str(e))
    if args.lora and not cfg.lora_slots:
        p.error("--lora needs adapter slots: --enable-lora (and --max-lora-rank R)")
    if args.draft and not args.verify:
        p.error("--draft needs --verify K (the drafts a verify step proposes)")
    return args


def engine_settings(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the flags give (the pool's size and the weights are the script's)."""
    return build(EngineConfig(), from_namespace(args, EngineConfig()), "command line")


def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()  # not zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * src.numel() * 4 * repeats / seconds


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts `tokens` tokens choose, each `top_k` of
    `num_experts` uniformly: E * (1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _weights(engine: Engine) -> Iterator[Tuple[str, torch.Tensor, int]]:
    """(name, tensor, matrix entries it holds) of every weight a step reads: the parameters,
    and packed integer layers' buffers (their words hold 32 / bits entries each; their
    scales, zeros and groups hold none)."""
    for name, p in engine.model.named_parameters():  # shared (tied) tensors are listed once
        yield name, p, p.numel()
    for module_name, m in engine.model.named_modules():
        spec = getattr(m, "packed", None)
        if spec is None:
            continue
        for name, b in m.named_buffers(recurse=False):
            words = name.startswith("q")  # qweight (layers), q13 / q2 (experts)
            yield f"{module_name}.{name}", b, b.numel() * spec.per_word if words else 0


def _expert_weights(engine: Engine) -> Set[int]:
    """ids of the routed experts' weights (every MoE layer's: parameters, or packed buffers)."""
    return {id(t) for m in engine.model.modules() if isinstance(m, Experts)
            for t in [*m.parameters(), *m.buffers()]}


def weight_bytes_read(engine: Engine, batch: int) -> int:
    """Bytes of this rank's weights one decode step of `batch` tokens reads: each MoE layer's
    routed experts count for the share `experts_touched` of them. An untied embedding table
    is skipped: the lookup reads only the batch's rows (a tied one is read whole by the LM
    head)."""
    cfg = engine.model_cfg
    tied = cfg.tie_word_embeddings
    share = (experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch) / cfg.num_experts
             if cfg.num_experts else 1.0)
    experts = _expert_weights(engine)
    total = 0.0
    for name, t, _ in _weights(engine):
        if "embed_tokens" in name and not tied:
            continue
        total += t.numel() * t.element_size() * (share if id(t) in experts else 1.0)
    return int(total)


def matrix_params_per_token(engine: Engine) -> float:
    """Weights of the matrices one token multiplies (embeddings and LM head aside): every dense
    projection, and of each MoE layer's experts the top_k / num_experts share it is routed to."""
    cfg = engine.model_cfg
    experts = _expert_weights(engine)
    active = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 0.0
    return sum(entries * (active if id(t) in experts else 1.0)
               for n, t, entries in _weights(engine)
               if (t.dim() == 2 or id(t) in experts) and "embed" not in n and "lm_head" not in n)


def kv_bytes_read(engine: Engine, batch: Batch) -> int:
    """K and V bytes of every request's whole sequence (cached context plus the new token)."""
    pool = engine.pool
    per_token = 2 * pool.k.shape[0] * pool.k.shape[2] * pool.k.shape[3] * pool.k.element_size()
    return sum(p + 1 for p in batch.prefix_lens) * per_token


def batch_sizes(spec: str) -> List[int]:
    """"1,64,256" -> [1, 64, 256]; each at least 1."""
    try:
        sizes = [int(s) for s in spec.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"want batch sizes >= 1 separated by commas, got "
                                         f"{spec!r}")
    return sizes


def context_range(spec: str) -> Tuple[int, int]:
    """"512" -> (512, 512); "100-1700" -> (100, 1700)."""
    lo, _, hi = spec.partition("-")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise ValueError(f"--context must be N or LO-HI with 1 <= LO <= HI, got {spec!r}")
    return low, high


def place_requests(engine: Engine, lengths: List[int], vocab: int, rng: random.Random,
                   max_tokens: int) -> Tuple[List[Req], List[List[int]]]:
    """Requests of random tokens in page-table rows 0.. with their own pages, back to back in
    the pool; returns them and each one's slots (also written into the page table)."""
    ps = engine.pool.page_size
    reqs, slots, base = [], [], 0
    for i, n in enumerate(lengths):
        ids = [rng.randrange(vocab) for _ in range(n)]
        reqs.append(Req(i, ids, n, SamplingParams(max_tokens=max_tokens, temperature=0.0), (),
                        table_row=i))
        own = list(range(base, base + n))
        base += -(-n // ps) * ps
        engine.page_table[i, :n] = torch.tensor(own, dtype=torch.int32)
        slots.append(own)
    return reqs, slots


def decode_batch(engine: Engine, batch: int, spec: str, vocab: int, seed: int) -> Batch:
    """`batch` requests with contexts per `spec` (seeded), each decoding the token after its
    context (same slots every step, so contexts stay fixed), in the order the scheduler's decode
    batches take (scheduler/decode.py builds it)."""
    rng = random.Random(seed)
    low, high = context_range(spec)
    contexts = [rng.randint(low, high) for _ in range(batch)]
    reqs, slots = place_requests(engine, [c + 1 for c in contexts], vocab, rng, 1 << 20)
    running = DecodeManager()
    for req in reqs:
        running.add(req)
    b = running.schedule()
    if b is None:
        raise ValueError(f"a decode batch needs at least one request, got {batch}")
    b.out_slots = torch.tensor([slots[r.uid][-1] for r in b.reqs], dtype=torch.int64,
                               device=engine.device)
    return b


def verify_batch(engine: Engine, batch: int, spec: str, vocab: int, seed: int, k: int
                 ) -> Batch:
    """`batch` requests as `decode_batch` places them, each verifying its newest token and `k`
    random drafts (the same slots every step)."""
    rng = random.Random(seed)
    low, high = context_range(spec)
    contexts = [rng.randint(low, high) for _ in range(batch)]
    reqs, slots = place_requests(engine, [c + 1 + k for c in contexts], vocab, rng, 1 << 20)
    for req, c in zip(reqs, contexts):  # its context and newest token on the host
        del req.token_ids[c + 1:]
        req.device_len = c + 1
    order = sorted(reqs, key=lambda r: (-r.device_len, r.uid))
    drafts = [[rng.randrange(vocab) for _ in range(k)] for _ in order]
    b = Batch(Phase.VERIFY, order, [r.device_len - 1 for r in order], [1 + k] * batch,
              [True] * batch, drafts=drafts)
    b.out_slots = torch.tensor([s for r in order for s in slots[r.uid][-1 - k:]],
                               dtype=torch.int64, device=engine.device)
    return b


def random_adapters(engine: Engine) -> None:
    """Every LoRA slot of every projection filled with random weights (a dummy adapter of the
    full rank: the deltas are computed, never zeros)."""
    for m in engine.model.modules():
        if isinstance(m, LoraSlots):
            m.a.normal_(std=0.02)
            m.b.normal_(std=0.02)


def with_adapter(batch: Batch) -> Batch:
    """`batch` with every request bound to slot 0's adapter."""
    for req in batch.reqs:
        req.lora = LoraBinding(0, 1)
    return batch


def prefill_lengths(tokens: int, seed: int) -> List[int]:
    """Prompt lengths uniform in [100, 1024] (the last one cut) summing to `tokens`."""
    rng = random.Random(seed)
    lens: List[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(100, 1024), tokens - sum(lens)))
    return lens


def prefill_batch(engine: Engine, lens: List[int], vocab: int, seed: int) -> Batch:
    """Fresh prompts of `lens` tokens in rows 0.. (a whole prefill chunk, every one sampled)."""
    reqs, slots = place_requests(engine, lens, vocab, random.Random(seed), 1)
    b = Batch(Phase.PREFILL, reqs, [0] * len(lens), list(lens), [True] * len(lens))
    b.out_slots = torch.tensor([s for own in slots for s in own], dtype=torch.int64,
                               device=engine.device)
    return b


def time_prefill(engine: Engine, args: argparse.Namespace, rank: int) -> Dict[str, float]:
    """Median milliseconds of one synchronous prefill step, and its matrix TFLOP/s."""
    lens = prefill_lengths(args.prefill, 0)
    batch = prefill_batch(engine, lens, engine.model_cfg.vocab_size, 0)
    ms = time_steps(engine, batch, 5, 2) * 1e3
    tflops = 2 * matrix_params_per_token(engine) * args.prefill / ms / 1e9
    if args.profile and rank == 0:
        print(f"profile of a prefill step of {args.prefill} tokens ({len(lens)} prompts):\n"
              + profile_steps(engine, batch, steps=2), flush=True)
    return {"tokens": args.prefill, "requests": len(lens), "ms": round(ms, 3),
            "matrix_tflops": round(tflops, 1)}


def time_steps(engine: Engine, batch: Batch, steps: int, warmup: int) -> float:
    """Median seconds of one step of `batch` (forward returns host tokens: synchronous)."""
    for _ in range(warmup):
        engine.forward(batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.forward(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_steps_overlapped(engine: Engine, batch: Batch, steps: int, warmup: int) -> float:
    """Median seconds between consecutive step completions when step N+1 is launched before step
    N's tokens are collected, as the scheduler's overlap loop runs (host work hides behind the
    GPU)."""
    prev = engine.launch(batch)
    for _ in range(warmup):
        nxt = engine.launch(batch)
        engine.collect(prev)
        prev = nxt
    times = []
    last = time.perf_counter()
    for _ in range(steps):
        nxt = engine.launch(batch)
        engine.collect(prev)
        now = time.perf_counter()
        times.append(now - last)
        last, prev = now, nxt
    engine.collect(prev)
    return statistics.median(times)


def tokenizer_dir(args: argparse.Namespace) -> str:
    """Where --json-schema's vocabulary comes from (see the module doc)."""
    if args.tokenizer is not None:
        return args.tokenizer
    return args.model if has_tokenizer(Path(args.model)) else str(default_model_path())


class Constrained:
    """Every request of a decode batch under one compiled grammar, as the scheduler keeps
    them: `bitmask` for the next step from the matchers, `accept` of a step's tokens (a matcher
    whose grammar ended starts over, so every step stays masked)."""

    def __init__(self, engine: Engine, batch: Batch, compiled: Any) -> None:
        import xgrammar as xgr
        self.engine, self.batch = engine, batch
        stops = engine.eos_token_ids
        self.grammars = [RequestGrammar(compiled, stops) for _ in batch.reqs]
        self.batch_matcher = xgr.BatchGrammarMatcher()
        batch.masked = True

    def bitmask(self) -> torch.Tensor:
        return fill_bitmask(self.grammars, self.engine.vocab_size,  # type: ignore[arg-type]
                            pin=self.engine.device.type == "cuda",
                            batch_matcher=self.batch_matcher)

    def accept(self, tokens: List[int]) -> None:
        for g, tok in zip(self.grammars, tokens):
            if not g.accept(tok) or g.terminated:
                g.matcher.reset()

    def step(self) -> None:
        """One synchronous constrained step."""
        launched = self.engine.sample(self.engine.launch(self.batch), self.bitmask())
        self.accept(self.engine.collect(launched).tokens)


def time_constrained(c: Constrained, steps: int, warmup: int) -> float:
    """Median seconds of one synchronous constrained step."""
    for _ in range(warmup):
        c.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        c.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_constrained_overlapped(c: Constrained, steps: int, warmup: int) -> float:
    """Median seconds between step completions, the scheduler's overlap loop with masks: launch
    step N+1's forward, collect step N and accept its tokens, fill step N+1's bitmask while the
    device runs the forward, launch its sampling."""
    engine, batch = c.engine, c.batch
    prev = engine.sample(engine.launch(batch), c.bitmask())
    times = []
    last = time.perf_counter()
    for i in range(warmup + steps):
        nxt = engine.launch(batch)
        c.accept(engine.collect(prev).tokens)
        prev = engine.sample(nxt, c.bitmask())
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - last)
        last = now
    engine.collect(prev)
    return statistics.median(times)


def profile_steps(engine: Engine, batch: Batch, steps: int = 5, rows: int = 25) -> str:
    """The device kernels of `steps` decode steps, summed by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    engine.forward(batch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.forward(batch)
    table = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:  # the key's name changed across torch versions
            # wide names: cuBLAS kernel names carry their tile shapes
            return table.table(sort_by=key, row_limit=rows, max_name_column_width=110)
        except (AttributeError, KeyError):
            continue
    return table.table(row_limit=rows)


def time_graph(engine: Engine, batch: Batch, steps: int) -> Optional[float]:
    """Median device milliseconds of the captured decode graph alone (its one input copy and the
    replay), without sampling and host work: separates GPU time from scheduling overhead. None
    without a graph for this batch (CPU, or larger than the largest graph)."""
    lora = any(r.lora is not None for r in batch.reqs)
    if engine.graphs is None or not engine.graphs.can_run(batch, lora):
        return None
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.graphs.replay(batch, lora)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_rank(args: argparse.Namespace, rank: int, init_method: str, out: Any) -> None:
    """Build this rank's engine and time every batch size; rank 0 sends the rows to `out`."""
    sizes: List[int] = args.batch_sizes
    pages_per_req = -(-(context_range(args.context)[1] + 1 + args.verify) // args.page_size)
    prefill_reqs = len(prefill_lengths(args.prefill, 0)) if args.prefill else 0
    kv_tokens = max(max(sizes) * pages_per_req * args.page_size,
                    args.prefill + prefill_reqs * args.page_size)
    cfg = replace(engine_settings(args), max_running_requests=max(max(sizes), prefill_reqs),
                  max_kv_tokens=kv_tokens, load_format="dummy",
                  show_progress=False).for_rank(args.model, rank, init_method)
    groups = init_process_groups(cfg.tp_info, cfg.torch_device, init_method, cfg.dist_timeout_s,
                                 cfg.allreduce)
    try:
        eagle = args.draft and ModelConfig.from_dir(Path(args.draft)).eagle is not None
        engine = Engine(cfg, groups, verify_tokens=1 + args.verify if args.verify else 0,
                        draft_path=args.draft, draft_method="eagle3" if eagle else "draft_model")
        if args.tune_gemms and rank == 0:
            print(f"tuned GEMMs, cuBLASLt chosen for: {blas.describe(engine.model)}", flush=True)
        engine.pool.fill_normal_()  # random K/V: never time on zeros
        if args.lora:
            random_adapters(engine)
        dev = engine.device
        mib = args.copy_mib or (4096 if dev.type == "cuda" else 256)
        bandwidth = measure_copy_bandwidth(dev, mib << 20)
        compiled = None
        if args.json_schema:
            with open(args.json_schema) as f:
                schema = f.read()
            cache = GrammarCache(TokenizerSource(model_path=tokenizer_dir(args),
                                                 vocab_size=engine.vocab_size,
                                                 stop_ids=engine.eos_token_ids))
            compiled = cache.check(StructuredOutput("json", schema))
        rows = []
        for bs in sizes:
            weights = weight_bytes_read(engine, bs)
            batch = decode_batch(engine, bs, args.context, engine.model_cfg.vocab_size, bs)
            if args.lora:
                with_adapter(batch)
            step = time_steps(engine, batch, args.steps, args.warmup)
            kv = kv_bytes_read(engine, batch)
            overlap = time_steps_overlapped(engine, batch, args.steps, args.warmup)
            json_ms: Tuple[Optional[float], Optional[float]] = (None, None)
            if compiled is not None:
                c = Constrained(engine, batch, compiled)
                json_ms = (time_constrained(c, args.steps, args.warmup) * 1e3,
                           time_constrained_overlapped(c, args.steps, args.warmup) * 1e3)
                batch.masked = False
            verify_ms = None
            if args.verify:
                vbatch = verify_batch(engine, bs, args.context, engine.model_cfg.vocab_size, bs,
                                      args.verify)
                verify_ms = time_steps(engine, vbatch, args.steps, args.warmup) * 1e3
                if args.profile and rank == 0:
                    print(f"profile of a verify step at batch {bs}:\n"
                          + profile_steps(engine, vbatch, rows=40), flush=True)
            rows.append(Row(bs, args.context, step * 1e3, (weights + kv) / bandwidth * 1e3,
                            weights / 1e9, kv / 1e9, time_graph(engine, batch, args.steps),
                            overlap * 1e3, *json_ms, verify_ms))
            if args.profile and rank == 0:
                print(f"profile of decode at batch {bs}:\n" + profile_steps(engine, batch),
                      flush=True)
        prefill = time_prefill(engine, args, rank) if args.prefill else None
        if rank == 0:
            out.put((bandwidth, rows, torch.cuda.get_device_name(dev) if dev.type == "cuda"
                     else "cpu", prefill))
    finally:
        destroy_process_groups()


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_table(args: argparse.Namespace, bandwidth: float, rows: List[Row], device: str,
                prefill: Optional[Dict[str, float]] = None) -> None:
    print(f"model {args.model}, tp {args.tp}, {device}, copy bandwidth {bandwidth / 1e9:,.0f} GB/s "
          f"(read + write), context {args.context}")
    print(f"{'batch':>6} {'step ms':>9} {'overlap ms':>11} {'graph ms':>9} {'roofline ms':>12} "
          f"{'% roofline':>11} {'weights GB':>11} {'KV GB':>7} {'tok/s':>9}")
    for r in rows:
        print(f"{r.batch:>6} {r.step_ms:>9.3f} {_ms(r.overlap_ms):>11} {_ms(r.graph_ms):>9} "
              f"{r.roofline_ms:>12.3f} {100 * r.efficiency:>10.1f}% {r.weight_gb:>11.3f} "
              f"{r.kv_gb:>7.3f} {r.tok_s:>9,.0f}")
    if any(r.json_overhead is not None for r in rows):
        print(f"with --json-schema {args.json_schema}:")
        print(f"{'batch':>6} {'json ms':>9} {'json overlap ms':>16} {'overhead':>9}")
        for r in rows:
            overhead = r.json_overhead
            print(f"{r.batch:>6} {_ms(r.json_step_ms):>9} {_ms(r.json_overlap_ms):>16} "
                  f"{'-' if overhead is None else f'{100 * overhead:+.1f}%':>9}")
    if args.verify:
        print(f"speculative verify step (newest token + {args.verify} drafts a request, a verify "
              f"graph where one fits; speculation pays where a verify keeps more tokens a "
              f"request than the ratio):")
        print(f"{'batch':>6} {'verify ms':>10} {'step ms':>9} {'ratio':>7}")
        for r in rows:
            ratio = None if r.verify_ms is None else r.verify_ms / r.step_ms
            print(f"{r.batch:>6} {_ms(r.verify_ms):>10} {r.step_ms:>9.3f} "
                  f"{'-' if ratio is None else f'{ratio:.2f}':>7}")
    print("% roofline and tok/s use the overlapped step (the scheduler's default loop); "
          "step ms waits for each step's tokens before launching the next")
    if prefill:
        print(f"prefill step: {prefill['tokens']} tokens in {prefill['requests']} prompts, "
              f"{prefill['ms']:.1f} ms, {prefill['matrix_tflops']:.0f} TFLOP/s in the matrices")
    print("RESULT " + json.dumps({
        "model": args.model, "tp": args.tp, "device": device, "context": args.context,
        "prefill": prefill,
        "copy_gb_s": round(bandwidth / 1e9, 1), "attention_backend": args.attention_backend,
        "pdl": args.pdl, "tune_gemms": args.tune_gemms,
        "allreduce": args.allreduce,
        "json_schema": args.json_schema, "lora": args.lora, "max_lora_rank": args.max_lora_rank,
        "verify_drafts": args.verify, "draft": args.draft,
        "rows": [{**asdict(r), "pct_roofline": round(100 * r.efficiency, 1),
                  "json_overhead_pct": None if r.json_overhead is None
                  else round(100 * r.json_overhead, 1)} for r in rows]}))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    if args.tp == 1:
        run_rank(args, 0, init_method, results)
    else:
        procs = [ctx.Process(target=run_rank, args=(args, r, init_method, results))
                 for r in range(args.tp)]
        for p in procs:
            p.start()
        try:  # take rank 0's rows before joining: a child exits only once its queue is drained
            found = results.get(timeout=600)
        finally:
            for p in procs:
                p.join(timeout=60)
            for p in procs:  # a rank stuck in communicator teardown must not hang the script
                if p.is_alive():
                    p.kill()
                    p.join()
        bad = [p.exitcode for p in procs if p.exitcode and p.exitcode > 0]
        if bad:
            raise SystemExit(f"a rank failed (exit codes {bad})")
        print_table(args, *found)
        return
    print_table(args, *results.get(timeout=60))


if __name__ == "__main__":
    main()
