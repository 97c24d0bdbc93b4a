"""LoRA adapters in PEFT's format loaded into a model's adapter slots (their configs are read
and checked by lora_config.py).

An adapter's `adapter_model.safetensors` holds `base_model.model.<module>.lora_A.weight`
[rank, in] and `...lora_B.weight` [out, rank] for each adapted projection. Every rank loads
the same adapter into the same slot (at start-up slot i holds lora_modules' i-th; at run
time the scheduler picks the slot, alike on every rank); adapted modules that are not the
decoder's projections (embeddings, the LM head, a MoE layer's router or routed experts) are
refused, naming them; those of a part of the checkpoint the model does not serve (a vision
tower) are skipped.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from safetensors import safe_open

from minisgl.layers.linear import RowParallelLinear
from minisgl.layers.lora import LoraSlots
from minisgl.models.decoder import CausalLM
from minisgl.models.lora_config import WEIGHTS_FILE, LoraAdapter

_PREFIX = "base_model.model."  # PEFT's tensor names start so


def load_adapters(model: CausalLM, adapters: Sequence[LoraAdapter]) -> None:
    """Load adapter i into slot i (start-up: every slot still zero)."""
    for slot, adapter in enumerate(adapters):
        load_adapter(model, slot, adapter)


def load_adapter(model: CausalLM, slot: int, adapter: LoraAdapter) -> None:
    """Load `adapter` into `slot` of every projection it adapts, after zeroing the slot
    everywhere (what a former adapter left must not stay where this one adapts less): A and B
    of each checkpoint module, cut to this rank's share (layers/lora.py). On an error (a
    ValueError naming it, or the files' own) the slot is left zero. The caller sees that no
    batch in flight uses the slot; the writes go in stream order after launched work."""
    pairs = _pairs(adapter)  # read (and checked) before the slot changes
    clear_slot(model, slot)
    try:
        for module, (a, b) in pairs.items():
            if not model.serves(f"{module}.weight"):
                continue  # a part of the checkpoint not served (a vision tower's layers)
            parts = model.projection_parts(module)
            if not parts:
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts {module}, which is "
                                 f"not one of this model's projections that take adapters "
                                 f"(minisgl adapts q/k/v/o and the dense MLP's or shared "
                                 f"expert's gate/up/down, not a router or routed experts)")
            for name, part, rows in parts:
                _load_pair(model, adapter, module, name, slot, part, a, b[rows])
    except BaseException:
        clear_slot(model, slot)
        raise


def clear_slot(model: CausalLM, slot: int) -> None:
    """Zero `slot` of every projection's LoRA buffers (no delta from it anywhere)."""
    for module in model.modules():
        if isinstance(module, LoraSlots):
            module.clear(slot)


def _load_pair(model: CausalLM, adapter: LoraAdapter, module: str, name: str, slot: int,
               part: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """Adapter `slot`'s pair of checkpoint module `module` into output `part` of our layer
    `name`: A cut to this rank's columns where the layer is row-parallel (B's rows are cut by
    the slots); ValueError naming the shapes that do not fit."""
    layer = model.get_submodule(name)
    slots = getattr(layer, "lora", None)
    if not isinstance(slots, LoraSlots):
        raise ValueError(f"{name} holds no LoRA slots (was the model built with LoRA?)")
    if a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
        raise ValueError(f"LoRA adapter {adapter.name!r}: {module} has A {tuple(a.shape)} and "
                         f"B {tuple(b.shape)}, not rank {adapter.rank} as its config says")
    if isinstance(layer, RowParallelLinear):
        full = layer.shard.size * layer.tp
        if a.shape[1] != full:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {module}'s A has {a.shape[1]} "
                             f"inputs, the layer {full}")
        a = a[:, layer.shard.start:layer.shard.stop]
    try:
        slots.load(slot, part, a, b, adapter.scaling * model.output_multiplier(name))
    except ValueError as e:
        raise ValueError(f"LoRA adapter {adapter.name!r}, {module}: {e}") from None


def _pairs(adapter: LoraAdapter) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module name -> (A, B) of the adapter's tensors; ValueError naming a tensor
    that is not half of a pair."""
    found: Dict[str, Dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter.path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            module, half = _split(adapter, key)
            found.setdefault(module, {})[half] = f.get_tensor(key)
    pairs: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for module, halves in found.items():
        if set(halves) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {module} has {sorted(halves)}, "
                             f"not both lora_A and lora_B")
        pairs[module] = (halves["lora_A"], halves["lora_B"])
    if not pairs:
        raise ValueError(f"LoRA adapter {adapter.name!r}: {WEIGHTS_FILE} holds no LoRA pairs")
    return pairs


def _split(adapter: LoraAdapter, key: str) -> Tuple[str, str]:
    """(checkpoint module, "lora_A" or "lora_B") of tensor `key`
    (base_model.model.<module>.lora_A[.default].weight)."""
    parts: List[str] = key.removeprefix(_PREFIX).split(".")
    if parts[-1] == "weight":
        parts = parts[:-1]
    if parts and parts[-1] == "default":  # an adapter name PEFT may leave in
        parts = parts[:-1]
    if len(parts) < 2 or parts[-1] not in ("lora_A", "lora_B"):
        raise ValueError(f"LoRA adapter {adapter.name!r}: tensor {key} is not a LoRA A or B "
                         f"weight (embedding adapters and biases are not supported)")
    return ".".join(parts[:-1]), parts[-1]
