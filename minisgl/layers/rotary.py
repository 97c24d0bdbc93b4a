"""Rotary position embedding (neox / rotate-half layout; GLM-4's GPT-J interleaved pairs in
torch ops) with the frequency scalings checkpoints ask for in `rope_scaling` /
`rope_parameters`: "llama3" (Llama 3.1+), "yarn" (Qwen2.5 / Qwen3 past 32K), "linear" (position
interpolation), "longrope" (Phi-3 128K, Phi-3.5, Phi-4-mini). A partial rotary embedding
(Phi-4-mini, GLM-4) turns the first `rotary_dim` dimensions of each head only.

Longrope has two tables: short factors for positions below its pretraining length k, long ones
for every position. Callers index the tables with rope indices (`RopeIndex`): every token of a
sequence longer than k rotates with the long table (index p + k), every token of a shorter one
with the short table (index p), as transformers' Phi-3 generation does (it recomputes a
sequence's cache with the long factors when the sequence grows past k; the scheduler does so
by prefilling it again: `Req.long_rope`). A decode token at or past k is thus in a long
sequence and one below k in a short one, so its index follows from its position alone
(`RopeIndex.of_positions`, which CUDA graphs apply); a prefill's tokens take their request's
(`RopeIndex.host`).

cos/sin are precomputed in float32 for every position up to the context length, the same way the
reference implementation computes them, so float32 outputs match it exactly. YaRN's attention
factor multiplies both tables, as Hugging Face applies it. Dynamic NTK is refused: its frequencies
change with the longest sequence in a batch, so no static table (nor a KV cache written under
earlier frequencies) reproduces it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import HeadNorms, KVStore, KVTarget, ProductScales


class RopeFrequencies(NamedTuple):
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    scale: float  # multiplies cos and sin (YaRN's and longrope's attention factor; 1 elsewhere)


class RopeIndex(NamedTuple):
    """Rope indices of positions (see the module's docstring); `long_from` k is longrope's
    pretraining length, 0 without longrope (the index is the position)."""

    long_from: int = 0

    def of_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Indices of decode tokens (and of a short sequence's prompt tokens, all below k): a
        decode token at or past k belongs to a long sequence, one below k to a short one."""
        if not self.long_from:
            return positions
        return positions + self.long_from * (positions >= self.long_from)

    def host(self, start: int, count: int, long: bool) -> range:
        """Indices of positions start.. (`count` of them) of a sequence that is long (its
        every token takes the long table) or not."""
        shift = self.long_from if long else 0
        return range(start + shift, start + shift + count)


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[dict],
                     max_positions: int, long: bool = False) -> RopeFrequencies:
    """Inverse frequencies and the cos/sin scale of `scaling` (ModelConfig's: its type under
    `rope_type`) over `head_dim` dimensions (the rotary ones); raises ValueError for a type we
    do not implement. `max_positions`: the checkpoint's `max_position_embeddings`, YaRN's and
    llama3's pretraining length where the scaling does not give one. `long`: longrope's long
    factors (else its short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return RopeFrequencies(inv_freq, 1.0)
    assert scaling is not None
    if kind == "linear":
        return RopeFrequencies(inv_freq / scaling["factor"], 1.0)
    if kind == "llama3":
        return RopeFrequencies(_llama3_scale(inv_freq, scaling, max_positions), 1.0)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_positions)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions, long)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _longrope(head_dim: int, theta: float, s: dict, max_positions: int,
              long: bool) -> RopeFrequencies:
    """LongRoPE (Phi-3): each frequency divided by its factor (short or long); the attention
    factor from the stretch max_positions / pretraining length unless given. Hugging Face's
    arithmetic, so float32 tables match it."""
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return RopeFrequencies(1.0 / (ext * theta ** shape), float(attention))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, s: dict, max_positions: int) -> RopeFrequencies:
    """YaRN (arXiv 2309.00071): frequencies that complete fewer than `beta_slow` turns over the
    pretraining length are interpolated by `factor`, those that complete more than `beta_fast`
    are kept, a linear ramp blends the dimensions between; the attention factor (from `factor`,
    or `mscale` / `mscale_all_dim`, unless given) scales cos and sin. Hugging Face's arithmetic,
    step for step, so float32 tables match it."""
    old_len = s.get("original_max_position_embeddings") or max_positions
    factor = s.get("factor") or max_positions / old_len
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
                     if mscale and all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def turns_dim(turns: float) -> float:  # the dimension completing `turns` over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(beta_fast), turns_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return RopeFrequencies(inv_freq, float(attention))


def _llama3_scale(inv_freq: torch.Tensor, s: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1's frequency scaling; the pretraining length defaults to `max_positions` (the
    checkpoint's max_position_embeddings), as Hugging Face's does."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s.get("original_max_position_embeddings") or max_positions
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


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Each pair (x0, x1) of neighbouring dimensions as (-x1, x0)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _turned(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int,
            interleaved: bool = False) -> torch.Tensor:
    """x with its first `dims` dimensions rotated (the rest as they are): their two halves,
    or with `interleaved` their neighbouring pairs."""
    rotate = _rotate_pairs if interleaved else _rotate_half
    if dims == x.shape[-1]:
        return x * cos + rotate(x) * sin
    turn, keep = x[..., :dims], x[..., dims:]
    return torch.cat([turn * cos + rotate(turn) * sin, keep], dim=-1)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers [rope indices, rotary_dim] float32 (register_buffer)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[dict], policy: KernelPolicy = KernelPolicy(),
                 trained_positions: Optional[int] = None,
                 rotary_dim: Optional[int] = None, interleaved: bool = False) -> None:
        """Tables for positions below `max_positions` (the context length; longrope's short
        table below its pretraining length before them: `RopeIndex`). `trained_positions`: the
        checkpoint's `max_position_embeddings` (YaRN's default pretraining length; default
        `max_positions`). `rotary_dim`: the leading dimensions of a head that turn (default
        all). `interleaved`: neighbouring pairs turn (GPT-J's layout, GLM-4's), not the two
        halves. `policy`: the fused kernel where `policy.fused`, launched with programmatic
        dependent launch where `policy.pdl`."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.interleaved = interleaved
        # The fused kernels need a power-of-two head_dim turned whole, halves; else torch's.
        self.fused = (policy.fused and head_dim & (head_dim - 1) == 0
                      and self.rotary_dim == head_dim and not interleaved)
        self.policy = policy
        trained = trained_positions or max_positions
        self.index = RopeIndex((scaling or {}).get("original_max_position_embeddings", 0)
                               if (scaling or {}).get("rope_type") == "longrope" else 0)
        long = bool(self.index.long_from)
        tables = [self._table(theta, scaling, trained, max_positions, long)]
        if self.index.long_from:  # the short table first: indices below k
            tables.insert(0, self._table(theta, scaling, trained, self.index.long_from, False))
        self.register_buffer("cos", torch.cat([c for c, _ in tables]), persistent=False)
        self.register_buffer("sin", torch.cat([s for _, s in tables]), persistent=False)

    def _table(self, theta: float, scaling: Optional[dict], trained: int, positions: int,
               long: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = rope_frequencies(self.rotary_dim, theta, scaling, trained, long)
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
        # each frequency twice: side by side for the interleaved pairs, else once per half
        emb = (freqs.repeat_interleave(2, dim=-1) if self.interleaved
               else torch.cat((freqs, freqs), dim=-1))
        return emb.cos() * scale, emb.sin() * scale

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
        return (_turned(q, cos, sin, self.rotary_dim, self.interleaved),
                _turned(k, cos, sin, self.rotary_dim, self.interleaved))
