"""Attention over the paged KV with torch's scaled_dot_product_attention; runs on CPU and CUDA.

One SDPA call per request (gathering its slots from the page table), which is simple and exact;
the Triton backend is the fast path on GPUs. An FP8 pool's K/V are read back in the query's
dtype (exactly: every float8_e4m3fn value is a bfloat16, float16 and float32 value) with the
layer's K scale folded into the softmax scale and its V scale applied to the output.
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch


class TorchMeta(NamedTuple):
    slots: List[torch.Tensor]  # per request: slot ids of its whole sequence (prefix + new)
    masks: List[torch.Tensor]  # per request: [new, seq] bool causal mask, or an empty tensor
    q_starts: List[int]


class TorchBackend(AttentionBackend):
    def prepare(self, batch: Batch) -> None:
        rows = [r.table_row for r in batch.reqs]
        slots, masks, starts, start = [], [], [], 0
        device = self.page_table.device
        for row, prefix, ext in zip(rows, batch.prefix_lens, batch.extend_lens):
            seq = prefix + ext
            slots.append(self.page_table[row, :seq].to(torch.int64))
            if ext > 1:
                q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
                masks.append(torch.arange(seq, device=device).unsqueeze(0) <= q_pos)
            else:
                masks.append(torch.empty(0, device=device))
            starts.append(start)
            start += ext
        batch.attn_meta = TorchMeta(slots, masks, starts)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: Batch, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:  # this backend names no kv_target, so callers never store for it
            self.pool.store(layer, batch.out_slots, k, v)
        meta: TorchMeta = batch.attn_meta  # type: ignore[assignment]
        out = torch.empty_like(q)
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        scale, v_scale = self.scale, None
        if self.pool.quantized:
            scale, v_scale = scale * self.pool.scales.k[layer], self.pool.scales.v[layer]
        for i, ext in enumerate(batch.extend_lens):
            s = meta.q_starts[i]
            qi = q[s:s + ext].transpose(0, 1)  # [heads, new, d]
            # index_select: indexing float8 tensors with a tensor takes a slow path on CPU
            ki = k_all.index_select(0, meta.slots[i]).to(q.dtype).transpose(0, 1)  # [kvh, seq, d]
            vi = v_all.index_select(0, meta.slots[i]).to(q.dtype).transpose(0, 1)
            mask = meta.masks[i] if meta.masks[i].numel() else None
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            if v_scale is not None:
                oi = oi * v_scale
            out[s:s + ext] = oi.transpose(0, 1)
        return out.reshape(q.shape[0], -1)
