"""The data-parallel router: which replica serves a request (cache-aware, then least loaded).

A replica's prefix cache holds the KV of prompts it has served, page by page. The router keys a
request by hashes of its first 1, 2, 4, 8, ... full pages of token ids (and of all its full
pages) and remembers, in a bounded LRU, the replica that last served each key. A request goes to
the replica holding its longest remembered prefix, unless that replica is overloaded (its load
exceeds `OVERLOAD_FACTOR` times the least loaded one's plus `SLACK_PAGES` pages); with no
holder, or an overloaded one, it goes to the least loaded replica (ties: the lowest index).

A replica's load is in tokens: its KV pages in use and the prompt tokens waiting in its queue,
from its rank 0's latest `SchedulerStats`, plus the tokens routed to it since those stats
arrived. The router only guesses: a wrong guess costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import List, Optional, Sequence

from minisgl.message.types import SchedulerStats

OVERLOAD_FACTOR = 2
SLACK_PAGES = 16  # a holder this far (in KV pages) above the least loaded is still not overloaded
DEFAULT_CAPACITY = 1 << 16  # prefix keys remembered


def prefix_keys(ids: Sequence[int], page_size: int, salt: Optional[str] = None
                ) -> List[bytes]:
    """Hashes of the first 1, 2, 4, ... full pages of `ids` and of all its full pages, shortest
    first (none when the prompt is shorter than a page), under `salt` (a request's cache_salt:
    its prefixes are cached apart, so they are remembered apart)."""
    pages = len(ids) // page_size
    cuts: List[int] = []
    n = 1
    while n < pages:
        cuts.append(n)
        n *= 2
    if pages:
        cuts.append(pages)
    keys: List[bytes] = []
    hasher, done = hashlib.blake2b(digest_size=16), 0
    if salt is not None:
        hasher.update(b"salt:" + salt.encode() + b"\0")
    for cut in cuts:
        hasher.update(array("q", ids[done * page_size:cut * page_size]).tobytes())
        done = cut
        keys.append(hasher.copy().digest())
    return keys


class Router:
    def __init__(self, replicas: int, page_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {replicas}")
        self.replicas = replicas
        self.page_size = page_size
        self.overload_slack = SLACK_PAGES * page_size
        self.capacity = capacity
        self.holders: "OrderedDict[bytes, int]" = OrderedDict()  # prefix key -> replica
        self.reported = [0] * replicas  # tokens in each replica's latest stats
        self.routed = [0] * replicas  # tokens routed to each since those stats

    def load(self, replica: int) -> int:
        return self.reported[replica] + self.routed[replica]

    def update(self, stats: SchedulerStats) -> None:
        """Take a replica's latest counters (they include what was routed to it before)."""
        d = stats.replica
        if 0 <= d < self.replicas:
            self.reported[d] = stats.kv_pages_used * self.page_size + stats.waiting_tokens
            self.routed[d] = 0

    def route(self, ids: Sequence[int], tokens: int, salt: Optional[str] = None) -> int:
        """The replica for a request with prompt `ids` (and cache_salt `salt`) that will hold
        about `tokens` tokens (prompt and output); remembers the choice for its prefixes."""
        if self.replicas == 1:
            return 0
        keys = prefix_keys(ids, self.page_size, salt)
        least = min(range(self.replicas), key=lambda d: (self.load(d), d))
        chosen = least
        for key in reversed(keys):  # the longest prefix a replica served last
            holder = self.holders.get(key)
            if holder is not None:
                if self.load(holder) <= OVERLOAD_FACTOR * self.load(least) + self.overload_slack:
                    chosen = holder
                break
        for key in keys:
            self.holders[key] = chosen
            self.holders.move_to_end(key)
        while len(self.holders) > self.capacity:
            self.holders.popitem(last=False)
        self.routed[chosen] += tokens
        return chosen
