#!/usr/bin/env python3
"""vLLM 0.26's n-gram speculative decoding on `scripts/bench_speculative.py`'s workload, for a
side-by-side ratio on the GPU machine (vLLM's site dir only: minisgl is not imported; the
prompts come from bench_speculative's `chats`, rendered by the model's own chat template).

Greedy, the same requests, `--concurrency` at a time (vLLM's max_num_seqs), with and without
`--speculative-config`, each engine in a process of its own (`--one plain|ngram`); vLLM's
defaults otherwise (torch.compile, CUDA graphs). Prints one `RESULT {json}` line per run.

    PYTHONPATH=/tmp/vsite python3 scripts/experiments/spec_peer_vllm.py --model DIR --one ngram
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def bench_module():
    """scripts/bench_speculative.py, whose module level imports only the standard library."""
    spec = importlib.util.spec_from_file_location("bench_speculative",
                                                  HERE.parent / "bench_speculative.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--one", choices=("plain", "ngram"), required=True)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--speculative-config", default=None, help="default: bench_speculative's")
    args = p.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    bench = bench_module()
    spec = json.loads(args.speculative_config) if args.speculative_config else bench.SPEC
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(args.model)
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in bench.chats(args.requests, args.words)]
    prompts = [TokensPrompt(prompt_token_ids=tok.encode(t, add_special_tokens=False))
               for t in texts]
    print(f"[vllm] {len(prompts)} prompts, {sum(len(p['prompt_token_ids']) for p in prompts)} "
          f"tokens")
    kw = {"speculative_config": spec} if args.one == "ngram" else {}
    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=args.concurrency, seed=0,
              gpu_memory_utilization=0.5, max_model_len=2048, generation_config="vllm", **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: a whole request
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[vllm] {args.one}: {tokens / seconds:.1f} tok/s ({tokens} tokens in {seconds:.3f} s)")
    print("RESULT " + json.dumps({"engine": "vllm", "run": args.one, "seconds": round(seconds, 3),
                                  "output_tokens": tokens, "tok_per_s": round(tokens / seconds, 1),
                                  "ids": [list(o.outputs[0].token_ids) for o in outs]}))
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine process otherwise outlives a slow teardown


if __name__ == "__main__":
    main()
