#!/usr/bin/env python3
"""Where the time to first token goes: one fresh prompt through the offline API, profiled.

For each prompt length, after a warm-up at that length, `LLM.generate` of one fresh prompt with
`max_tokens=1` (prefill plus the first token, as vLLM's peer measures it) is timed over a few
repeats, then profiled once (torch.profiler, CPU and CUDA). From the profile's trace it reports:
the wall time of the call, the device-busy time (the union of kernel intervals), the host time
before the first kernel starts, the device-idle time between the first and the last kernel,
the host time after the last kernel, the kernels by total time, and the innermost host ranges
(Python functions too, with --stack) that ran while the device sat idle longest. Prints one line of JSON (prefixed "RESULT ").

    PYTHONPATH=. python scripts/profile_ttft.py --model configs/models/llama-3.1-8b --lengths 512,2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List, NamedTuple, Tuple

import torch

from minisgl import LLM, SamplingParams


class Timeline(NamedTuple):
    """One profiled call's split, in milliseconds (see the module docstring)."""

    wall_ms: float
    busy_ms: float
    before_first_ms: float
    idle_between_ms: float
    after_last_ms: float


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="configs/models/llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--lengths", default="512,2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-graph-tokens", type=int, default=None,
                   help="the engine's prefill CUDA graph limit (default: the engine's)")
    p.add_argument("--rows", type=int, default=15, help="kernels and host ranges to list")
    p.add_argument("--trace-dir", default=None, help="keep the Chrome traces here")
    p.add_argument("--cprofile", type=int, default=0, metavar="CALLS",
                   help="also run cProfile over CALLS calls at each length and list the Python "
                        "functions by own time (the host's share)")
    p.add_argument("--stack", action="store_true",
                   help="record Python functions too (names the host work; slows the host)")
    return p.parse_args(argv)


def fresh_prompt(rng: random.Random, length: int, vocab: int) -> List[int]:
    return [rng.randrange(1000, vocab - 1) for _ in range(length)]


def first_token(llm: LLM, prompt: List[int]) -> float:
    """Seconds of one generate call of `prompt` for one token."""
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def _union_ms(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total / 1000.0


def _gaps(kernels: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Device-idle intervals between kernels, longest first."""
    gaps, end = [], None
    for lo, hi in sorted(kernels):
        if end is not None and lo > end:
            gaps.append((end, lo))
        end = hi if end is None else max(end, hi)
    return sorted(gaps, key=lambda g: g[0] - g[1])


def analyse(trace: Dict[str, Any], rows: int) -> Tuple[Timeline, List[str], List[str]]:
    """The timeline of the call annotated "ttft", its kernels by name and the host ranges that
    overlap the longest device-idle gaps."""
    events = trace["traceEvents"]
    call = next(e for e in events if e.get("name") == "ttft" and e.get("ph") == "X"
                and e.get("cat") in ("user_annotation", "cpu_op"))
    t0, t1 = call["ts"], call["ts"] + call["dur"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
            and e.get("ph") == "X" and e is not call]
    first = min(s[0] for s in spans) if spans else t1
    last = max(s[1] for s in spans) if spans else t1
    busy = _union_ms(spans)
    timeline = Timeline((t1 - t0) / 1000.0, busy, (first - t0) / 1000.0,
                        (last - first) / 1000.0 - busy, (t1 - last) / 1000.0)
    by_name: Dict[str, List[float]] = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e["dur"] / 1000.0)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]
    kernel_lines = [f"{sum(v):8.3f} ms {len(v):4d}x  {k[:110]}" for k, v in top]
    idle = _gaps(spans)[:rows] + ([(t0, first)] if first > t0 else [])
    gap_lines = []
    for lo, hi in sorted(idle, key=lambda g: g[0] - g[1])[:rows]:
        # the innermost host ranges that cover at least half of the gap
        covering = [e for e in host if min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])
                    >= 0.5 * (hi - lo)]
        names = [e["name"][:70] for e in sorted(covering, key=lambda e: e["dur"])[:4]]
        gap_lines.append(f"{(hi - lo) / 1000.0:8.3f} ms idle at +{(lo - t0) / 1000.0:7.3f} ms: "
                         + " < ".join(names))
    return timeline, kernel_lines, gap_lines


def profile_call(llm: LLM, prompt: List[int], trace_path: str, stack: bool) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                           else [])
    with profile(activities=activities, with_stack=stack) as prof:
        with record_function("ttft"):
            first_token(llm, prompt)
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        return json.load(f)


def host_profile(llm: LLM, prompts: List[List[int]], rows: int) -> str:
    """cProfile of one first-token call per prompt: Python functions by own time."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for prompt in prompts:
        first_token(llm, prompt)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main(argv: List[str] | None = None) -> None:
    args = parse_args(argv)
    graphs = ({} if args.prefill_graph_tokens is None
              else {"prefill_graph_tokens": args.prefill_graph_tokens})
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
              show_progress=False, **graphs)
    vocab = llm.vocab_size
    rng = random.Random(0)
    results = []
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="ttft-")
    os.makedirs(trace_dir, exist_ok=True)
    for length in [int(x) for x in args.lengths.split(",")]:
        for _ in range(3):
            first_token(llm, fresh_prompt(rng, length, vocab))
        times = [first_token(llm, fresh_prompt(rng, length, vocab)) for _ in range(args.repeats)]
        trace = profile_call(llm, fresh_prompt(rng, length, vocab),
                             os.path.join(trace_dir, f"ttft_{length}.json"), args.stack)
        timeline, kernel_lines, gap_lines = analyse(trace, args.rows)
        ms = statistics.median(times) * 1000.0
        print(f"== prompt {length}: prefill + first token {ms:.2f} ms (median of {args.repeats}; "
              f"best {min(times) * 1000.0:.2f})", flush=True)
        print("   profiled call: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                  timeline._asdict().items()), flush=True)
        print("   kernels:\n     " + "\n     ".join(kernel_lines), flush=True)
        print("   longest device-idle gaps (host ranges covering them):\n     "
              + "\n     ".join(gap_lines), flush=True)
        if args.cprofile:
            print(host_profile(llm, [fresh_prompt(rng, length, vocab)
                                     for _ in range(args.cprofile)], 3 * args.rows), flush=True)
        results.append({"length": length, "ttft_ms": round(ms, 3),
                        "best_ms": round(min(times) * 1000.0, 3),
                        **{k: round(v, 3) for k, v in timeline._asdict().items()}})
    print("RESULT " + json.dumps({"rows": results}), flush=True)
    llm.close()


if __name__ == "__main__":
    main()
