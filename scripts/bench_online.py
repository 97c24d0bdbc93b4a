#!/usr/bin/env python3
"""Online serving latency against a running `serve`, over OpenAI's streaming /v1/completions.

For each request rate (requests/s; "inf" sends all at once) requests arrive as a Poisson process:
random token-id prompts (or random words with --prompt-kind text) with input and output lengths
uniform in [--min-len, --max-len], greedy, ignore_eos. Measures time to first token (TTFT), the
gaps between streamed chunks (ITL), end-to-end latency (p50/p90/p99) and throughput. Each rate
is bounded by --num-requests and --max-duration; requests still running at the deadline are
cancelled and counted as unfinished. With --token-gaps the ITL is also reported per token
(itl_token_ms): a chunk's gap split over the tokens it carried, so that tokens held back as
incomplete characters (random weights emit byte pieces) do not count as one long gap.

    ./serve --model ... &
    PYTHONPATH=. python scripts/bench_online.py --base-url http://127.0.0.1:8000 --rates 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Union

import httpx

_WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
          "this be or has had not but first one their its new after who they have two she "
          "been other when there all during into school time may years more most only over "
          "city some world would where later up such used many can state about national out "
          "known university united then made").split()


@dataclass(frozen=True)
class RequestSpec:
    prompt: Union[str, List[int]]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = math.nan  # seconds from sending to the first non-empty chunk
    e2e: float = math.nan  # seconds from sending to the end of the stream
    itls: List[float] = field(default_factory=list)  # gaps between non-empty chunks
    # Tokens each non-empty chunk carried, where the chunk's usage says (--token-gaps: vLLM's
    # continuous_usage_stats); 1 where it gives none.
    chunk_tokens: List[int] = field(default_factory=list)
    output_tokens: int = 0

    def token_gaps(self) -> List[float]:
        """The gap before each token after the first chunk's: a chunk's gap split evenly over
        the tokens it carried (a token held back, e.g. an incomplete UTF-8 character, arrives
        with the next one: one chunk, two tokens, two gaps of half its wait)."""
        return [gap / k for gap, k in zip(self.itls, self.chunk_tokens[1:]) for _ in range(k)]


@dataclass(frozen=True)
class RateSummary:
    rate: float
    sent: int
    completed: int
    failed: int
    unfinished: int
    duration_s: float
    req_s: float
    output_tok_s: float
    ttft_ms: Dict[str, float]
    itl_ms: Dict[str, float]
    e2e_ms: Dict[str, float]
    first_error: str
    # Per token (RequestResult.token_gaps): meaningful with --token-gaps, else the chunks'.
    itl_token_ms: Dict[str, float]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="the `model` field of each request (default: the first of /v1/models)")
    p.add_argument("--rates", default="1,4,16", help="comma-separated requests/s; 'inf' allowed")
    p.add_argument("--num-requests", type=int, default=200, help="per rate")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per rate")
    p.add_argument("--min-len", type=int, default=100, help="input and output length minimum")
    p.add_argument("--max-len", type=int, default=1024, help="input and output length maximum")
    p.add_argument("--prompt-kind", choices=["tokens", "text"], default="tokens")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="token-id prompts draw ids below this")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send the (non-OpenAI) ignore_eos extension field")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-gaps", action="store_true",
                   help="ask for usage on every chunk (vLLM's continuous_usage_stats, which "
                        "minisgl serves too) and report the gaps per token as well "
                        "(itl_token_ms): a chunk that carries two tokens, one of them held "
                        "back as an incomplete character, counts as two gaps of half its wait")
    p.add_argument("--dump", default=None, metavar="FILE",
                   help="also write one JSON line per request (rate, when it was sent, its "
                        "prompt and output lengths, TTFT, end to end, its non-empty chunks "
                        "and the gaps between them, error): what an outlier of the "
                        "percentiles was (fewer chunks than output tokens: tokens that "
                        "arrived together or whose text was held back)")
    return p.parse_args(argv)


def make_requests(args: argparse.Namespace, seed: int) -> List[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(args.num_requests):
        n_in = rng.randint(args.min_len, args.max_len)
        prompt: Union[str, List[int]]
        if args.prompt_kind == "tokens":
            prompt = [rng.randrange(args.vocab_size) for _ in range(n_in)]
        else:  # roughly one token per word
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        specs.append(RequestSpec(prompt, rng.randint(args.min_len, args.max_len)))
    return specs


def request_body(args: argparse.Namespace, spec: RequestSpec) -> Dict[str, Any]:
    body: Dict[str, Any] = {"model": args.model, "prompt": spec.prompt,
                            "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.token_gaps:
        body["stream_options"]["continuous_usage_stats"] = True
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(client: httpx.AsyncClient, url: str, body: Dict[str, Any]) -> RequestResult:
    """One streamed completion; never raises (errors land in the result)."""
    res = RequestResult()
    start = time.perf_counter()
    last = start
    chunks = 0
    counted = 0  # completion tokens as of the last non-empty chunk
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:200]
                    return res
                usage = chunk.get("usage")
                told = usage is not None and usage.get("completion_tokens") is not None
                if told:
                    res.output_tokens = int(usage["completion_tokens"])
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue  # usage-only chunk, or text held back (incomplete UTF-8)
                res.chunk_tokens.append(max(1, res.output_tokens - counted) if told else 1)
                counted = res.output_tokens
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks  # no usage: one token per chunk
        res.ok = chunks > 0 or res.output_tokens > 0
        if not res.ok:
            res.error = "empty stream"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def percentiles(values: Sequence[float]) -> Dict[str, float]:
    """p50/p90/p99 in milliseconds (nearest rank); NaN when there are no values."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    pick = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa: E731
    return {f"p{int(q * 100)}": round(pick(q) * 1e3, 2) for q in (0.5, 0.9, 0.99)}


