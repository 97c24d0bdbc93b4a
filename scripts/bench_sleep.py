#!/usr/bin/env python3
"""Sleep mode's cost on one GPU: how much device memory each level hands back and how long a
sleep and a wake-up take (a wake-up includes capturing the CUDA graphs again).

Runs the offline API at tp=1 (`LLM(enable_sleep_mode=True)`, dummy weights by default), greedy
tokens of a few prompts before and after each cycle (they must be equal: a mismatch exits 1; level 2
forgets dummy weights, so only a checkpoint's are compared there),
and prints a table and one line of JSON (prefixed "RESULT "). Memory is the device's in use
(`torch.cuda.mem_get_info`), so what other processes hold shows too.

    PYTHONPATH=. python scripts/bench_sleep.py --model configs/models/llama-3.1-8b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List

import torch

from minisgl import LLM, SamplingParams


def _used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _tokens(llm: LLM) -> List[List[int]]:
    prompts = [[1 + (7 * i + j) % 500 for j in range(24 + i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="configs/models/llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--cycles", type=int, default=2, help="sleep / wake cycles per level")
    args = parser.parse_args()
    llm = LLM(args.model, load_format=args.load_format, enable_sleep_mode=True,
              show_progress=False)
    want = _tokens(llm)
    rows: List[Dict[str, Any]] = []
    for level in (1, 2):
        for cycle in range(args.cycles):
            awake = _used_gib()
            sleep_s = _timed(lambda: llm.sleep(level))
            asleep = _used_gib()
            if level == 1:
                wake_s = _timed(llm.wake_up)
            else:  # the weights forgotten: woken (zeros), reloaded where a checkpoint is
                wake_s = _timed(lambda: llm.wake_up(["weights"]))
                if args.load_format != "dummy":
                    llm.update_weights_from_disk(args.model)
                wake_s += _timed(lambda: llm.wake_up(["kv_cache"]))
            tokens = _tokens(llm)
            same = tokens == want if level == 1 or args.load_format != "dummy" else None
            rows.append({"level": level, "cycle": cycle, "awake_gib": round(awake, 2),
                         "asleep_gib": round(asleep, 2), "sleep_s": round(sleep_s, 3),
                         "wake_s": round(wake_s, 3), "same_tokens": same})
            print(f"level {level} cycle {cycle}: {awake:.2f} GiB in use -> {asleep:.2f} asleep; "
                  f"sleep {sleep_s:.2f} s, wake {wake_s:.2f} s; tokens equal: {same}",
                  flush=True)
    print("RESULT " + json.dumps({"model": args.model, "gpu": torch.cuda.get_device_name(),
                                  "rows": rows}))
    llm.close()
    return 0 if all(r["same_tokens"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
