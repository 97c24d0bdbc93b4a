"""The paged KV pool of one rank: per layer, K and V for `num_pages * page_size` token slots.

Slot s belongs to page s // page_size. The pool only stores; which slots a request uses is the
page table's business (scheduler/table.py) and which pages are free is the scheduler's cache.

An FP8 pool (dtype float8_e4m3fn) holds each layer's K and V divided by that layer's per-tensor
scale (`k_scales[layer]`, `v_scales[layer]`), clamped to the format's finite range (+-448) and
rounded to nearest: a reader multiplies by the scale again (`dequantize`). Every other dtype
stores K/V as they are (the scales are then 1.0 and unused).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from minisgl.devices import KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # the largest finite float8_e4m3fn


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for a `kv_cache_dtype` setting: "auto" is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVScales(NamedTuple):
    """Per-layer per-tensor scales of an FP8 pool: the value stored is K / k[layer] (V / v)."""

    k: Tuple[float, ...]
    v: Tuple[float, ...]

    @staticmethod
    def ones(num_layers: int) -> "KVScales":
        return KVScales((1.0,) * num_layers, (1.0,) * num_layers)

    def differences(self, other: "KVScales") -> List[str]:
        """`layer L k: this -> other` for every scale `other` sets otherwise, K before V."""
        return [f"layer {layer} {kind}: {a:g} -> {b:g}"
                for kind, mine, theirs in (("k", self.k, other.k), ("v", self.v, other.v))
                for layer, (a, b) in enumerate(zip(mine, theirs)) if a != b]


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float32, clamped to +-448 and rounded to float8_e4m3fn (what the Triton
    K/V store writes: the same IEEE division and rounding)."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values an FP8 pool's entries `x` stand for, in `dtype` (x times its scale)."""
    return (x.float() * scale).to(dtype)


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 scales: Optional[KVScales] = None) -> None:
        """`scales`: an FP8 pool's per-layer scales (None: 1.0 each); other dtypes take none."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        self.quantized = dtype == FP8_KV_DTYPE
        if scales is None:
            scales = KVScales.ones(num_layers)
        elif not self.quantized:
            raise ValueError(f"K/V scales apply to an FP8 KV pool only, not to {dtype}")
        if len(scales.k) != num_layers or len(scales.v) != num_layers:
            raise ValueError(f"K/V scales for {len(scales.k)}/{len(scales.v)} layers, the model "
                             f"has {num_layers}")
        self.scales = scales
        # One extra page past the allocatable ones: padded (CUDA-graph) rows write K/V there.
        self.scratch_slot = self.num_slots
        shape = (num_layers, self.num_slots + page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of new tokens: slots [T] (int32 or int64), k/v [T, kv_heads, head_dim];
        an FP8 pool quantizes them with the layer's scales."""
        slots = slots.long()  # index_copy_ takes int64 indices only
        if not self.quantized:
            self.k[layer].index_copy_(0, slots, k)
            self.v[layer].index_copy_(0, slots, v)
            return
        # index_copy_ has no float8 kernels: copy the bytes.
        for cache, x, scale in ((self.k, k, self.scales.k[layer]),
                                (self.v, v, self.scales.v[layer])):
            cache[layer].view(torch.uint8).index_copy_(0, slots,
                                                       quantize(x, scale).view(torch.uint8))

    def fill_normal_(self, generator: Optional[torch.Generator] = None) -> None:
        """Random K/V in every slot (standard normal values; quantized with the scales in an FP8
        pool), one layer at a time: benchmarks never time on zeros, and tests start from
        junk."""
        for layer in range(self.k.shape[0]):
            for cache, scales in ((self.k, self.scales.k), (self.v, self.scales.v)):
                if not self.quantized:
                    cache[layer].normal_(generator=generator)
                    continue
                x = torch.randn(cache.shape[1:], generator=generator, device=cache.device)
                cache[layer].copy_(quantize(x, scales[layer]))

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype_bytes(dtype)
