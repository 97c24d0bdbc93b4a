"""The prefix-cache manager interface shared by the naive and radix managers.

Ownership contract (the scheduler's cache in scheduler/cache.py is the only caller):
- A page is in exactly one place: the free list, a live request's own pages, or the manager.
- `match_prefix` returns pages the manager owns; the caller must `lock` the handle before using
  them and `unlock` it exactly once when the request finishes or is aborted.
- `insert` takes ownership of a finished request's full pages and hands back the ones it already
  held (duplicates), which the caller frees. `insert_and_match` also returns what `match_prefix`
  of the same tokens would (for a request that keeps running on the cached pages); the handle is
  not locked.
- `evict` may only drop unlocked pages; it returns them and the caller puts them on the free list.
- Every decision is a pure function of the calls made (no clocks), so all ranks agree.
- `salt` (vLLM's cache_salt) names a namespace: a prefix cached under one salt never matches a
  request under another (or none), so tenants cannot probe each other's prompts by timing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, NamedTuple, Optional, Sequence


class PrefixMatch(NamedTuple):
    handle: Optional[object]  # opaque; pass to lock/unlock
    pages: List[int]  # the cached pages covering the first len(pages) * page_size tokens


class Inserted(NamedTuple):
    duplicates: List[int]  # the caller's pages whose KV the manager already held: caller frees
    match: PrefixMatch  # the manager's pages for every inserted token, and a handle (unlocked)


class CacheStats(NamedTuple):
    cached_pages: int  # every page the manager owns
    evictable_pages: int  # the unlocked ones


class CacheManager(ABC):
    shares_prefixes = True  # False: nothing is ever matched (the naive manager)

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None
                     ) -> PrefixMatch: ...

    @abstractmethod
    def lock(self, handle: Optional[object]) -> None: ...

    @abstractmethod
    def unlock(self, handle: Optional[object]) -> None: ...

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: List[int], salt: Optional[str] = None
               ) -> List[int]:
        """Cache `pages` (len(token_ids) == len(pages) * page_size); return the duplicates."""

    def insert_and_match(self, token_ids: Sequence[int], pages: List[int],
                         salt: Optional[str] = None) -> Inserted:
        """`insert`, then `match_prefix` of the same tokens (which now match in full). Managers
        that can do both in one walk override this."""
        duplicates = self.insert(token_ids, pages, salt)
        return Inserted(duplicates, self.match_prefix(token_ids, salt))

    @abstractmethod
    def evict(self, num_pages: int) -> List[int]:
        """Drop at least `num_pages` unlocked pages if that many exist; return the dropped pages."""

    @abstractmethod
    def stats(self) -> CacheStats: ...
