"""The paged KV pool of one rank: per layer, K and V for `num_pages * page_size` token slots.

Slot s belongs to page s // page_size. The pool only stores; which slots a request uses is the
page table's business (scheduler/table.py) and which pages are free is the scheduler's cache.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        # One extra page past the allocatable ones: padded (CUDA-graph) rows write K/V there.
        self.scratch_slot = self.num_slots
        shape = (num_layers, self.num_slots + page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of new tokens: slots [T] (int32 or int64), k/v [T, kv_heads, head_dim]."""
        slots = slots.long()  # index_copy_ takes int64 indices only
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem
