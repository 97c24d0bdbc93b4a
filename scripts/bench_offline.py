#!/usr/bin/env python3
"""Offline throughput: the standard workload through `minisgl.LLM`, optionally against HF.

Standard workload: 256 requests, input and output lengths uniform in [100, 1024], seed 0, random
token ids, ignore_eos, greedy; dummy weights of a configs/models shape. `--shared-prefix N`
prepends one common N-token prefix to every prompt (compare `--cache radix` with `--cache naive`;
the untimed warm-up runs the prefix once, so the timed requests can find it cached).
`--peer hf` then runs Hugging Face transformers' continuous batching on the same shape (random
weights) and the same requests, and prints the throughput ratio.

Prints output and total tokens/s, then one line of JSON per engine (prefixed "RESULT ").

    PYTHONPATH=. python scripts/bench_offline.py --model configs/models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import ast
import gc
import inspect
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from minisgl import LLM, SamplingParams
from minisgl.engine import EngineConfig
from minisgl.message import SchedulerStats
from minisgl.models import ModelConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.settings import add_flags, build, from_namespace
from minisgl.devices import resolve_device
from minisgl.utils import offline_prefill_tokens

# HF continuous batching's share of free GPU memory for its KV cache: its default (0.9) ran out
# of memory in its own prefill on the 256-request workload of the 8B shape (H200).
HF_MEMORY_PERCENT = 0.7
# HF continuous batching's torch.compile level (0-3; transformers' default is 0, no compile). On
# the 8B shape's 256 requests (H200, transformers 5.17) level 1 made HF 23% faster than level 0
# (650 against 528 output tok/s, same machine and hour) for about 80 s more warm-up, so the peer
# runs at 1. Levels 2 and 3 (max-autotune) warm up longer still and are not measured yet.
HF_COMPILE_LEVEL = 1
# On CPU HF sizes its KV cache from a share of the machine's total RAM (gigabytes, whatever the
# model): bound it to minisgl's own CPU default, with a batch small enough that its attention
# masks stay small too.
HF_CPU_KV_TOKENS = 16384
HF_CPU_BATCH_TOKENS = 2048
# The engine and scheduler settings, with the script's default weights: random, of a shape.
SETTINGS = SchedulerConfig(engine=EngineConfig(load_format="dummy"))


@dataclass(frozen=True)
class Workload:
    prompts: List[List[int]]
    output_lens: List[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class Result:
    engine: str
    requests: int
    seconds: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="configs/models/llama-3.1-8b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100, help="input and output length minimum")
    p.add_argument("--max-len", type=int, default=1024, help="input and output length maximum")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N random tokens")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up (kernel compilation, allocator)")
    p.add_argument("--peer", choices=["hf"], default=None)
    p.add_argument("--peer-num-prompts", type=int, default=None, metavar="N",
                   help="run the peer (and minisgl again, for the ratio) on the first N requests "
                        "only: HF's side of the full 8B workload takes longer than a GPU job may")
    p.add_argument("--peer-cuda-graph", choices=["on", "off"], default="on",
                   help="HF continuous batching with CUDA graphs (on, the default) or without: "
                        "take the faster of the two as HF's best")
    p.add_argument("--peer-memory-percent", type=float, default=HF_MEMORY_PERCENT,
                   help="HF's max_memory_percent: the share of free GPU memory its KV cache "
                        "takes (see HF_MEMORY_PERCENT)")
    p.add_argument("--peer-cb-option", action="append", default=[], metavar="KEY=VALUE",
                   type=cb_option,
                   help="one more field of HF's ContinuousBatchingConfig (repeatable; VALUE a "
                        "Python literal, e.g. q_padding_interval_size=64 "
                        "default_compile_level=1), to search for HF's best settings")
    p.add_argument("--peer-attn", default="sdpa",
                   help="attn_implementation for the HF peer (e.g. sdpa, paged|sdpa, "
                        "flash_attention_2)")
    add_flags(p, SETTINGS)  # --seed also seeds the workload
    args = p.parse_args(argv)
    try:
        build(SETTINGS, from_namespace(args, SETTINGS), "command line")
    except ValueError as e:
        p.error(str(e))
    return args


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int,
                  shared_prefix: int = 0) -> Workload:
    """Random prompts (after an optional shared prefix) and output lengths, all seeded."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    prompts, outs = [], []
    for _ in range(n):
        in_len = rng.randint(min_len, max_len)
        prompts.append(prefix + [rng.randrange(vocab) for _ in range(in_len)])
        outs.append(rng.randint(min_len, max_len))
    return Workload(prompts, outs)


