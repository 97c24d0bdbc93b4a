"""Which linear layers of an integer-quantized checkpoint (AWQ, GPTQ, compressed-tensors
W4A16 / W8A16: models/int_quant.py) stay packed on the GPU (layers/packed.py), decided from
the checkpoint's own tensors before the model is built.

A layer is packed where every checkpoint layer it fuses holds packed tensors (`qweight`, or
compressed-tensors' `weight_packed`) and, with act-order, their `g_idx` agree (the fused
layer's parts share its inputs, so they must share their order; real checkpoints do, as the
order comes from those inputs); a MoE layer's experts are packed where every expert's
projections are. Anything else (a layer the config leaves dense, parts that disagree) is
dequantized as it loads, as on the CPU, where nothing is packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from minisgl.layers.packed import PackedSpec
from minisgl.models.int_quant import IntQuant
from minisgl.models.weights import checkpoint_files

_PACKED_TENSORS = ("qweight", "weight_packed")
_G_IDX = ("g_idx", "weight_g_idx")
# the projections a decoder fuses, as its checkpoint may name them apart
_FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class IntPlan:
    """The packed layers: checkpoint module names (None: every projection, for dummy
    weights) and their spec."""

    quant: IntQuant
    packed: Optional[FrozenSet[str]]

    @property
    def spec(self) -> PackedSpec:
        q = self.quant
        return PackedSpec(q.bits, q.group_size, q.act_order)

    def spec_for(self, prefix: str, parts: Sequence[str]) -> Optional[PackedSpec]:
        """The spec of the layer fusing checkpoint layers `prefix`.`part`; None where it is
        not packed."""
        if self.packed is None or all(f"{prefix}.{p}" in self.packed for p in parts):
            return self.spec
        return None


def int_plan(quant: IntQuant, model_dir: Optional[Path]) -> IntPlan:
    """The plan for the checkpoint in `model_dir` (None: dummy weights, every projection
    packed and no act-order)."""
    if model_dir is None:
        return IntPlan(IntQuant(quant.method, quant.bits, quant.group_size), None)
    tensors = _tensor_files(model_dir)
    modules = {name.rpartition(".")[0] for name in tensors
               if name.rpartition(".")[2] in _PACKED_TENSORS}
    if quant.act_order:
        modules -= set(_disagreeing(modules, tensors))
    return IntPlan(quant, frozenset(modules))


def _tensor_files(model_dir: Path) -> Dict[str, Path]:
    """Each checkpoint tensor's file (the safetensors headers only)."""
    files: Dict[str, Path] = {}
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as h:
            files.update(dict.fromkeys(h.keys(), f))
    return files


def _disagreeing(modules: Iterable[str], tensors: Dict[str, Path]) -> List[str]:
    """The parts of fused layers whose act-order g_idx differ (left dense)."""
    out: List[str] = []
    present = set(modules)
    for parent in {m.rpartition(".")[0] for m in present}:
        for parts in _FUSED_PARTS:
            names = [f"{parent}.{p}" for p in parts]
            if all(n in present for n in names) and not _same_g_idx(names, tensors):
                out.extend(names)
    return out


def _same_g_idx(modules: Sequence[str], tensors: Dict[str, Path]) -> bool:
    found: List[Tuple[str, torch.Tensor]] = []
    for m in modules:
        name = next((f"{m}.{g}" for g in _G_IDX if f"{m}.{g}" in tensors), None)
        if name is None:
            return True  # no g_idx: groups in order, alike
        with safe_open(str(tensors[name]), framework="pt") as h:
            found.append((m, h.get_tensor(name)))
    return all(torch.equal(found[0][1], t) for _, t in found[1:])
