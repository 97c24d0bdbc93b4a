"""The scheduler's view of KV pages: the free list plus the prefix-cache manager.

Pages live in exactly one place: the free list, a live request's own pages (`Req.pages` after
its `num_prefix_pages`), or the cache manager (shared prefixes, locked while a request uses them).
`check` verifies free + in use + cached = total; every rank makes the same calls in the same
order, so every rank's pages are identical.

Reservations are bookkeeping on top: `reserve` promises an admitted request pages for its whole
life, `grow` draws its allocations from that promise, `retire` drops what is left of it. The cache
owns the total (`reserved_pages`, the sum of the admitted requests' `Req.reserved_pages`), and
admission and decode only take what is not promised (`unreserved_pages`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Deque, List, NamedTuple, Sequence

from minisgl.core import Req
from minisgl.kvcache import CacheManager, PrefixMatch

logger = logging.getLogger(__name__)


class PageCounts(NamedTuple):
    """The KV pool's pages by place; free + in_use + cached == total when they balance."""

    free: int
    in_use: int  # live requests' own pages
    cached: int  # the prefix cache's, locked or not
    total: int


class PageCache:
    def __init__(self, num_pages: int, page_size: int, manager: CacheManager) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.manager = manager
        self._free: Deque[int] = deque(range(num_pages))
        self.evicted_pages = 0  # total over the cache's life, for metrics and tests
        self.reserved_pages = 0  # promised to admitted requests, not yet allocated to them

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: free ones plus unlocked cached ones (evicted on demand)."""
        return len(self._free) + self.manager.stats().evictable_pages

    @property
    def unreserved_pages(self) -> int:
        """Available pages not promised to an admitted request."""
        return self.available_pages - self.reserved_pages

    def match(self, req: Req) -> PrefixMatch:
        """The cached prefix of `req`'s tokens in its namespace (its cache_salt and LoRA
        adapter load: Req.prefix_namespace): none where it asks for prompt
        log-probabilities (they need every prompt token's logits) or pools every prompt
        token's hidden state (an embedding: Req.pools_whole_prompt, or hidden states asked:
        Req.wants_prompt_hidden), and never the last token (computing it gives the logits of
        the first output token)."""
        if req.wants_prompt_logprobs or req.pools_whole_prompt or req.wants_prompt_hidden:
            return PrefixMatch(None, [])
        tokens = req.token_ids
        return self.manager.match_prefix(tokens[: len(tokens) - 1], req.prefix_namespace)

    def drop_unused(self) -> int:
        """Free every cached page no live request holds (the whole cache at rest); not counted
        as evictions, which are for room. Returns how many."""
        pages = self.manager.evict(self.num_pages)
        self._free.extend(pages)
        return len(pages)

    def allocate(self, n: int) -> List[int]:
        if n > len(self._free):
            evicted = self.manager.evict(n - len(self._free))
            self.evicted_pages += len(evicted)
            self._free.extend(evicted)
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {n} pages, {len(self._free)} free "
                               f"(admission should have reserved them)")
        return [self._free.popleft() for _ in range(n)]

    def release(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)

    def reserve(self, req: Req, n: int) -> None:
        """Promise a newly admitted request `n` own pages for its whole life (the caller checked
        that `unreserved_pages` covers them)."""
        req.reserved_pages = n
        self.reserved_pages += n

    def grow(self, req: Req, new_len: int) -> None:
        """Allocate the pages `req` needs to hold `new_len` tokens, drawing on its reservation
        first (beyond it, the scheduler made room before asking)."""
        missing = -(-new_len // self.page_size) - len(req.pages)
        if missing > 0:
            req.pages.extend(self.allocate(missing))
            drawn = min(missing, req.reserved_pages)
            req.reserved_pages -= drawn
            self.reserved_pages -= drawn

    def retire(self, req: Req) -> None:
        """Give a finished, aborted or retracted request's pages back: full pages with computed
        KV go to the prefix cache (which returns duplicates to free), the rest to the free list;
        then unlock the prefix it matched and drop what is left of its reservation. Call exactly
        once per admission."""
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0
        full = req.cached_len // self.page_size
        keep = req.token_ids[: full * self.page_size]
        self.release(self.manager.insert(keep, req.pages[:full], req.prefix_namespace))
        self.release(req.pages[full:])
        self.manager.unlock(req.cache_handle)
        req.pages, req.num_prefix_pages, req.cache_handle = [], 0, None

    def share_prefix(self, req: Req) -> List[int]:
        """Hand the request's full pages with computed KV to the prefix cache while it runs (a
        long prompt's finished chunks), and lock them through a new handle. Where the cache
        already held those tokens under other pages, the request switches to the cache's pages
        and its own copies are freed; returns the indices of the pages that changed, whose
        page-table slots the caller must rewrite."""
        full = req.cached_len // self.page_size
        if not self.manager.shares_prefixes or full <= req.num_prefix_pages:
            return []
        tokens = req.token_ids[: full * self.page_size]
        duplicates, match = self.manager.insert_and_match(tokens, req.pages[:full],
                                                          req.prefix_namespace)
        self.manager.lock(match.handle)
        self.manager.unlock(req.cache_handle)
        changed = [i for i in range(full) if req.pages[i] != match.pages[i]]
        if sorted(req.pages[i] for i in changed) != sorted(duplicates):
            raise RuntimeError("prefix cache returned duplicates that are not the switched pages")
        self.release(duplicates)
        req.pages[:full] = match.pages
        req.cache_handle, req.num_prefix_pages = match.handle, full
        return changed

    def check(self, live: Sequence[Req]) -> PageCounts:
        """The pages by place, `live` being every request holding pages; raise when free + in
        use + cached differs from the total (a page leaked or doubled)."""
        in_use = sum(len(r.pages) - r.num_prefix_pages for r in live)
        cached = self.manager.stats().cached_pages
        if len(self._free) + in_use + cached != self.num_pages:
            msg = (f"KV page accounting mismatch: free {len(self._free)} + in use {in_use} + "
                   f"cached {cached} != total {self.num_pages}")
            logger.error(msg)
            raise RuntimeError(msg)
        if len(set(self._free)) != len(self._free):
            raise RuntimeError("KV page accounting: a page is on the free list twice")
        return PageCounts(len(self._free), in_use, cached, self.num_pages)
