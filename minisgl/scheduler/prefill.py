"""Admission and chunked prefill.

Waiting requests are admitted in arrival order (no overtaking, so none starves), or with the
priority policy in `order`: the lowest `params.priority` first, then arrival (uid), as vLLM's
priority policy (a stream of urgent requests may starve the others, as there). Admission
reserves KV pages for the uncached prompt plus the request's output: all of max_tokens by
default, so a running request never runs out of pages, or at most `decode_reserve_tokens` of
them, in which case a decode step that outgrows the pool retracts the newest requests
(Scheduler._make_room). Pages themselves are allocated as chunks and decode steps need them. A prefill batch takes up to `max_prefill_tokens` new tokens; the last request may get only a
chunk, and it stays at the head of the queue.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, List, Optional, Tuple

from minisgl.core import Batch, Phase, Req
from minisgl.scheduler.cache import PageCache
from minisgl.scheduler.table import TableRows


class PrefillManager:
    def __init__(self, cache: PageCache, rows: TableRows, max_prefill_tokens: int,
                 decode_reserve: Optional[int] = None, by_priority: bool = False) -> None:
        self.cache = cache
        self.rows = rows  # one per admitted request: their number caps the running requests
        self.budget = max_prefill_tokens
        self.waiting: Deque[Req] = deque()  # not yet admitted
        self.waiting_tokens = 0  # their tokens (a request's do not change while it waits)
        self.prefilling: Deque[Req] = deque()  # admitted, prompt not fully computed
        self.decode_reserve = decode_reserve
        self.by_priority = by_priority

    def order(self, req: Req) -> Tuple[int, int]:
        """A request's place in the queue, the same on every rank: its uid (arrival), after
        its priority under the priority policy."""
        return (req.params.priority if self.by_priority else 0, req.uid)

    def add(self, req: Req) -> None:
        """Queue a new request: last, or by priority after those that come before it."""
        if self.by_priority:
            self._insert(req)
        else:
            self.waiting.append(req)
        self.waiting_tokens += len(req.token_ids)

    def requeue(self, req: Req) -> None:
        """A retracted request waits again: at the head of the queue (it arrived before every
        waiting one), or by priority in its place."""
        if self.by_priority:
            self._insert(req)
        else:
            self.waiting.appendleft(req)
        self.waiting_tokens += len(req.token_ids)

    def _insert(self, req: Req) -> None:
        """Put `req` in `order` among the waiting (from the back: most arrivals go last)."""
        key, i = self.order(req), len(self.waiting)
        while i > 0 and self.order(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    def pages_for(self, req: Req) -> int:
        """Pages reserved at admission: the known tokens plus the outputs still to come (at most
        `decode_reserve` of them)."""
        outputs = req.max_tokens - req.output_len
        if self.decode_reserve is not None:
            outputs = min(outputs, self.decode_reserve)
        return -(-(len(req.token_ids) + outputs) // self.cache.page_size)

    def schedule(self, admitted: Callable[[Req], None], share: int = 0) -> Optional[Batch]:
        """Build the next prefill batch (allocating its pages), or None. `admitted(req)` maps a
        newly admitted request's cached prefix into the page table. `share`: tokens of the
        budget that decode rows riding along the batch take (a mixed step; less than the
        budget)."""
        self._admit(admitted)
        reqs: List[Req] = []
        prefix, extend, sample = [], [], []
        left = self.budget - share
        for req in self.prefilling:
            if left == 0:
                break
            n = min(req.device_len - req.cached_len, left)  # device_len: the known tokens
            self.cache.grow(req, req.cached_len + n)
            reqs.append(req)
            prefix.append(req.cached_len)
            extend.append(n)
            sample.append(req.cached_len + n == req.device_len)
            left -= n
        if not reqs:
            return None
        return Batch(Phase.PREFILL, reqs, prefix, extend, sample)

    def _admit(self, admitted: Callable[[Req], None]) -> None:
        # A free row is the whole running-count check: every admitted request (prefilling,
        # running, or finished while its last batch is in flight) holds one of the
        # max_running_requests rows.
        while self.waiting and self.rows.available > 0:
            req = self.waiting[0]
            match = self.cache.match(req)
            self.cache.manager.lock(match.handle)
            need = self.pages_for(req) - len(match.pages)
            if need > self.cache.unreserved_pages:
                self.cache.manager.unlock(match.handle)
                return
            self.waiting.popleft()
            self.waiting_tokens -= len(req.token_ids)
            req.table_row = self.rows.allocate()
            req.cache_handle = match.handle
            req.pages = list(match.pages)
            req.num_prefix_pages = len(match.pages)
            req.cached_len = len(match.pages) * self.cache.page_size
            if req.output_len == 0:  # a retracted request keeps its first admission's hit
                req.prefix_hit = req.cached_len
            self.cache.reserve(req, need)
            self.prefilling.append(req)
            admitted(req)

    def remove(self, req: Req) -> bool:
        """Drop an aborted request; True if it had been admitted (so it holds resources)."""
        if req in self.waiting:
            self.waiting.remove(req)
            self.waiting_tokens -= len(req.token_ids)
            return False
        if req in self.prefilling:
            self.prefilling.remove(req)
            return True
        return False
