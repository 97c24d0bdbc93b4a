"""Unit tests for the page-granular radix prefix cache."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional

import pytest

from minisgl.kvcache.base import CacheStats
from minisgl.kvcache.radix import RadixCacheManager


def owned_pages(cache: RadixCacheManager) -> List[int]:
    return [p for node in cache._iter_nodes() for p in node.pages]


def test_match_on_empty_tree() -> None:
    cache = RadixCacheManager(4)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.handle is None and m.pages == []
    assert cache.match_prefix([]).pages == []
    cache.lock(m.handle)  # None handles are no-ops
    cache.unlock(m.handle)
    assert cache.stats() == CacheStats(0, 0)


def test_insert_then_match_page_size_1() -> None:
    cache = RadixCacheManager(1)
    assert cache.insert([10, 11, 12], [0, 1, 2]) == []
    assert cache.match_prefix([10, 11, 12]).pages == [0, 1, 2]
    assert cache.match_prefix([10, 11, 12, 13]).pages == [0, 1, 2]
    assert cache.match_prefix([10, 11, 99]).pages == [0, 1]
    assert cache.match_prefix([99]).pages == []
    assert cache._audit() == cache.stats() == CacheStats(3, 3)


def test_insert_then_match_page_size_4_ignores_partial_page() -> None:
    cache = RadixCacheManager(4)
    toks = list(range(12))
    cache.insert(toks, [7, 8, 9])
    assert cache.match_prefix(toks).pages == [7, 8, 9]
    assert cache.match_prefix(toks + [100, 101]).pages == [7, 8, 9]  # partial page ignored
    assert cache.match_prefix(toks[:11]).pages == [7, 8]  # last page incomplete
    assert cache.match_prefix(toks[:3]).pages == []
    assert cache.match_prefix(toks[:6] + [55, 56]).pages == [7]  # mismatch in second page
    cache._audit()


def test_insert_rejects_length_mismatch() -> None:
    cache = RadixCacheManager(4)
    with pytest.raises(ValueError):
        cache.insert(list(range(7)), [0, 1])
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), [0])


def test_split_at_page_boundary_mid_edge() -> None:
    cache = RadixCacheManager(2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert len(list(cache._iter_nodes())) == 1
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.pages == [10, 11]
    nodes = list(cache._iter_nodes())
    assert [n.key for n in nodes] == [(1, 2, 3, 4), (5, 6)]
    assert [n.pages for n in nodes] == [[10, 11], [12]]
    assert m.handle is nodes[0]
    # A token mismatch inside a page splits at the page start, not mid-page.
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.pages == [10]
    assert [n.key for n in cache._iter_nodes()] == [(1, 2), (3, 4), (5, 6)]
    # A divergent insert hangs a new branch off the split point.
    assert cache.insert([1, 2, 7, 8], [10, 20]) == []
    assert cache.match_prefix([1, 2, 7, 8]).pages == [10, 20]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == [10, 11, 12]
    assert cache._audit() == CacheStats(4, 4)


def test_insert_and_match_is_insert_then_match_in_one_walk() -> None:
    one, two = RadixCacheManager(2), RadixCacheManager(2)
    for cache in (one, two):
        cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    # Shares two pages (one the same page id, one a duplicate), then adds a new leaf.
    toks, pages = [1, 2, 3, 4, 7, 8, 9, 9], [10, 21, 22, 23]
    got = one.insert_and_match(toks, pages)
    duplicates = two.insert(toks, pages)
    want = two.match_prefix(toks)
    assert got.duplicates == duplicates == [21]
    assert got.match.pages == want.pages == [10, 11, 22, 23]
    assert [n.key for n in one._iter_nodes()] == [n.key for n in two._iter_nodes()]
    assert got.match.handle is list(one._iter_nodes())[-1]
    assert one._audit() == two._audit()


def test_split_keeps_lock_on_ancestors() -> None:
    cache = RadixCacheManager(1)
    cache.insert([1, 2, 3], [0, 1, 2])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.handle)
    cache.match_prefix([1, 9])  # splits the locked node; the new head must stay locked
    assert cache._audit() == CacheStats(3, 0)
    assert cache.evict(10) == []
    cache.unlock(m.handle)
    assert cache._audit() == CacheStats(3, 3)
    assert sorted(cache.evict(10)) == [0, 1, 2]


def test_duplicates_only_for_different_page_ids() -> None:
    cache = RadixCacheManager(2)
    assert cache.insert([1, 2, 3, 4], [0, 1]) == []
    # Same page ids for the cached prefix (a caller that matched it): not duplicates.
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.pages == [0, 1]
    assert cache.insert([1, 2, 3, 4, 5, 6], m.pages + [2]) == []
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == [0, 1, 2]
    # Different page ids for cached positions: those are duplicates, returned in order.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 3]) == [5, 6, 7]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == [0, 1, 2, 3]
    # Mixed: first page the tree's own, second page a duplicate, new suffix kept.
    assert cache.insert([1, 2, 3, 4, 9, 9], [0, 8, 4]) == [8]
    assert cache.match_prefix([1, 2, 3, 4, 9, 9]).pages == [0, 1, 4]
    assert sorted(owned_pages(cache)) == [0, 1, 2, 3, 4]
    assert cache._audit() == CacheStats(5, 5)
    # Re-inserting exactly what is cached returns nothing.
    assert cache.insert([1, 2, 3, 4], [0, 1]) == []


def test_lock_prevents_eviction() -> None:
    cache = RadixCacheManager(2)
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    cache.insert([1, 2, 3, 4, 7, 8], [0, 1, 3])
    cache.insert([5, 5], [4])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.pages == [0, 1, 2]
    cache.lock(m.handle)
    assert cache.stats() == CacheStats(5, 2)
    evicted = cache.evict(100)
    assert sorted(evicted) == [3, 4]
    assert sorted(owned_pages(cache)) == [0, 1, 2]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == [0, 1, 2]
    assert cache._audit() == CacheStats(3, 0)
    cache.unlock(m.handle)
    assert cache._audit() == CacheStats(3, 3)
    assert sorted(cache.evict(100)) == [0, 1, 2]
    assert cache._audit() == CacheStats(0, 0)


def test_lock_locks_ancestors_not_siblings() -> None:
    cache = RadixCacheManager(1)
    cache.insert([1, 2], [0, 1])
    cache.insert([1, 3], [0, 2])
    m = cache.match_prefix([1, 2])
    cache.lock(m.handle)
    assert cache.evict(100) == [2]  # sibling goes, locked path [1, 2] stays
    cache.unlock(m.handle)
    assert cache.evict(100) == [1, 0]  # leaf first, then its parent


def test_lru_order() -> None:
    cache = RadixCacheManager(1)
    cache.insert([1], [1])
    cache.insert([2], [2])
    cache.insert([3], [3])
    cache.match_prefix([1])  # 1 becomes most recent
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [3]
    assert cache.evict(1) == [1]
    assert cache.evict(1) == []


def test_evict_stops_once_enough_pages_freed() -> None:
    cache = RadixCacheManager(1)
    cache.insert([1, 1, 1], [0, 1, 2])
    cache.insert([2], [3])
    cache.insert([3], [4])
    freed = cache.evict(2)
    assert freed == [0, 1, 2]  # whole oldest leaf goes (at least 2 pages)
    assert cache.stats() == CacheStats(2, 2)
    assert cache.evict(0) == []


def test_parent_becomes_leaf_candidate_in_lru_order() -> None:
    def build() -> RadixCacheManager:
        cache = RadixCacheManager(1)
        cache.insert([1, 2], [0, 1])  # clock 1
        cache.insert([1, 3], [0, 2])  # clock 2: splits off parent [1] (keeps clock 1 recency,
        #                               then touched to 2); leaf [2] stays at clock 1
        cache.insert([9], [3])  # clock 3
        return cache

    cache = build()
    assert cache.evict(1) == [1]  # leaf [1, 2], clock 1
    assert cache.evict(1) == [2]  # leaf [1, 3], clock 2
    assert cache.evict(1) == [0]  # parent [1] is now a leaf at clock 2, older than [9]
    assert cache.evict(1) == [3]
    # Within one call, a parent freed of its last child joins the candidates right away.
    assert build().evict(3) == [1, 2, 0]


def test_unlock_below_zero_raises() -> None:
    cache = RadixCacheManager(2)
    cache.insert([1, 2, 3, 4], [0, 1])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.handle)
    cache.unlock(m.handle)
    with pytest.raises(RuntimeError):
        cache.unlock(m.handle)
    assert cache._audit() == CacheStats(2, 2)  # the failed unlock changed nothing


def test_lock_after_eviction_raises() -> None:
    cache = RadixCacheManager(1)
    cache.insert([1], [0])
    m = cache.match_prefix([1])
    cache.evict(1)
    with pytest.raises(RuntimeError):
        cache.lock(m.handle)


def test_foreign_handle_rejected() -> None:
    cache = RadixCacheManager(1)
    with pytest.raises(TypeError):
        cache.lock(object())


def test_stats_consistent() -> None:
    cache = RadixCacheManager(2)
    cache.insert([1, 2, 3, 4], [0, 1])
    cache.insert([1, 2, 5, 6, 7, 8], [0, 2, 3])
    cache.insert([9, 9], [4])
    assert cache._audit() == cache.stats() == CacheStats(5, 5)
    assert cache.stats().cached_pages == len(owned_pages(cache))
    m = cache.match_prefix([1, 2, 5, 6, 7, 8])
    cache.lock(m.handle)
    cache.lock(m.handle)
    assert cache._audit() == CacheStats(5, 2)
    cache.unlock(m.handle)
    assert cache._audit() == CacheStats(5, 2)
    cache.unlock(m.handle)
    assert cache._audit() == CacheStats(5, 5)
    assert sorted(cache.evict(1000)) == [0, 1, 2, 3, 4]
    assert cache._audit() == cache.stats() == CacheStats(0, 0)


def test_salts_keep_prefixes_apart() -> None:
    """A prefix cached under one salt (vLLM's cache_salt) matches only under it: not under
    another salt, not under none; the same tokens under two salts are two entries, not
    duplicates; eviction ranks every salt's leaves together and forgets emptied salts."""
    cache = RadixCacheManager(2)
    toks = [1, 2, 3, 4]
    assert cache.insert(toks, [0, 1], salt="a") == []
    assert cache.match_prefix(toks).pages == []
    assert cache.match_prefix(toks, salt="b").pages == []
    assert cache.match_prefix(toks, salt="a").pages == [0, 1]
    assert cache.insert(toks, [2, 3], salt="b") == []  # its own copy, not a duplicate
    assert cache.insert(toks, [4, 5]) == []
    assert cache.match_prefix(toks, salt="b").pages == [2, 3]
    assert cache._audit() == CacheStats(6, 6)
    held = cache.match_prefix(toks, salt="b")
    cache.lock(held.handle)
    assert sorted(cache.evict(1)) == [0, 1]  # "a"'s entry was used least recently
    assert "a" not in cache._roots and cache.match_prefix(toks, salt="a").pages == []
    assert sorted(cache.evict(10)) == [4, 5]  # "b"'s is locked
    cache.unlock(held.handle)
    assert sorted(cache.evict(10)) == [2, 3]
    assert list(cache._roots) == [None] and cache._audit() == CacheStats(0, 0)
    inserted = cache.insert_and_match(toks, [6, 7], salt="c")
    assert inserted.match.pages == [6, 7] and cache.match_prefix(toks).pages == []
    for i in range(100):  # requests shorter than a page make no root (they used to stay)
        assert cache.insert([], [], salt=f"tenant-{i}") == []
    assert list(cache._roots) == [None, "c"]
    cache._audit()


# ---------------------------------------------------------------------- randomized simulation


@dataclass
class _Request:
    tokens: List[int]
    handle: Optional[object]
    matched: List[int]  # tree-owned pages, pinned by the lock
    own: List[int]  # pages taken off the free list, owned by the request


def _check_conservation(cache: RadixCacheManager, free: List[int], live: List[_Request],
                        total: int) -> None:
    tree = owned_pages(cache)
    held = [p for r in live for p in r.own]
    counts = Counter(free + tree + held)
    assert all(c == 1 for c in counts.values()), "a page is in two places at once"
    assert sorted(counts) == list(range(total))
    tree_set = set(tree)
    for r in live:
        assert set(r.matched) <= tree_set, "a locked matched page left the tree"
    assert cache._audit() == cache.stats()
    assert cache.stats().cached_pages == len(tree)


def _simulate(seed: int, page_size: int, total: int, steps: int) -> List[List[int]]:
    rng = random.Random(seed)
    cache = RadixCacheManager(page_size)
    free = list(range(total))
    live: List[_Request] = []
    evictions: List[List[int]] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 4 * page_size + 3))]
                for _ in range(5)]

    def take(n: int) -> Optional[List[int]]:
        if len(free) < n:
            freed = cache.evict(n - len(free))
            evictions.append(freed)
            free.extend(freed)
        if len(free) < n:
            return None
        taken = free[:n]
        del free[:n]
        return taken

    def finish(req: _Request) -> None:
        full = len(req.tokens) // page_size
        n_matched = len(req.matched)
        to_insert = req.matched + req.own[:full - n_matched]
        dups = cache.insert(req.tokens[:full * page_size], to_insert)
        assert not set(dups) & set(req.matched), "tree's own page reported as duplicate"
        free.extend(dups)
        free.extend(req.own[full - n_matched:])  # the partial last page
        cache.unlock(req.handle)
        live.remove(req)

    for _ in range(steps):
        if live and (len(live) >= 6 or rng.random() < 0.4):
            req = live[rng.randrange(len(live))]
            if rng.random() < 0.15:  # abort: nothing cached
                free.extend(req.own)
                cache.unlock(req.handle)
                live.remove(req)
            else:
                finish(req)
        else:
            tokens = list(rng.choice(prefixes))
            tokens += [rng.randrange(50) for _ in range(rng.randrange(0, 3 * page_size + 2))]
            if not tokens:
                tokens = [rng.randrange(50)]
            m = cache.match_prefix(tokens)
            assert len(m.pages) * page_size <= len(tokens)
            cache.lock(m.handle)
            need = -(-len(tokens) // page_size) - len(m.pages)
            own = take(need)
            if own is None:
                cache.unlock(m.handle)  # out of memory: reject the request
            else:
                live.append(_Request(tokens, m.handle, list(m.pages), own))
        _check_conservation(cache, free, live, total)

    for req in list(live):
        finish(req)
    _check_conservation(cache, free, live, total)
    assert cache.stats().evictable_pages == cache.stats().cached_pages
    evictions.append(cache.evict(total))
    free.extend(evictions[-1])
    assert cache.stats() == CacheStats(0, 0)
    assert sorted(free) == list(range(total))
    return evictions


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_randomized_conservation(page_size: int) -> None:
    for seed in range(5):
        _simulate(seed, page_size, total=40, steps=400)


def test_deterministic_eviction() -> None:
    first = _simulate(123, 2, total=30, steps=500)
    assert any(first[:-1]), "the pool never ran short: no eviction to compare"
    assert first == _simulate(123, 2, total=30, steps=500)
