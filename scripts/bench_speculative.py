#!/usr/bin/env python3
"""Speculative decoding by n-gram lookup against plain decoding, on a workload whose answers
repeat their prompts: each request quotes a passage of `scripts/data/two_cities.txt` and asks
for it back with one change ("Copy the text, replacing X with Y"), as code editing and
document rewriting ask. Greedy, `--requests` requests of `--max-tokens` tokens at
`--concurrency` at a time, through `minisgl.LLM` with and without `--speculative-config`;
prints tokens/s, the draft acceptance and whether the tokens were the same, then one line of
JSON (prefixed "RESULT ").

Needs a model that follows instructions (the default model does); dummy weights draft nothing
worth keeping.

    PYTHONPATH=. python scripts/bench_speculative.py --device cpu --requests 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

TEXT = Path(__file__).resolve().parent / "data" / "two_cities.txt"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}


def chats(n: int, words: int) -> List[List[Dict[str, str]]]:
    """`n` requests, each quoting `words` words of the text (a different passage each: their
    starts spread over the text, overlapping where `n` x `words` is longer than it)."""
    text = TEXT.read_text().split()
    if not 0 < words <= len(text):
        raise ValueError(f"words must be in [1, {len(text)}] (the text's), got {words}")
    step = (len(text) - words) / max(n - 1, 1)
    out = []
    for i in range(n):
        start = round(i * step)
        passage = " ".join(text[start:start + words])
        out.append([{"role": "user", "content": "Copy this text exactly, but write 'it' in "
                                                f"capitals everywhere:\n\n{passage}"}])
    return out


def run(args: argparse.Namespace, spec: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    # imported here so that vLLM's side (scripts/experiments/spec_peer_vllm.py) can take
    # `chats` without minisgl's packages
    from minisgl import LLM, SamplingParams
    from minisgl.message import SchedulerStats

    kw: Dict[str, Any] = {"speculative_config": spec} if spec is not None else {}
    kw.update({k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v})
    with LLM(args.model, max_running_requests=args.concurrency,
             show_progress=False, **kw) as llm:
        prompts = chats(args.requests, args.words)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        llm.chat(prompts[:1], params)  # warm-up: a whole request (its verify steps too)
        t0 = time.perf_counter()
        outs = llm.chat(prompts, params)
        seconds = time.perf_counter() - t0
        stats = llm.stats or SchedulerStats()  # (None only before a first step)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"speculative": spec is not None, "seconds": round(seconds, 3),
            "output_tokens": tokens, "tok_per_s": round(tokens / seconds, 1),
            "draft_tokens": stats.spec_draft_tokens_total,
            "accepted_tokens": stats.spec_accepted_tokens_total,
            "verify_steps": stats.verify_steps_total,
            "ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled default model")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: the model's (float32 on CPU)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--speculative-config", default=json.dumps(SPEC))
    args = p.parse_args()
    plain = run(args, None)
    spec = run(args, json.loads(args.speculative_config))
    same = sum(a == b for a, b in zip(plain.pop("ids"), spec.pop("ids")))
    for r in (plain, spec):
        print(f"{'ngram' if r['speculative'] else 'plain':>6}: {r['tok_per_s']:8.1f} tok/s "
              f"({r['output_tokens']} tokens in {r['seconds']} s)")
    kept = spec["accepted_tokens"] / max(spec["draft_tokens"], 1)
    print(f"speedup {spec['tok_per_s'] / plain['tok_per_s']:.2f}x, drafts kept "
          f"{100 * kept:.1f}%, the same tokens in {same} of {args.requests} requests")
    print("RESULT " + json.dumps({"plain": plain, "ngram": spec, "same_requests": same,
                                  "speculative_config": json.loads(args.speculative_config),
                                  "concurrency": args.concurrency}))


if __name__ == "__main__":
    main()
