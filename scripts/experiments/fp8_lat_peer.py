#!/usr/bin/env python3
"""Batch-1 and batch-16 decode steps of vLLM and minisgl with FP8 weights (and FP8 KV), the
same method for both engines: (time of generate(B fresh 512-token prompts, 257 tokens) - time
of generate(B fresh prompts, 1 token)) / 256, best of two after warm-ups, through each engine's
offline API with dummy weights of the Llama-3.1-8B shape. It is `.peer/lat_peer.py`'s method
with the quantization flags it lacks (issue 22: where minisgl's batch-1 FP8 step stands
against vLLM's). Run on the GPU machine after `.peer/peer.sh` has unpacked vLLM:

    PYTHONPATH=/tmp/vsite python3 scripts/experiments/fp8_lat_peer.py --engine vllm
    PYTHONPATH=/tmp/site:$PWD python3 scripts/experiments/fp8_lat_peer.py --engine minisgl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Callable, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Gen = Callable[[List[List[int]], List[int]], int]


def vllm_engine(model: str, kv_dtype: str) -> Gen:
    sys.path.insert(0, os.path.join(ROOT, ".peer"))
    import run_vllm_peer as rp  # .peer/: the peer bundle's own settings (env, LLM keywords)
    for k, v in rp.ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    rp._shim_llguidance_if_unloadable()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    flags = ["--main", ROOT, "--model", model, "--quantization", "fp8"]
    if kv_dtype != "auto":
        flags += ["--kv-cache-dtype", kv_dtype]
    llm = LLM(**rp.llm_kwargs(rp.parse_args(flags), "default"))

    def gen(prompts: List[List[int]], lens: List[int]) -> int:
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0,
                                           detokenize=False) for n in lens], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out)
    return gen


def minisgl_engine(model: str, kv_dtype: str) -> Gen:
    sys.path.insert(0, ROOT)
    from minisgl import LLM, SamplingParams
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", quantization="fp8",
              kv_cache_dtype=kv_dtype, show_progress=False)

    def gen(prompts: List[List[int]], lens: List[int]) -> int:
        out = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0,
                                                    ignore_eos=True) for n in lens])
        return sum(len(o.token_ids) for o in out)
    return gen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["vllm", "minisgl"], required=True)
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "llama-3.1-8b"))
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", help="auto: the model's dtype")
    p.add_argument("--batches", default="1,16")
    a = p.parse_args()
    vocab = json.load(open(os.path.join(a.model, "config.json")))["vocab_size"]
    make = vllm_engine if a.engine == "vllm" else minisgl_engine
    gen = make(os.path.abspath(a.model), a.kv_cache_dtype)
    rows = []
    for bs in [int(x) for x in a.batches.split(",")]:
        rng = random.Random(1000 + bs)

        def fresh() -> List[List[int]]:
            return [[rng.randrange(1000, vocab - 1) for _ in range(512)] for _ in range(bs)]
        gen(fresh(), [8] * bs)
        gen(fresh(), [8] * bs)
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            gen(fresh(), [1] * bs)
            short = time.perf_counter() - t
            t = time.perf_counter()
            gen(fresh(), [257] * bs)
            best = min(best, (time.perf_counter() - t - short) / 256 * 1000)
        rows.append({"batch": bs, "step_ms": round(best, 3)})
        print(f"[{a.engine}] FP8 weights, KV {a.kv_cache_dtype}, batch {bs}: decode step "
              f"{best:.3f} ms", flush=True)
    print("RESULT " + json.dumps({"engine": a.engine, "kv": a.kv_cache_dtype, "rows": rows}),
          flush=True)
    os._exit(0)  # vLLM's engine threads may hold the interpreter


if __name__ == "__main__":
    main()
