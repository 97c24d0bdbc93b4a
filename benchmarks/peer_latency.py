#!/usr/bin/env python3
"""Time to first token and decode step time of vLLM or minisgl, one engine per run, measured the
same way through each engine's offline API (dummy weights, bf16 unless flags say otherwise).

- First token: `generate` of one fresh prompt of each --lengths length for one token (prefill
  plus the first token), median of --repeats after three warm-ups.
- Decode step at batch B (512-token fresh prompts): (time of B prompts for 257 tokens - time of
  B prompts for 1 token) / 256, best of two after two warm-ups (the method of the vLLM peer's
  lat_peer.py, extended to batch 256).

vLLM is driven through the peer bundle's run_vllm_peer.py (its engine settings and environment),
found in --peer-dir. Prints one line of JSON (prefixed "RESULT ").

    python benchmarks/peer_latency.py --engine minisgl --main .
    PYTHONPATH=/tmp/vsite python benchmarks/peer_latency.py --engine vllm --main . --peer-dir .peer
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, List, cast


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["vllm", "minisgl"], required=True)
    p.add_argument("--main", required=True, help="the minisgl checkout")
    p.add_argument("--peer-dir", default=".peer", help="the vLLM peer bundle (vLLM only)")
    p.add_argument("--model", default=None, help="default: MAIN/configs/models/llama-3.1-8b")
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="both engines' (default: the longest of --lengths, at least 8,192, "
                        "+ 16, so that a length's first token is timed under one engine "
                        "setting whichever other lengths run)")
    p.add_argument("--quantization", default=None, help="both engines' weight quantization")
    p.add_argument("--kv-cache-dtype", default=None, help="both engines' KV cache dtype")
    p.add_argument("--deterministic", action="store_true",
                   help="both engines batch-invariant: vLLM's VLLM_BATCH_INVARIANT=1, "
                        "minisgl's enable_deterministic_inference")
    return p.parse_args()


Generate = Callable[[List[List[int]], int], int]


def vllm_engine(args: argparse.Namespace, max_len: int) -> Generate:
    sys.path.insert(0, os.path.abspath(args.peer_dir))
    import run_vllm_peer as rp
    for k, v in rp.ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    if args.deterministic:  # read by vLLM as it imports
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    rp._shim_llguidance_if_unloadable()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    flags = ["--main", args.main, "--max-model-len", str(max_len)]
    if args.model:
        flags += ["--model", args.model]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    if args.kv_cache_dtype:
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    llm = LLM(**rp.llm_kwargs(rp.parse_args(flags), "default"))

    def gen(prompts: List[List[int]], n: int) -> int:
        out = llm.generate([TokensPrompt(prompt_token_ids=list(q)) for q in prompts],
                           SamplingParams(max_tokens=n, ignore_eos=True, temperature=0,
                                          detokenize=False), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out)
    return gen


def minisgl_engine(args: argparse.Namespace, max_len: int, model: str) -> Generate:
    sys.path.insert(0, os.path.abspath(args.main))
    from minisgl import LLM, SamplingParams
    extra = {}
    if args.quantization:
        extra["quantization"] = args.quantization
    if args.kv_cache_dtype:
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.deterministic:
        extra["enable_deterministic_inference"] = True
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", show_progress=False, **extra)

    def gen(prompts: List[List[int]], n: int) -> int:
        out = llm.generate([list(q) for q in prompts],
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return sum(len(o.token_ids) for o in out)
    return gen


def main() -> None:
    args = parse_args()
    model = args.model or os.path.join(args.main, "configs", "models", "llama-3.1-8b")
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",") if x]
    max_len = args.max_model_len or max(lengths + [8192]) + 16
    gen = (vllm_engine(args, max_len) if args.engine == "vllm"
           else minisgl_engine(args, max_len, model))
    rng = random.Random(0)

    def fresh(n: int, length: int) -> List[List[int]]:
        return [[rng.randrange(1000, vocab - 1) for _ in range(length)] for _ in range(n)]

    ttft = {}
    for length in lengths:
        for _ in range(3):
            gen(fresh(1, length), 1)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            gen(fresh(1, length), 1)
            times.append(time.perf_counter() - start)
        ttft[length] = round(statistics.median(times) * 1000, 3)
        print(f"[{args.engine}] first token of a {length}-token prompt: {ttft[length]:.2f} ms "
              f"(median of {args.repeats})", flush=True)
    steps = {}
    for bs in batches:
        gen(fresh(bs, 512), 8)
        gen(fresh(bs, 512), 8)
        best = None
        for _ in range(2):
            start = time.perf_counter()
            gen(fresh(bs, 512), 1)
            short = time.perf_counter() - start
            start = time.perf_counter()
            gen(fresh(bs, 512), 257)
            ms = (time.perf_counter() - start - short) / 256 * 1000
            best = ms if best is None else min(best, ms)
        steps[bs] = round(cast(float, best), 3)  # not None: the loop above ran twice
        print(f"[{args.engine}] decode step at batch {bs}: {best:.3f} ms", flush=True)
    print("RESULT " + json.dumps({"engine": args.engine, "ttft_ms": ttft, "step_ms": steps,
                                  "quantization": args.quantization,
                                  "kv_cache_dtype": args.kv_cache_dtype,
                                  "deterministic": args.deterministic}), flush=True)
    os._exit(0)  # vLLM's workers and threads: no slow teardown inside the time limit


if __name__ == "__main__":
    main()
