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
made in float32 and cast to the query's dtype.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch


class TorchMeta(NamedTuple):
    slots: List[torch.Tensor]  # per request: slot ids of its whole sequence (prefix + new)
    # Per request: a [new, seq] additive mask (0: attend, -inf: not) for several new tokens
    # after a prefix at least as long; None where no mask is needed.
    masks: List[Optional[torch.Tensor]]
    # Per request: None, or causal attention with this many zero queries before the new ones
    # (the prefix positions; 0 from position 0).
    causal_pad: List[Optional[int]]
    q_starts: List[int]


class TorchBackend(AttentionBackend):
    def prepare(self, batch: Batch) -> None:
        rows = [r.table_row for r in batch.reqs]
        slots: List[torch.Tensor] = []
        masks: List[Optional[torch.Tensor]] = []
        pads: List[Optional[int]] = []
        starts: List[int] = []
        start = 0
        device = self.page_table.device
        for row, prefix, ext in zip(rows, batch.prefix_lens, batch.extend_lens):
            seq = prefix + ext
            slots.append(self.page_table[row, :seq].to(torch.int64))
            pads.append(prefix if 1 < ext and prefix < ext else None)
            if 1 < ext <= prefix:
                q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
                later = torch.arange(seq, device=device).unsqueeze(0) > q_pos
                dtype = torch.float32 if self.pool.quantized else self.pool.k.dtype
                masks.append(torch.zeros(later.shape, dtype=dtype, device=device
                                         ).masked_fill_(later, float("-inf")))
            else:
                masks.append(None)
            starts.append(start)
            start += ext
        batch.attn_meta = TorchMeta(slots, masks, pads, starts)

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
        for i, ext in enumerate(batch.extend_lens):
            s = meta.q_starts[i]
            pad = meta.causal_pad[i]
            qi = q[s:s + ext]
            if pad:
                qi = torch.cat([qi.new_zeros((pad, *qi.shape[1:])), qi])
            qi = qi.transpose(0, 1).unsqueeze(0)  # [1, heads, (pad +) new, d]
            # index_select: indexing float8 tensors with a tensor takes a slow path on CPU
            ki = k_all.index_select(0, meta.slots[i]).to(q.dtype).transpose(0, 1).unsqueeze(0)
            vi = v_all.index_select(0, meta.slots[i]).to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask = meta.masks[i]
            if mask is not None and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                is_causal=pad is not None, scale=scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            if v_scale is not None:
                oi = oi * v_scale
            out[s:s + ext] = oi[0, :, pad or 0:].transpose(0, 1)
        return out.reshape(q.shape[0], -1)
