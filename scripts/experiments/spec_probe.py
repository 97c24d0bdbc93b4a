#!/usr/bin/env python3
"""Where a speculative run's time goes on CUDA: bench_speculative's workload three times in
one LLM (plain, then n-gram), per-round seconds, per-request equality, and a cProfile of the
last n-gram round (Python time and where it waits on the GPU)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_speculative import SPEC, chats  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402


def rounds(spec, n: int = 3):
    kw = {"speculative_config": spec} if spec else {}
    out = None
    with LLM(None, device="cuda", dtype="bfloat16", max_running_requests=1,
             show_progress=False, **kw) as llm:
        prompts = chats(16, 120)
        params = SamplingParams(temperature=0.0, max_tokens=200)
        for r in range(n):
            prof = cProfile.Profile() if r == n - 1 and spec else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            outs = llm.chat(prompts, params)
            if prof:
                prof.disable()
            dt = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            st = llm.stats
            print(f"{'ngram' if spec else 'plain'} round {r}: {dt:.3f} s, {toks} tokens, "
                  f"{toks / dt:.1f} tok/s, verify steps {st.verify_steps_total if st else 0}",
                  flush=True)
            out = [o.outputs[0].token_ids for o in outs]
            if prof:
                for key in ("cumulative", "tottime"):
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
                    print(s.getvalue()[:9000], flush=True)
    return out


plain = rounds(None, 2)
ngram = rounds(SPEC)
same = [a == b for a, b in zip(plain, ngram)]
common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
          for a, b in zip(plain, ngram)]
print("requests equal:", sum(same), "of", len(same), "first difference at", common)
print("lengths plain", [len(a) for a in plain], "ngram", [len(b) for b in ngram])