def warmup_workload(vocab: int, seed: int, work: Workload, shared_prefix: int) -> Workload:
    """A few short requests of other tokens (compiles kernels, sizes the allocator) and, with a
    shared prefix, one request made of that prefix: the timed run then measures the steady state
    of a server that has seen the prefix before (the cache inserts a request's KV when it ends)."""
    warm = make_workload(8, 16, 300, vocab, seed + 1_000_003)
    if shared_prefix:
        warm.prompts.append(work.prompts[0][:shared_prefix])
        warm.output_lens.append(1)
    return warm


def run_minisgl(args: argparse.Namespace, work: Workload, warm: Optional[Workload]) -> Result:
    llm = LLM(args.model, show_progress=False, **from_namespace(args, SETTINGS))
    try:
        def params(lens: List[int]) -> List[SamplingParams]:
            return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        if warm is not None:
            llm.generate(warm.prompts, params(warm.output_lens))
        _sync()
        before = llm.stats
        # Wall-clock start, to tell apart work done inside the timed run (e.g. kernel builds,
        # by the Triton cache files' times).
        print(f"[minisgl] timed run starts at unix time {time.time():.3f}", flush=True)
        t0 = time.perf_counter()
        outs = llm.generate(work.prompts, params(work.output_lens))
        _sync()
        seconds = time.perf_counter() - t0
        print_phases(before, llm.stats)
    finally:
        llm.close()
    out_tokens = sum(len(o.token_ids) for o in outs)
    if out_tokens != sum(work.output_lens):
        raise RuntimeError(f"generated {out_tokens} tokens, expected {sum(work.output_lens)}")
    return Result("minisgl", len(work.prompts), seconds, work.input_tokens, out_tokens,
                  sum(o.cached_tokens for o in outs))


def print_phases(before: Optional[SchedulerStats], after: Optional[SchedulerStats]) -> None:
    """Where the timed run's wall time went: forward passes and busy seconds by phase."""
    if after is None:
        return
    b = before or SchedulerStats()
    for phase in ("prefill", "decode"):
        steps = getattr(after, f"{phase}_steps_total") - getattr(b, f"{phase}_steps_total")
        secs = getattr(after, f"{phase}_seconds_total") - getattr(b, f"{phase}_seconds_total")
        tokens = (after.prefilled_tokens_total - b.prefilled_tokens_total if phase == "prefill"
                  else after.generated_tokens_total - b.generated_tokens_total)
        if steps:
            print(f"  {phase}: {steps} steps, {secs:.2f} s busy, {1e3 * secs / steps:.2f} ms per "
                  f"step, {tokens / steps:.1f} tokens per step (approx.)")
    print(f"  host waited for the device {after.wait_seconds_total - b.wait_seconds_total:.2f} s "
          f"of the run (near zero would mean the host, not the device, is the bottleneck)")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- the Hugging Face peer -----------------------------------------------------------------------
def load_hf_model(args: argparse.Namespace) -> Any:
    """The same shape with random weights (or the checkpoint, with --load-format auto)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    dtype = {None: torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if args.load_format == "auto":
        # Any: PreTrainedModel.to is decorated with functools.wraps, and typeshed's _Wrapped has
        # no __get__ (python/typeshed#10653), so mypy takes `device` for `self`. Not an ignore:
        # transformers 4.x's from_pretrained returns Any, where the ignore would be unused.
        model: Any = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, attn_implementation=args.peer_attn)
        return model.to(device).eval()
    cfg = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: an 8B model's CPU init takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                 attn_implementation=args.peer_attn)
    return model.eval()


def cb_option(text: str) -> Tuple[str, Any]:
    """`KEY=VALUE` (--peer-cb-option) as (key, value): VALUE as a Python literal where it is one
    (64, 0.5, True, None), else the string itself."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return key.strip(), value


