"""The small types the kernels share with their callers: the gated activations' codes, where a
layer's new K/V go, what a norm
with a residual add returns, what the fused QKV kernel needs besides the projection, the
attention and MoE kernels' tilings, FP8 and packed experts' weights and the fused all-reduce's
view of its peers' buffers.

They live here, below every caller, so that no import runs upward; this module imports torch
only, so layers, attention and distributed import it at the top (the kernel modules themselves
import triton, and only GPU paths import them).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch


# The gated MLP's activations, act(gate) * up: the kernels' ACT codes (layers/activation.py maps
# config names to them)
SILU = 0
GELU_TANH = 1  # GELU's tanh approximation (transformers' gelu_pytorch_tanh: Gemma)


class KVTarget(NamedTuple):
    """Where one layer's new K/V go: k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]; FP8
    (float8_e4m3fn) caches get k / k_scale and v / v_scale, quantized as store_kv does."""

    k_cache: torch.Tensor  # [slots, kv_heads, d], contiguous
    v_cache: torch.Tensor
    slots: torch.Tensor  # [T] int32 / int64, one per new token
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def quantized(self) -> bool:
        return self.k_cache.dtype == torch.float8_e4m3fn


class KVStore(NamedTuple):
    """What `rotary.rotary_qk_` writes instead of rotating k in place: the rotated k and a copy
    of v, to the target's caches at its slots."""

    v: torch.Tensor  # [tokens, kv_heads, head_dim], each token's heads one dense block
    target: KVTarget


class Normed(NamedTuple):
    """What a norm with a residual add returns: `out` (the normed sum, or whatever a fused
    kernel computed from it: a projection, an activation) and `residual`, the sum itself."""

    out: torch.Tensor
    residual: torch.Tensor


class ProductScales(NamedTuple):
    """The scales of an FP8 product taken unscaled (kernels/fp8.unscaled_mm): its value is
    product * row * col in float32, rounded once to the product's dtype; the kernel that reads
    the product next (a norm, SiLU-and-mul, the rotary embedding) applies them."""

    row: torch.Tensor  # [M, 1] float32, the activations' per-token scales
    col: torch.Tensor  # [N] float32, the weight's per-output-row scales


class HeadNorms(NamedTuple):
    """Per-head RMSNorms of q and k before the rotary embedding (Qwen3's q_norm / k_norm): each
    head's [head_dim] vector normed and scaled by one weight shared by all heads, rounded as the
    RMSNorm layer rounds (kernels/rmsnorm.rms_apply)."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float


class QKVRope(NamedTuple):
    """What `gemv.norm_qkv_rope` needs besides the projection: the token's position, the rotary
    cos / sin caches (float32 [max_positions, head_dim]), the head counts, and where its K/V
    go (the target's caches, [slots, n_kv, head_dim] contiguous, at its one slot)."""

    positions: torch.Tensor  # [1]
    cos: torch.Tensor
    sin: torch.Tensor
    n_q: int
    n_kv: int
    target: KVTarget


class DecodeTiles(NamedTuple):
    block_n: int  # KV tokens per loop iteration
    num_warps: int
    num_stages: int = 2


class ExtendTiles(NamedTuple):
    block_m: int  # new tokens per program
    block_n: int  # KV tokens per loop iteration
    num_warps: int
    num_stages: int = 2


class GemmTiles(NamedTuple):
    """One grouped GEMM's tiling over (rows, output features, reduced features)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row blocks that sweep the output features together (L2 reuse)


class MoETiles(NamedTuple):
    """The fused MoE kernel's tiling: rows per block (each block holds one expert's rows, so
    every expert's row count pads up to a multiple of it), and each grouped GEMM's tiles."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles


class ExpertScales(NamedTuple):
    """What FP8 experts' weights are multiplied by (w = fp8 * scale, broadcast) and how their
    inputs are quantized (layers/experts.Experts lays them out; kernels/moe.py reads them).

    `block` None: per output row, w13 [E, 2, I] (gate's rows, then up's) and w2 [E, H]; the
    inputs per token, or by the static per-tensor `w13_input` / `w2_input` [1]. `block` (Bn,
    Bk): w13 [E, 2, ceil(I / Bn), ceil(H / Bk)], w2 [E, ceil(H / Bn), ceil(I / Bk)]; the inputs
    per 1 x Bk group."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: Optional[Tuple[int, int]] = None
    w13_input: Optional[torch.Tensor] = None
    w2_input: Optional[torch.Tensor] = None


class PackedGemm(NamedTuple):
    """One grouped GEMM's packed integer experts (layers/experts.Experts lays them out,
    kernels/moe.py reads them; per expert the layout of kernels/int_mm.py): w[e][n, k] =
    (q - zeros[e, g[e, k], n]) * scales[e, g[e, k], n], q at bits (k % P) * bits of word
    qweight[e, k // P, n], P = 32 / bits. A gated GEMM's columns: the gate's, then up's."""

    qweight: torch.Tensor  # [E, ceil(K / P), N] int32
    scales: torch.Tensor  # [E, G, N] float32
    zeros: torch.Tensor  # [E, G, N] float16
    g_idx: torch.Tensor  # [E, K] int32
    bits: int
    group_run: int = 0  # g[e, k] == k // group_run for every expert (0: read g_idx)


class PeerBuffers(NamedTuple):
    """Where the fused all-reduce kernel (kernels/allreduce.py) finds every rank's buffer, as
    this process maps them.

    `buffer`: this rank's whole buffer (uint8, staging then flags). `ptrs`: int64 [world] on the
    kernel's device, the address of rank q's buffer at index q (symmetric memory maps every
    peer's buffer into this process; ptrs[rank] is buffer's own address). Each buffer holds
    `staging_bytes` bytes of staging, then `allreduce.flag_bytes(world)` bytes of flags, zero
    before the first call. `errors`: int32 [1] on the device, bits set by barriers that gave up.
    `trap`: trap on a barrier that gave up (GPU; the interpreter cannot)."""

    buffer: torch.Tensor
    ptrs: torch.Tensor
    rank: int
    world: int
    staging_bytes: int
    errors: torch.Tensor
    spin_limit: int
    trap: bool


# FP8 weights and activations (float8_e4m3fn): the largest value, and the smallest amax a scale
# is made from, so that an all-zero row (a CUDA graph's padding) gets a tiny, finite scale and
# quantizes to zeros.
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
FP8_MIN_AMAX = 1e-10
