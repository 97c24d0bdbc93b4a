"""Which of a model's linear layers are FP8, and how: a checkpoint's layout
(models/checkpoint_quant.py) combined with the `quantization` setting and the device into one
plan that the decoder asks per layer.

The decoder's projections (QKV, O, gate/up, down) and mixture-of-experts experts (routed and
shared) may be FP8; embeddings, the LM head and the routers stay in the compute dtype (a
checkpoint with FP8 tensors there is refused when it loads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from minisgl.layers.fp8 import Fp8Spec, fp8_gemm
from minisgl.models.checkpoint_quant import QUANTIZATIONS, CheckpointQuant, online


@dataclass(frozen=True)
class QuantPlan:
    """The FP8 layers of one rank's model: the checkpoint's layout, or (None) every dense
    projection quantized online; `runtime` carries what the device decides (weight_only on the
    CPU, the GEMM, the compute dtype) into every spec."""

    checkpoint: Optional[CheckpointQuant]
    runtime: Fp8Spec

    def spec_for(self, prefix: str, parts: Sequence[str]) -> Optional[Fp8Spec]:
        """The spec of the layer fusing checkpoint layers `prefix`.`part` (e.g. q_proj, k_proj,
        v_proj). ValueError where the parts differ: a fused layer has one format."""
        if self.checkpoint is None:
            return replace(self.runtime, online=True)
        specs = {p: self.checkpoint.spec_for(f"{prefix}.{p}") for p in parts}
        if len(set(specs.values())) > 1:
            raise ValueError(f"{prefix}: the checkpoint quantizes {', '.join(parts)} "
                             f"differently ({specs}); they are fused into one layer, which "
                             f"has one format")
        spec = specs[parts[0]]
        if spec is None:
            return None
        return replace(self.runtime, block=spec.block, static_input=spec.static_input)


def quant_plan(checkpoint: Optional[CheckpointQuant], quantization: Optional[str],
               device: torch.device, dtype: torch.dtype) -> Optional[QuantPlan]:
    """The plan for a checkpoint's layout and the `quantization` setting (None: the
    checkpoint's, as is a checkpoint method's name, ModelConfig.check_quantization's to
    check; "fp8": the checkpoint's where it is FP8, else online) on `device`: None
    where nothing is FP8. ValueError for a setting it does not know, or FP8 on a GPU
    without it (layers/fp8.fp8_gemm)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if checkpoint is None and online(quantization) is None:
        return None
    runtime = Fp8Spec(weight_only=device.type != "cuda", dtype=dtype,
                      gemm=fp8_gemm(device, dtype))
    return QuantPlan(checkpoint, runtime)