def hf_cpu_cache_bounds(page_size: int = 256) -> Dict[str, Any]:
    """HF continuous batching's cache and batch sizes on CPU: HF_CPU_KV_TOKENS of KV cache (in
    blocks of `page_size`, HF's default) and HF_CPU_BATCH_TOKENS per step."""
    return {"page_size": page_size, "num_blocks": -(-HF_CPU_KV_TOKENS // page_size),
            "max_batch_tokens": HF_CPU_BATCH_TOKENS}


def hf_batching_options(gen: Any, on_cuda: bool, cuda_graph: bool = True,
                        memory_percent: float = HF_MEMORY_PERCENT,
                        extra: Sequence[Tuple[str, Any]] = ()) -> Dict[str, Any]:
    """HF's fastest continuous-batching settings, in whichever form the installed transformers
    takes them: on CUDA, asynchronous batching, (unless `cuda_graph` is False) CUDA graphs,
    torch.compile at HF_COMPILE_LEVEL where the release has the field (newer releases: a
    ContinuousBatchingConfig; older ones read the rest from the GenerationConfig), and the KV
    cache's share of free memory; on CPU, a bounded cache (`hf_cpu_cache_bounds`). Without
    padding, HF may capture a graph per new batch shape: whether graphs help it on a workload is
    measured, not assumed (--peer-cuda-graph). `extra` (--peer-cb-option) sets further fields; one this transformers
    does not have raises ValueError naming it."""
    wanted: Dict[str, Any]  # the fields' own types (bool, float, int), each passed as it is
    if on_cuda:
        wanted = {"use_cuda_graph": cuda_graph, "use_async_batching": True,
                  "max_memory_percent": memory_percent, "default_compile_level": HF_COMPILE_LEVEL}
    else:
        wanted = hf_cpu_cache_bounds()
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        for name, value in [*wanted.items(), *extra]:
            setattr(gen, name, value)
        return {}
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    unknown = [k for k, _ in extra if k not in fields]
    if unknown:
        raise ValueError(f"--peer-cb-option: ContinuousBatchingConfig has no {unknown} (it has "
                         f"{', '.join(fields)})")
    chosen = {k: v for k, v in wanted.items() if k in fields}
    chosen.update(extra)
    return {"continuous_batching_config": ContinuousBatchingConfig(**chosen)}


def start_hf_manager(model: Any, max_new_tokens: int, cuda_graph: bool = True,
                     memory_percent: float = HF_MEMORY_PERCENT,
                     extra: Sequence[Tuple[str, Any]] = ()) -> Optional[Any]:
    """A started continuous-batching manager (greedy, no EOS), or None where the installed
    transformers has no per-request max_new_tokens (then `generate_batch` is the fallback)."""
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                           pad_token_id=0)
    options = hf_batching_options(gen, model.device.type == "cuda", cuda_graph, memory_percent,
                                  extra)
    print(f"hf: continuous batching options {options or 'defaults'}")
    manager = model.init_continuous_batching(generation_config=gen, **options)
    if "max_new_tokens" not in inspect.signature(manager.add_request).parameters:
        return None
    manager.start()  # cache allocation and graph capture happen here, outside the timing
    return manager


def hf_generate(model: Any, manager: Optional[Any], work: Workload, tag: str) -> int:
    """Generate every request with its own max_new_tokens; return the generated token count.
    Without a manager: `generate_batch` with one length for all (the mean), setup included."""
    if manager is None:
        from transformers import GenerationConfig
        mean = round(sum(work.output_lens) / len(work.output_lens))
        gen = GenerationConfig(do_sample=False, max_new_tokens=mean, eos_token_id=None,
                               pad_token_id=0)
        outs = model.generate_batch(inputs=work.prompts, generation_config=gen)
        return sum(len(o.generated_tokens) for o in outs.values())
    for i, (p, n) in enumerate(zip(work.prompts, work.output_lens)):
        manager.add_request(input_ids=p, request_id=f"{tag}{i}", max_new_tokens=n)
    done: Dict[str, int] = {}
    t0 = time.perf_counter()
    while len(done) < len(work.prompts):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("the HF continuous-batching thread stopped")
            continue
        if out.is_finished():
            done[out.request_id] = len(out.generated_tokens)
            # Progress for runs cut by a time limit: finished requests' tokens over the time.
            print(f"hf: {tag} {len(done)}/{len(work.prompts)} finished, {sum(done.values())} "
                  f"tokens, {time.perf_counter() - t0:.1f} s", flush=True)
    return sum(done.values())


