"""How a projection's weights are stored: 16-bit (dense), FP8 (layers/fp8.py) or packed
integers (layers/packed.py). The model builder asks the checkpoint's quantization config once
per projection (models/decoder.Traits.weight_format) and hands the answer to the layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minisgl.layers.fp8 import Fp8Spec
from minisgl.layers.packed import PackedSpec


@dataclass(frozen=True)
class WeightFormat:
    """`fp8`: FP8 weights in that format; `packed`: packed integers in that format; neither:
    dense weights in the model's dtype. Both at once is a ValueError: a checkpoint's tensor is
    one or the other."""

    fp8: Optional[Fp8Spec] = None
    packed: Optional[PackedSpec] = None

    def __post_init__(self) -> None:
        if self.fp8 is not None and self.packed is not None:
            raise ValueError(f"weights are FP8 ({self.fp8}) or packed integers "
                             f"({self.packed}), not both")
