"""Attention over the paged KV with torch's scaled_dot_product_attention; runs on CPU and CUDA.

One SDPA call per request (gathering its slots from the page table), which is simple and exact;
the Triton backend is the fast path on GPUs.

The calls are 4-D ([1, heads, tokens, head_dim]): only then does SDPA pick a fused kernel
(FlashAttention on CPU, which works block by block), where 3-D inputs fall back to its math
path, which materialises a [heads, new, seq] float32 score matrix (and as much again for the
mask and the softmax): memory and time quadratic in a long prompt, times the heads. Several new
tokens are SDPA's own causal attention (`is_causal`, no mask, the kernel skips the blocks above
the diagonal), which needs as many queries as keys: after a cached prefix shorter than the
extend, zero queries stand in for the prefix positions (their rows are dropped), which costs
less than a mask's full [new, seq] work. After a longer prefix a [new, seq] additive mask (no
head dimension) is made once per batch in the KV dtype, so no layer converts one again. An FP8 pool's K/V are read back in the query's dtype
(exactly: every float8_e4m3fn value is a bfloat16, float16 and float32 value) with the layer's
K scale folded into the softmax scale and its V scale applied to the output; its masks are
made in float32 and cast to the query's dtype. Softcapped scores (base.py) take a plain
matmul-softmax path with a mask for every multi-token extend, as SDPA cannot cap them. A
sliding-window layer (base.py) attends one
new token to its window's tail of the keys, several through a mask that also cuts what lies
before each one's window (keys from the first one's window on): the plans are made once per
batch for each window the layers use.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch
from minisgl.kvcache import KVPool


class Attend(NamedTuple):
    """How one request's new tokens attend in layers of one window (a SDPA call)."""

    slots: torch.Tensor  # slot ids of the keys attended: the sequence, or its window's tail
    # A [new, keys] additive mask (0: attend, -inf: not), or None where none is needed.
    mask: Optional[torch.Tensor]
    # None, or causal attention with this many zero queries before the new ones (the prefix
    # positions; 0 from position 0).
    causal_pad: Optional[int]


class TorchMeta(NamedTuple):
    q_starts: List[int]  # first row in q of each call's queries
    lens: List[int]  # each call's queries
    plans: Dict[int, List[Attend]]  # per window the layers use (0: full), one per call


class TorchBackend(AttentionBackend):
    def __init__(self, pool: KVPool, page_table: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, windows: Sequence[int] = (),
                 softcap: float = 0.0, batch_invariant: bool = False) -> None:
        """`batch_invariant` (deterministic inference): every new token attends in a call of
        its own, one query over its keys as a decode step's token does, so that its bits are
        the same in a prefill chunk, a verify step or a decode step of any batch (a prompt's
        attention then takes one call a token). Other arguments: AttentionBackend's."""
        super().__init__(pool, page_table, num_heads, num_kv_heads, head_dim, scale, windows,
                         softcap)
        self.batch_invariant = batch_invariant

    def prepare(self, batch: Batch) -> None:
        # One call per request (row, cached prefix, new tokens), or per token where invariant.
        calls = list(zip([r.table_row for r in batch.reqs], batch.prefix_lens,
                         batch.extend_lens))
        if self.batch_invariant:
            calls = [(row, prefix + j, 1) for row, prefix, ext in calls for j in range(ext)]
        starts = [0]
        for _, _, ext in calls[:-1]:
            starts.append(starts[-1] + ext)
        plans: Dict[int, List[Attend]] = {}
        for window in sorted(set(self.windows) | {0}):
            plans[window] = [self._attend(row, prefix, ext, window)
                             for row, prefix, ext in calls]
        batch.attn_meta = TorchMeta(starts, [ext for _, _, ext in calls], plans)

    def _attend(self, row: int, prefix: int, ext: int, window: int) -> Attend:
        """The call for `ext` new tokens after `prefix` cached ones, within `window` (0:
        none). A window longer than the sequence is no window; one token's window is the
        sequence's tail; several tokens' keys start at the first one's window and a mask cuts
        each query's (as it cuts the causal future after a prefix at least as long)."""
        seq = prefix + ext
        device = self.page_table.device
        lo = max(0, prefix - window + 1) if window else 0  # the first new token's window
        slots = self.page_table[row, lo:seq].to(torch.int64)
        windowed = bool(window) and seq > window and ext > 1
        if not windowed and not 1 < ext <= prefix and not (self.softcap and ext > 1):
            return Attend(slots, None, prefix if 1 < ext and prefix < ext else None)
        q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
        k_pos = torch.arange(lo, seq, device=device).unsqueeze(0)
        hidden = k_pos > q_pos
        if windowed:
            hidden |= k_pos <= q_pos - window
        dtype = torch.float32 if self.pool.quantized else self.pool.k.dtype
        mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
        return Attend(slots, mask.masked_fill_(hidden, float("-inf")), None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: Batch, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:  # this backend names no kv_target, so callers never store for it
            self.pool.store(layer, batch.out_slots, k, v)  # type: ignore[arg-type]
        meta: TorchMeta = batch.attn_meta  # type: ignore[assignment]
        out = torch.empty_like(q)
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        scale, v_scale = self.scale, None
        if self.pool.quantized:
            scale, v_scale = scale * self.pool.scales.k[layer], self.pool.scales.v[layer]
        for s, ext, plan in zip(meta.q_starts, meta.lens, meta.plans[self.window(layer)]):
            pad = plan.causal_pad
            qi = q[s:s + ext]
            if pad:
                qi = torch.cat([qi.new_zeros((pad, *qi.shape[1:])), qi])
            qi = qi.transpose(0, 1).unsqueeze(0)  # [1, heads, (pad +) new, d]
            # index_select: indexing float8 tensors with a tensor takes a slow path on CPU
            ki = k_all.index_select(0, plan.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            vi = v_all.index_select(0, plan.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask = plan.mask
            if mask is not None and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)
            if self.softcap:
                oi = _softcapped_attention(qi, ki, vi, mask, scale, self.softcap)
            else:
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, is_causal=pad is not None, scale=scale,
                    enable_gqa=self.num_heads != self.num_kv_heads)
            if v_scale is not None:
                oi = oi * v_scale
            out[s:s + ext] = oi[0, :, pad or 0:].transpose(0, 1)
        return out.reshape(q.shape[0], -1)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: Optional[torch.Tensor], scale: float, cap: float
                          ) -> torch.Tensor:
    """Attention whose scores are capped (cap * tanh(s / cap)), which SDPA does not do: as
    transformers' eager attention computes it (scores in the query's dtype, the softmax in
    float32). q [1, heads, new, d], k/v [1, kv_heads, keys, d]; `mask` [new, keys] additive
    (None: one query, every key visible)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / cap) * cap
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
