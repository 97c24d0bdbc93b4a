"""The FP8 KV cache's per-layer scales, as checkpoints give them.

A checkpoint calibrated for an FP8 KV cache carries one scalar per layer for K and one for V,
named as vLLM reads them: `model.layers.N.self_attn.k_scale` / `v_scale` (also under `attn.`),
the deprecated single `kv_scale` (both K and V), ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`
and compressed-tensors' kv_cache_scheme `k_proj.output_scale` / `v_proj.output_scale`.
`KVScaleCollector.filter` takes these tensors out of the stream the model loads from (the model
has no parameters for them) and keeps their values; a layer the checkpoint gives none for keeps
1.0.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from minisgl.kvcache.pool import KVScales
from minisgl.layers.source import TensorSource

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(.+)$")
# The name after "self_attn.": which scales it sets.
_KINDS: Dict[str, Tuple[str, ...]] = {
    "k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"),
    "attn.k_scale": ("k",), "attn.v_scale": ("v",),
    "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
    "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",),
}


def kv_scale_target(name: str) -> Optional[Tuple[int, Tuple[str, ...]]]:
    """(layer, ("k",) / ("v",) / ("k", "v")) for a checkpoint name of a KV cache scale, else
    None."""
    m = _NAME.search(name)
    if m is None or m.group(2) not in _KINDS:
        return None
    return int(m.group(1)), _KINDS[m.group(2)]


def read_scale(name: str, src: TensorSource) -> float:
    """The one positive finite value of a per-tensor scale, rounded to float32 (the kernels'
    precision, so that every reader quantizes with the same number). ValueError naming it."""
    values = src.read().reshape(-1).float()
    if values.numel() != 1:
        raise ValueError(f"KV cache scale {name} must be one value (per-tensor), got shape "
                         f"{tuple(src.shape)}")
    value = float(values[0])
    if not 0 < value < float("inf"):
        raise ValueError(f"KV cache scale {name} must be positive and finite, got {value}")
    return value


class KVScaleCollector:
    """Collects the KV cache scales of a checkpoint stream for a model of `num_layers` layers."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._found: Dict[str, List[Optional[float]]] = {"k": [None] * num_layers,
                                                         "v": [None] * num_layers}

    def filter(self, tensors: Iterable[Tuple[str, TensorSource]]
               ) -> Iterator[Tuple[str, TensorSource]]:
        """The stream without its KV cache scales, whose values are kept."""
        for name, src in tensors:
            target = kv_scale_target(name)
            if target is None:
                yield name, src
                continue
            layer, kinds = target
            if layer >= self.num_layers:
                raise ValueError(f"KV cache scale {name} names layer {layer}; the model has "
                                 f"{self.num_layers}")
            value = read_scale(name, src)
            for kind in kinds:
                self._found[kind][layer] = value

    @property
    def found(self) -> int:
        """How many per-layer scales (K and V counted apart) the checkpoint gave."""
        return sum(v is not None for values in self._found.values() for v in values)

    def scales(self) -> KVScales:
        """Each layer's scales, 1.0 where the checkpoint gave none."""
        k, v = ([1.0 if x is None else x for x in self._found[kind]] for kind in ("k", "v"))
        return KVScales(tuple(k), tuple(v))

