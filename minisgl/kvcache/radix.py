"""Radix-tree prefix cache at page granularity, with deterministic LRU eviction.

The tree is keyed by token ids. Every node except the root holds a key of whole pages of tokens
(`len(key)` is a positive multiple of `page_size`) and the page ids holding their KV (one per
page). Edges split only at page boundaries; children are keyed by their first page's tokens.

Contract (the scheduler's cache is the only caller; see base.py):
- Who locks: the caller. `match_prefix` returns pages the tree owns and a handle naming the
  deepest matched node. Lock the handle *immediately* (before any `evict`), and unlock it exactly
  once when the request finishes or is aborted. A lock pins the node and all its ancestors.
  Unlocking more often than locking raises RuntimeError; locking a handle whose node was evicted
  meanwhile raises RuntimeError too.
- Who frees: the caller. `insert` takes ownership of the pages it stores and returns the caller's
  pages that duplicate KV the tree already holds under a different page id; the caller frees
  those. `evict` returns the pages it dropped; the caller puts them on the free list. The tree
  never frees anything by itself.
- What eviction may do: remove unlocked leaves (reference count 0), least recently used first,
  ties broken by node creation order. A parent whose last child goes becomes a candidate in turn.
  Locked nodes are never touched, so pages a live request matched stay valid until it unlocks.
- Salts: each `salt` (None included) has its own root, made on its first insert and dropped
  when eviction empties it (but None's), so a prefix matches only under the salt it was cached
  with; eviction ranks every root's leaves together.
- Token ids are Python ints (a request's list): keys are tuples of them, hashed by value.
- Determinism: recency is a logical clock bumped once per `match_prefix`, `insert` or
  `insert_and_match` call, never wall time; children live in insertion-ordered dicts; so every
  tensor-parallel rank that makes the same calls holds the same tree and evicts the same pages.
"""

from __future__ import annotations

import heapq
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from minisgl.kvcache.base import CacheManager, CacheStats, Inserted, PrefixMatch

PageKey = Tuple[int, ...]  # the tokens of one page


class _Node:
    """A tree node: `key` (whole pages of tokens) and the `pages` holding their KV."""

    __slots__ = ("key", "pages", "parent", "children", "ref", "last_access", "uid", "evicted")

    def __init__(self, key: Tuple[int, ...], pages: List[int], parent: Optional[_Node],
                 last_access: int, uid: int) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: Dict[PageKey, _Node] = {}
        self.ref = 0
        self.last_access = last_access
        self.uid = uid
        self.evicted = False

    def path_to_root(self) -> Iterator[_Node]:
        """This node and its ancestors, excluding the root (a salt's root included)."""
        node: Optional[_Node] = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


