"""The periodic stats line: one INFO line every --log-stats-interval seconds while the service
works (vLLM's "Avg prompt throughput ..." line; --disable-log-stats turns it off), from the
schedulers' counters the API server already holds for /metrics (summed over the replicas):

    stats: 12 running, 3 waiting, KV 41.2% of 8,192 pages, prompt 1,523 tok/s, generation
    3,310 tok/s, prefix cache hits 37.5%, drafts accepted 61.0% (2.8 tokens a verify)

Throughputs and the hit rate are over the interval (hits: cached / prompt tokens admitted in
it), as is speculative decoding's share of draft tokens kept and its tokens per request in a
verify step (vLLM's mean acceptance length); nothing is logged for an interval with no work
(nothing running or waiting, no token)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable, NamedTuple, Optional

from minisgl.message.types import SchedulerStats

logger = logging.getLogger("minisgl.api")


class Totals(NamedTuple):
    """The counters one line is computed from, summed over the replicas."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_total: int = 0
    prompt: int = 0
    generated: int = 0
    cached: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    @classmethod
    def of(cls, stats: Iterable[SchedulerStats]) -> "Totals":
        rows = [(s.running, s.waiting, s.kv_pages_used, s.kv_pages_total, s.prompt_tokens_total,
                 s.generated_tokens_total, s.cached_tokens_total, s.spec_drafts_total,
                 s.spec_draft_tokens_total, s.spec_accepted_tokens_total) for s in stats]
        return cls(*(sum(column) for column in zip(*rows))) if rows else cls()


def stats_line(before: Totals, now: Totals, seconds: float) -> Optional[str]:
    """The line for an interval of `seconds` from `before` to `now`, or None where nothing
    worked in it."""
    prompt, generated = now.prompt - before.prompt, now.generated - before.generated
    if not (now.running or now.waiting or prompt or generated):
        return None
    kv = 100.0 * now.kv_used / now.kv_total if now.kv_total else 0.0
    hits = f", prefix cache hits {100.0 * (now.cached - before.cached) / prompt:.1f}%" \
        if prompt else ""
    return (f"stats: {now.running} running, {now.waiting} waiting, KV {kv:.1f}% of "
            f"{now.kv_total:,} pages, prompt {prompt / seconds:,.0f} tok/s, generation "
            f"{generated / seconds:,.0f} tok/s{hits}{_acceptance(before, now)}")


def _acceptance(before: Totals, now: Totals) -> str:
    """Speculative decoding's part of the line, where the interval had drafts."""
    drafts, proposed = now.drafts - before.drafts, now.draft_tokens - before.draft_tokens
    if not proposed:
        return ""
    accepted = now.accepted - before.accepted
    return (f", drafts accepted {100.0 * accepted / proposed:.1f}% "
            f"({1 + accepted / drafts:.1f} tokens a verify)")


async def log_stats(totals: Callable[[], Totals], interval: float) -> None:
    """Log `stats_line` every `interval` seconds, forever (the API server's lifespan cancels
    it); `totals` reads the counters now."""
    before, since = totals(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, at = totals(), time.monotonic()
        line = stats_line(before, now, max(at - since, 1e-9))
        if line is not None:
            logger.info(line)
        before, since = now, at
