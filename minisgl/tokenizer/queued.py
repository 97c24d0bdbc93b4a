"""The prompt tokens waiting in each replica's scheduler queue, as the tokenizer can know them.

Rank 0 reports, in its `SchedulerStats`, the prompt tokens of the requests it has not admitted
yet (`waiting_tokens`) and how many requests it has taken from its socket so far
(`requests_received_total`). The tokenizer numbers the requests it sends each replica, so the
tokens queued there are the reported ones plus those of the requests sent after the last one
that report covers: nothing is counted twice or missed, whatever the delays in between. Stats
older than ones already seen (they travel two paths: with replies and on rank 0's timer) are
ignored.

`QueuedTokens.admits(replica, n)` is `--max-queued-tokens`' test: a request of n prompt tokens
is let in if the queue stays within the limit, and always into an empty queue (so that any
request that fits the context is served eventually).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Tuple

from minisgl.message.types import SchedulerStats


class QueuedTokens:
    def __init__(self, replicas: int, limit: Optional[int]) -> None:
        self.limit = limit
        self._sent: List[Deque[Tuple[int, int]]] = [deque() for _ in range(replicas)]
        self._next = [0] * replicas  # the number of the next request sent to each replica
        self._reported = [0] * replicas  # waiting_tokens of each replica's latest stats
        self._seq = [-1] * replicas  # the latest stats' sequence number

    def queued(self, replica: int) -> int:
        return self._reported[replica] + sum(n for _, n in self._sent[replica])

    def admits(self, replica: int, tokens: int) -> bool:
        queued = self.queued(replica)
        return self.limit is None or queued == 0 or queued + tokens <= self.limit

    def sent(self, replica: int, tokens: int) -> None:
        """A request of `tokens` prompt tokens went to `replica`."""
        if self.limit is not None:
            self._sent[replica].append((self._next[replica], tokens))
        self._next[replica] += 1

    def update(self, stats: SchedulerStats) -> None:
        d = stats.replica
        if not 0 <= d < len(self._sent) or stats.seq <= self._seq[d]:
            return
        self._seq[d], self._reported[d] = stats.seq, stats.waiting_tokens
        sent = self._sent[d]
        while sent and sent[0][0] < stats.requests_received_total:
            sent.popleft()
