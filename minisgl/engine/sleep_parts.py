"""Sleep mode's names, checked where they arrive: the parts that sleep ("weights",
"kv_cache"), the levels (1, 2) and SGLang's tags. Imports no torch: the API server checks a
request's values with these before anything is sent (engine/sleep.py does the sleeping)."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)
LEVELS = (1, 2)
CUDA_GRAPH = "cuda_graph"  # SGLang's tag: minisgl's graphs sleep and wake with the parts


def check_level(level: object) -> int:
    """`level` as a sleep level; ValueError naming it where it is not 1 or 2."""
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"sleep level must be 1 (weights kept in host memory, KV cache "
                         f"forgotten) or 2 (both forgotten), not {level!r}")
    return LEVELS[LEVELS.index(level)]


def check_tags(tags: Optional[Iterable[str]]) -> Tuple[str, ...]:
    """The parts a wake-up names (None or empty: both), in TAGS order; ValueError naming an
    unknown one."""
    named = list(tags or TAGS)
    unknown = [t for t in named if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tag {unknown[0]!r}: tags are "
                         f"{', '.join(repr(t) for t in TAGS)}")
    return tuple(t for t in TAGS if t in named)


def sglang_parts(tags: Optional[Iterable[str]]) -> Tuple[str, ...]:
    """The parts SGLang's memory-occupation tags name (its "cuda_graph" aside; None or empty:
    all); ValueError naming an unknown tag, or "cuda_graph" alone."""
    named = list(tags or TAGS)
    unknown = [t for t in named if t not in (*TAGS, CUDA_GRAPH)]
    if unknown:
        raise ValueError(f"unknown tag {unknown[0]!r}: tags are 'weights', 'kv_cache' and "
                         f"'cuda_graph'")
    parts = tuple(t for t in TAGS if t in named)
    if not parts:
        raise ValueError("'cuda_graph' alone: minisgl's CUDA graphs sleep and wake with the "
                         "weights and the KV cache")
    return parts