class RateRun(NamedTuple):
    summary: RateSummary
    requests: List[Dict[str, Any]]  # one per request sent, in sending order (see --dump)


def request_record(rate: float, spec: RequestSpec, sent_s: float,
                   res: Optional[RequestResult]) -> Dict[str, Any]:
    """One request of a rate as --dump writes it; `res` None: unfinished at the deadline."""
    ms = lambda v: None if v is None or math.isnan(v) else round(v * 1e3, 2)  # noqa: E731
    return {"rate": str(rate), "sent_ms": ms(sent_s), "prompt_len": len(spec.prompt) if
            isinstance(spec.prompt, list) else len(spec.prompt.split()),
            "max_tokens": spec.max_tokens, "ok": res is not None and res.ok,
            "ttft_ms": ms(res.ttft) if res else None, "e2e_ms": ms(res.e2e) if res else None,
            "output_tokens": res.output_tokens if res else 0,
            "chunks": (len(res.itls) + 1 if res and not math.isnan(res.ttft) else 0),
            "itl_ms": [round(x * 1e3, 1) for x in res.itls] if res else [],
            "chunk_tokens": list(res.chunk_tokens) if res else [],
            "error": res.error if res else "unfinished"}


async def run_rate(args: argparse.Namespace, rate: float, specs: List[RequestSpec],
                   seed: int) -> RateRun:
    """Send `specs` at Poisson arrivals of `rate`/s until done or --max-duration is reached."""
    rng = random.Random(seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        deadline = start + args.max_duration
        tasks: List[asyncio.Task] = []
        sent: List[float] = []
        next_at = start
        for spec in specs:
            if rate != math.inf:
                next_at += rng.expovariate(rate)
            if next_at >= deadline:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            sent.append(time.perf_counter() - start)
            tasks.append(asyncio.create_task(send(client, url, request_body(args, spec))))
        done, pending = (await asyncio.wait(tasks, timeout=max(0.0, deadline -
                                                                time.perf_counter()))
                         if tasks else (set(), set()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    results = [t.result() for t in tasks if t in done]
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    records = [request_record(rate, spec, at, t.result() if t in done else None)
               for spec, at, t in zip(specs, sent, tasks)]
    return RateRun(RateSummary(
        rate=rate, sent=len(tasks), completed=len(ok), failed=len(errors),
        unfinished=len(pending), duration_s=round(duration, 3),
        req_s=round(len(ok) / duration, 3),
        output_tok_s=round(sum(r.output_tokens for r in ok) / duration, 1),
        ttft_ms=percentiles([r.ttft for r in ok]),
        itl_ms=percentiles([x for r in ok for x in r.itls]),
        e2e_ms=percentiles([r.e2e for r in ok]), first_error=errors[0] if errors else "",
        itl_token_ms=percentiles([x for r in ok for x in r.token_gaps()])), records)


def _no_nan(d: Dict[str, Any]) -> Dict[str, Any]:
    """NaN (no samples) as null, so the RESULT line is strict JSON."""
    fix = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731
    return {k: ({kk: fix(vv) for kk, vv in v.items()} if isinstance(v, dict) else fix(v))
            for k, v in d.items()}


def print_summary(s: RateSummary) -> None:
    fmt = lambda d: "/".join(f"{v:.0f}" for v in d.values())  # noqa: E731
    print(f"{s.rate:>6} {s.completed:>5}/{s.sent:<5} {s.failed:>4} {s.unfinished:>5} "
          f"{s.req_s:>7.2f} {s.output_tok_s:>9.0f} {fmt(s.ttft_ms):>18} {fmt(s.itl_ms):>14} "
          f"{fmt(s.e2e_ms):>20}")
    if s.first_error:
        print(f"       first error: {s.first_error}")


async def served_model(base_url: str) -> str:
    """The first model id the server lists at /v1/models ("default" if it lists none)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        resp = await client.get(base_url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or [{}]
    return str(data[0].get("id", "default"))


async def main_async(args: argparse.Namespace) -> List[RateSummary]:
    if args.model is None:
        args.model = await served_model(args.base_url)
    rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    print(f"{'rate':>6} {'done/sent':>11} {'fail':>4} {'unfin':>5} {'req/s':>7} {'out tok/s':>9} "
          f"{'TTFT ms p50/90/99':>18} {'ITL ms p50/90/99':>14} {'E2E ms p50/90/99':>20}")
    out = []
    records: List[Dict[str, Any]] = []
    for i, rate in enumerate(rates):
        specs = make_requests(args, args.seed + i)  # distinct prompts: no cache hits across rates
        run = await run_rate(args, rate, specs, args.seed + 1000 + i)
        print_summary(run.summary)
        out.append(run.summary)
        records += run.requests
    if args.dump is not None:
        with open(args.dump, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    for s in out:
        print("RESULT " + json.dumps({**_no_nan(s.__dict__), "rate": str(s.rate),
                                      "model": args.model, "base_url": args.base_url,
                                      "prompt_kind": args.prompt_kind,
                                      "min_len": args.min_len, "max_len": args.max_len}))
    return out


def main(argv: Optional[List[str]] = None) -> None:
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