class RadixCacheManager(CacheManager):
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        super().__init__(page_size)
        self._clock = 0
        self._next_uid = 1
        self._roots: Dict[Optional[str], _Node] = {None: _Node((), [], None, 0, 0)}
        self._cached_pages = 0
        self._evictable_pages = 0

    # ------------------------------------------------------------------ public API

    def match_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None
                     ) -> PrefixMatch:
        """Longest page-aligned prefix of `token_ids` cached under `salt`; a trailing partial
        page is ignored.

        Returns the matched pages (a fresh list) and a handle naming the deepest matched node
        (None when nothing matched). If the match ends inside a node, the node is split there.
        The matched path counts as used now for LRU.
        """
        now = self._tick()
        toks = self._full_pages(token_ids)
        root = self._roots.get(salt)
        if root is None:
            return PrefixMatch(None, [])
        node, pos, pages = root, 0, []
        while pos < len(toks):
            child = node.children.get(self._page_key(toks, pos))
            if child is None:
                break
            n = self._common_pages(child.key, toks, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            node, pos = child, pos + len(child.key)
        self._touch(node, now)
        return PrefixMatch(None if node is root else node, pages)

    def lock(self, handle: Optional[object]) -> None:
        """Pin the handle's node and its ancestors against eviction. None is a no-op."""
        node = self._node_of(handle)
        if node is None:
            return
        if node.evicted:
            raise RuntimeError("lock() on a handle whose node was evicted; lock right after "
                               "match_prefix, before any evict")
        for n in node.path_to_root():
            if n.ref == 0:
                self._evictable_pages -= len(n.pages)
            n.ref += 1

    def unlock(self, handle: Optional[object]) -> None:
        """Undo one `lock(handle)`. None is a no-op; unlocking below zero raises RuntimeError."""
        node = self._node_of(handle)
        if node is None:
            return
        path = list(node.path_to_root())
        if node.evicted or any(n.ref <= 0 for n in path):
            raise RuntimeError("unlock() without a matching lock(): reference count would go "
                               "below zero")
        for n in path:
            n.ref -= 1
            if n.ref == 0:
                self._evictable_pages += len(n.pages)

    def insert(self, token_ids: Sequence[int], pages: List[int], salt: Optional[str] = None
               ) -> List[int]:
        """Cache `pages` for `token_ids` (len(token_ids) must be len(pages) * page_size) under
        `salt`.

        Walks the tree along `token_ids`. For each page position the tree already covers:
        - if the tree holds the same page id there, the page is simply already the tree's (the
          caller matched it earlier) and is NOT returned;
        - if the tree holds a different page id there, the caller's page is a duplicate: it is
          returned, and the caller must free it. The tree keeps its own page.
        The positions past the covered part become one new leaf that takes ownership of the
        caller's remaining pages. Returns the duplicates in position order. Raises ValueError on
        a length mismatch. The whole path counts as used now for LRU.
        """
        return self.insert_and_match(token_ids, pages, salt).duplicates

    def insert_and_match(self, token_ids: Sequence[int], pages: List[int],
                         salt: Optional[str] = None) -> Inserted:
        """`insert`, also returning the tree's pages along the inserted path and a handle on its
        last node: what `match_prefix(token_ids)` would return next, without a second walk."""
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(token_ids)} tokens do not fill {len(pages)} pages "
                             f"of size {self.page_size}")
        now = self._tick()
        if not pages:  # a request shorter than a page: no root made for its salt
            return Inserted([], PrefixMatch(None, []))
        toks = tuple(token_ids)  # ints (see the module docstring)
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = _Node((), [], None, 0, 0)
        node, i = root, 0
        duplicates: List[int] = []
        held: List[int] = []
        while i < len(pages):
            pos = i * self.page_size
            child = node.children.get(self._page_key(toks, pos))
            if child is None:
                node = self._add_leaf(node, toks[pos:], list(pages[i:]), now)
                held.extend(node.pages)
                break
            n = self._common_pages(child.key, toks, pos)
            duplicates.extend(p for p, t in zip(pages[i:i + n], child.pages) if p != t)
            if n < len(child.pages):
                child = self._split(child, n)
            held.extend(child.pages)
            node, i = child, i + n
        self._touch(node, now)
        return Inserted(duplicates, PrefixMatch(None if node is root else node, held))

    def evict(self, num_pages: int) -> List[int]:
        """Drop unlocked leaves, least recently used first (ties: oldest node first), until at
        least `num_pages` pages are dropped or no unlocked leaf is left. Returns the pages."""
        freed: List[int] = []
        if num_pages <= 0:
            return freed
        heap = [self._heap_entry(n) for n in self._iter_nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        while heap and len(freed) < num_pages:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            assert parent is not None
            freed.extend(self._remove_leaf(node))
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, self._heap_entry(parent))
        self._drop_empty_roots()
        return freed

    def stats(self) -> CacheStats:
        """Pages owned by the tree, and those in unlocked nodes (all eventually evictable, since
        a lock pins every ancestor, so an unlocked node's whole subtree is unlocked)."""
        return CacheStats(self._cached_pages, self._evictable_pages)

    # ------------------------------------------------------------------ helpers

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_uid(self) -> int:
        uid = self._next_uid
        self._next_uid += 1
        return uid

    def _full_pages(self, token_ids: Sequence[int]) -> Tuple[int, ...]:
        usable = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:usable])

    def _page_key(self, toks: Tuple[int, ...], pos: int) -> PageKey:
        return toks[pos:pos + self.page_size]

    def _common_pages(self, key: Tuple[int, ...], toks: Tuple[int, ...], pos: int) -> int:
        """Number of leading whole pages on which `key` and `toks[pos:]` agree."""
        ps, n = self.page_size, 0
        limit = min(len(key), len(toks) - pos) // ps
        while n < limit and key[n * ps:(n + 1) * ps] == toks[pos + n * ps:pos + (n + 1) * ps]:
            n += 1
        return n

    @staticmethod
    def _node_of(handle: Optional[object]) -> Optional[_Node]:
        if handle is None or isinstance(handle, _Node):
            return handle
        raise TypeError(f"not a RadixCacheManager handle: {handle!r}")

    def _touch(self, node: _Node, now: int) -> None:
        for n in node.path_to_root():
            n.last_access = now

    def _add_leaf(self, parent: _Node, key: Tuple[int, ...], pages: List[int], now: int) -> _Node:
        leaf = _Node(key, pages, parent, now, self._new_uid())
        parent.children[self._page_key(key, 0)] = leaf
        self._cached_pages += len(pages)
        self._evictable_pages += len(pages)
        return leaf

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Split `node` after its first `num_pages` pages (0 < num_pages < len(node.pages)).

        A new node takes the head and sits between `node` and its parent; `node` keeps the tail,
        so a handle naming `node` still names the same full prefix. The head inherits the
        reference count (every lock through `node` also pins it) and the recency.
        """
        assert 0 < num_pages < len(node.pages) and node.parent is not None
        cut = num_pages * self.page_size
        head = _Node(node.key[:cut], node.pages[:num_pages], node.parent, node.last_access,
                     self._new_uid())
        head.ref = node.ref
        node.parent.children[self._page_key(node.key, 0)] = head  # same key: order kept
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], head
        head.children[self._page_key(node.key, 0)] = node
        return head

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return node.parent is not None and node.ref == 0 and not node.children

    @staticmethod
    def _heap_entry(node: _Node) -> Tuple[int, int, _Node]:
        return (node.last_access, node.uid, node)  # uid is unique: nodes are never compared

    def _remove_leaf(self, node: _Node) -> List[int]:
        parent = node.parent
        assert parent is not None and node.ref == 0 and not node.children
        del parent.children[self._page_key(node.key, 0)]
        node.parent, node.evicted = None, True
        self._cached_pages -= len(node.pages)
        self._evictable_pages -= len(node.pages)
        return node.pages

    def _drop_empty_roots(self) -> None:
        """Forget the salts whose every prefix was evicted (a salt costs nothing once unused)."""
        for salt in [s for s, r in self._roots.items() if s is not None and not r.children]:
            del self._roots[salt]

    def _iter_nodes(self) -> Iterator[_Node]:
        """Every non-root node, depth first in child insertion order, root by root in salt
        insertion order (deterministic)."""
        stack = [c for root in reversed(self._roots.values())
                 for c in reversed(root.children.values())]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def _audit(self) -> CacheStats:
        """Check the tree's invariants and recount its stats from scratch (for tests)."""
        cached = evictable = 0
        for node in self._iter_nodes():
            parent = node.parent
            assert parent is not None and not node.evicted
            assert node.key and len(node.key) == len(node.pages) * self.page_size
            assert parent.children.get(self._page_key(node.key, 0)) is node
            assert node.ref >= sum(c.ref for c in node.children.values())
            cached += len(node.pages)
            evictable += len(node.pages) if node.ref == 0 else 0
        assert (cached, evictable) == (self._cached_pages, self._evictable_pages)
        assert all(root.children for salt, root in self._roots.items() if salt is not None)
        return CacheStats(cached, evictable)
