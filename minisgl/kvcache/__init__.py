"""Paged KV pool and prefix-cache managers."""

from minisgl.kvcache.base import CacheManager, CacheStats, Inserted, PrefixMatch
from minisgl.kvcache.naive import NaiveCacheManager
from minisgl.kvcache.pool import KVPool


def make_cache_manager(kind: str, page_size: int) -> CacheManager:
    """`kind` is "naive" or "radix"."""
    if kind == "naive":
        return NaiveCacheManager(page_size)
    if kind == "radix":
        from minisgl.kvcache.radix import RadixCacheManager
        return RadixCacheManager(page_size)
    raise ValueError(f"unknown cache kind {kind!r} (expected 'radix' or 'naive')")


__all__ = ["CacheManager", "CacheStats", "Inserted", "KVPool", "NaiveCacheManager",
           "PrefixMatch", "make_cache_manager"]