def run_hf(args: argparse.Namespace, work: Workload, warm: Optional[Workload]) -> Result:
    model = load_hf_model(args)
    manager = start_hf_manager(model, max(work.output_lens), args.peer_cuda_graph == "on",
                               args.peer_memory_percent, args.peer_cb_option)
    print("hf: " + ("continuous batching manager, per-request max_new_tokens" if manager else
                    "generate_batch with the mean output length for all (setup timed too)"))
    try:
        if warm is not None:
            hf_generate(model, manager, warm, "warm")
        _sync()
        t0 = time.perf_counter()
        out_tokens = hf_generate(model, manager, work, "run")
        _sync()
        seconds = time.perf_counter() - t0
    finally:
        if manager is not None:
            manager.stop(block=True)
        del model, manager
        _free_device_memory()
    if out_tokens == 0:
        raise RuntimeError("the HF peer generated no tokens (see its log above)")
    if out_tokens != sum(work.output_lens):
        print(f"hf: generated {out_tokens} tokens, the workload asked for "
              f"{sum(work.output_lens)}")
    return Result("hf", len(work.prompts), seconds, work.input_tokens, out_tokens, 0)


# --- report --------------------------------------------------------------------------------------
def report(args: argparse.Namespace, r: Result) -> None:
    print(f"[{r.engine}] {r.requests} requests in {r.seconds:.2f} s: "
          f"output {r.output_tok_s:,.0f} tok/s, total {r.total_tok_s:,.0f} tok/s "
          f"(input {r.input_tokens}, output {r.output_tokens}, cached {r.cached_tokens})")
    summary = {**asdict(r), "output_tok_s": round(r.output_tok_s, 1),
               "total_tok_s": round(r.total_tok_s, 1), "model": args.model,
               "min_len": args.min_len, "max_len": args.max_len,
               "shared_prefix": args.shared_prefix, "tp": args.tp, "page_size": args.page_size,
               "cache": args.cache, "attention_backend": args.attention_backend,
               "allreduce": args.allreduce, "pdl": args.pdl, "tune_gemms": args.tune_gemms,
               "cuda_graph_max_bs": args.cuda_graph_max_bs,
               "peer_cb_option": {k: repr(v) for k, v in args.peer_cb_option},
               "disable_overlap": args.overlap is False,
               "max_running_requests": args.max_running_requests,
               "max_prefill_tokens": args.max_prefill_tokens, "seed": args.seed,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print("RESULT " + json.dumps(summary))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.max_prefill_tokens is None:  # resolved here so that the report names it
        device = torch.device(resolve_device(args.device))
        args.max_prefill_tokens = offline_prefill_tokens(device)
    vocab = ModelConfig.from_dir(args.model).vocab_size
    work = make_workload(args.num_prompts, args.min_len, args.max_len, vocab, args.seed,
                         args.shared_prefix)
    warm = None if args.no_warmup else warmup_workload(vocab, args.seed, work,
                                                      args.shared_prefix)
    ours = run_minisgl(args, work, warm)
    report(args, ours)
    if args.peer != "hf":
        return
    if args.peer_num_prompts is not None and args.peer_num_prompts < len(work.prompts):
        n = args.peer_num_prompts
        work = Workload(work.prompts[:n], work.output_lens[:n])
        print(f"peer comparison on the first {n} requests; minisgl runs them again:")
        ours = run_minisgl(args, work, warm)
        report(args, ours)
    _free_device_memory()
    peer = run_hf(args, work, warm)
    report(args, peer)
    if peer.output_tokens != sum(work.output_lens):  # requests failed (e.g. HF ran out of memory)
        raise SystemExit(f"no ratio: HF generated {peer.output_tokens} of the "
                         f"{sum(work.output_lens)} output tokens asked for (its errors are above)")
    print(f"minisgl / hf: output tok/s ratio {ours.output_tok_s / peer.output_tok_s:.2f}x "
          f"({len(work.prompts)} requests)")


if __name__ == "__main__":
    main()
