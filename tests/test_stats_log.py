"""The periodic stats line (server/stats_log.py): its numbers over an interval, summed over the
replicas, and silence while idle. (A served one: tests/test_generation_config.py's server.)"""

from __future__ import annotations

from minisgl.message.types import SchedulerStats
from minisgl.server.stats_log import Totals, stats_line


def test_the_line_sums_the_replicas_over_the_interval() -> None:
    def stats(replica: int, prompt: int, generated: int, cached: int) -> SchedulerStats:
        return SchedulerStats(running=2, waiting=1, kv_pages_used=100, kv_pages_total=400,
                              prompt_tokens_total=prompt, generated_tokens_total=generated,
                              cached_tokens_total=cached, replica=replica)
    before = Totals.of([stats(0, 1000, 50, 0), stats(1, 0, 0, 0)])
    now = Totals.of([stats(0, 3000, 2050, 500), stats(1, 2000, 2000, 1500)])
    assert now == Totals(4, 2, 200, 800, 5000, 4050, 2000)
    assert stats_line(before, now, 2.0) == (
        "stats: 4 running, 2 waiting, KV 25.0% of 800 pages, prompt 2,000 tok/s, generation "
        "2,000 tok/s, prefix cache hits 50.0%")
    # decode only: no prompt admitted, so no hit rate
    assert stats_line(now, now._replace(generated=now.generated + 30), 1.0) == (
        "stats: 4 running, 2 waiting, KV 25.0% of 800 pages, prompt 0 tok/s, generation "
        "30 tok/s")
    idle = Totals(kv_total=800, prompt=5000, generated=4050)
    assert stats_line(idle, idle, 10.0) is None
    assert stats_line(Totals(), Totals(), 1.0) is None  # no replica reported yet
