"""LoRA adapters in PEFT's format: read, checked, and loaded into a model's adapter slots.

An adapter directory holds `adapter_config.json` (PEFT's LoraConfig) and
`adapter_model.safetensors`, whose tensors are `base_model.model.<module>.lora_A.weight`
[rank, in] and `...lora_B.weight` [out, rank] for each adapted projection. Every adapter is
read at start-up on every rank (the same files, the same order: slot i is the i-th adapter
everywhere); what minisgl cannot apply exactly is refused there, naming it: DoRA, biases,
`modules_to_save`, per-module rank or alpha patterns, Conv1D layouts, and adapted modules
that are not the decoder's dense projections (embeddings, the LM head, experts); those of a
part of the checkpoint the model does not serve (a vision tower) are skipped. The scaling
is PEFT's: lora_alpha / rank, or lora_alpha / sqrt(rank) with `use_rslora`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
from safetensors import safe_open

from minisgl.layers.linear import RowParallelLinear
from minisgl.layers.lora import LoraSlots
from minisgl.models.decoder import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT options whose non-default values change what the adapter computes
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as its config describes it (`read_adapter` checked it)."""

    name: str
    path: Path
    rank: int
    scaling: float


def read_adapter(name: str, path: str, max_rank: int) -> LoraAdapter:
    """The adapter at directory `path`, served as `name`; ValueError naming the problem (a
    missing file, a rank above `max_rank`, an option minisgl cannot apply)."""
    root = Path(path).expanduser()
    config_file, weights = root / CONFIG_FILE, root / WEIGHTS_FILE
    for f in (config_file, weights):
        if not f.is_file():
            raise ValueError(f"LoRA adapter {name!r}: no {f.name} in {root}")
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not "
                         f"LORA")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None):
            raise ValueError(f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported "
                             f"(only {key}={default!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {key} {cfg[key]!r} is not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank!r} is not in [1, {max_rank}] "
                         f"(--max-lora-rank)")
    alpha = float(cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoraAdapter(name, root, rank, scaling)


def load_adapters(model: CausalLM, adapters: Sequence[LoraAdapter]) -> None:
    """Load adapter i into slot i of every projection it adapts (the others keep zeros): A
    and B of each checkpoint module, cut to this rank's share (layers/lora.py)."""
    for slot, adapter in enumerate(adapters):
        for module, (a, b) in _pairs(adapter).items():
            if not model.serves(f"{module}.weight"):
                continue  # a part of the checkpoint not served (a vision tower's layers)
            parts = model.projection_parts(module)
            if not parts:
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts {module}, which is "
                                 f"not one of this model's dense projections (minisgl "
                                 f"adapts q/k/v/o and gate/up/down)")
            for name, part, rows in parts:
                _load_pair(model, adapter, module, name, slot, part, a, b[rows])


def _load_pair(model: CausalLM, adapter: LoraAdapter, module: str, name: str, slot: int,
               part: int, a: torch.Tensor, b: torch.Tensor) -> None:
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
        slots.load(slot, part, a, b, adapter.scaling)
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
