"""No prefix caching: nothing matches, every inserted page comes straight back to be freed."""

from __future__ import annotations

from typing import List, Optional, Sequence

from minisgl.kvcache.base import CacheManager, CacheStats, PrefixMatch


class NaiveCacheManager(CacheManager):
    shares_prefixes = False

    def match_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None
                     ) -> PrefixMatch:
        return PrefixMatch(None, [])

    def lock(self, handle: Optional[object]) -> None:
        pass

    def unlock(self, handle: Optional[object]) -> None:
        pass

    def insert(self, token_ids: Sequence[int], pages: List[int], salt: Optional[str] = None
               ) -> List[int]:
        return list(pages)

    def evict(self, num_pages: int) -> List[int]:
        return []

    def stats(self) -> CacheStats:
        return CacheStats(0, 0)
