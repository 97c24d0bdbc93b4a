"""Rotary position embedding (neox / rotate-half layout) with optional "llama3" frequency scaling.

cos/sin are precomputed in float32 for every position up to the context length, the same way the
reference implementation computes them, so float32 outputs match it exactly.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import HeadNorms, KVStore, KVTarget, ProductScales


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Inverse frequencies; raises ValueError for a rope type we do not implement."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers [max_positions, head_dim] float32 (register_buffer)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict], policy: KernelPolicy = KernelPolicy()) -> None:
        """`policy`: the fused kernel where `policy.fused`, launched with programmatic dependent
        launch where `policy.pdl`."""
        super().__init__()
        # The fused kernel needs a power-of-two head_dim; other sizes take the torch path.
        self.fused = policy.fused and head_dim & (head_dim - 1) == 0
        self.policy = policy
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _fusable(self, *xs: torch.Tensor) -> bool:
        """The fused kernel applies: CUDA, each token's heads one dense block."""
        return self.fused and all(x.is_cuda and x.stride(1) == x.shape[2] and x.stride(2) == 1
                                  for x in xs)

    def rotate_into_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, target: KVTarget,
                          scales: Optional[ProductScales] = None,
                          norms: Optional[HeadNorms] = None) -> bool:
        """Rotate q in place and write the rotated k and v to the target's caches at its slots
        (k itself is left as it is), in one launch; True when done, False where the fused
        kernel does not apply (nothing done: the caller rotates with `forward` and stores K/V
        itself). `scales`: q, k, v are views of an unscaled FP8 QKV product, scaled in the
        same launch (kernels/rotary.rotary_qk_); q ends scaled, k and v stay unscaled.
        `norms`: q's and k's per-head RMSNorms, applied in the same launch before the
        rotation (q ends normed)."""
        if not self._fusable(q, k, v):
            return False
        from minisgl.kernels import rotary
        rotary.rotary_qk_(q, k, positions, self.cos, self.sin, self.policy.pdl,
                          KVStore(v, target), scales, norms)
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]. The fused path
        rotates q and k in place."""
        if self._fusable(q, k):
            from minisgl.kernels import rotary
            return rotary.rotary_qk_(q, k, positions, self.cos, self.sin, self.policy.pdl)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
