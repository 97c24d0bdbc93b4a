"""The attention backend interface.

A backend is built once per engine with the KV pool and the page table. Per batch, `prepare`
turns the batch's lengths into whatever metadata its kernels need (kept in `batch.attn_meta`);
per layer, `forward` stores the new tokens' K/V into their slots and attends over the request's
whole sequence (cached prefix plus new tokens, causally). A backend may instead name its K/V
target (`kv_target`), so that a fused kernel before it (rotary embedding) writes K/V there and
`forward` is told so (`kv_stored`): one launch fewer per layer.

A layer with a sliding window W (`window(layer)`, 0: none) attends, for a token at position p,
only to positions p - W + 1 .. p (transformers' `kv_idx > q_idx - window`). Its K/V stay in the
pool like every layer's: the window is a mask, so the prefix cache and the page accounting do
not depend on it. With a `softcap` c (Gemma's attn_logit_softcapping) a score s (q.k times the
scale) becomes c * tanh(s / c) before the softmax.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

from minisgl.core import Batch
from minisgl.kernels.types import KVTarget
from minisgl.kvcache import KVPool


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, page_table: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float,
                 windows: Sequence[int] = (), softcap: float = 0.0) -> None:
        """`windows`: each layer's sliding window, 0 for full attention (ModelConfig's
        `layer_windows`); empty: no layer slides. `softcap`: the scores' tanh cap (0:
        none)."""
        if softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
        layers = pool.k.shape[0]
        if windows and (len(windows) != layers or min(windows) < 0):
            raise ValueError(f"windows must give each of the pool's {layers} layers "
                             f"a window >= 0, got {tuple(windows)}")
        self.pool = pool
        self.page_table = page_table  # [rows, max_context] int32 slot ids, written by the scheduler
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.windows = tuple(windows)
        self.softcap = softcap

    def window(self, layer: int) -> int:
        """The sliding window of `layer`; 0: it attends to the whole sequence."""
        return self.windows[layer] if self.windows else 0

    @abstractmethod
    def prepare(self, batch: Batch) -> None:
        """Build `batch.attn_meta` from batch.reqs / prefix_lens / extend_lens (device tensors)."""

    def kv_target(self, layer: int, batch: Batch) -> Optional[KVTarget]:
        """Where a caller may write this layer's new K/V itself before `forward`, passing
        `kv_stored=True` to it; None (the default): `forward` stores them."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: Batch, kv_stored: bool = False) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] for the batch's T new tokens -> [T, heads * d].
        `kv_stored`: the caller already wrote k/v to `kv_target(layer, batch)` (k/v are then
        not read)."""
