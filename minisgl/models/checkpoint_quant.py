"""A checkpoint's FP8 layout: config.json's `quantization_config` read into rules.

Torch-free: the launcher reads a model's config (and refuses a format it does not know, naming
it) before any rank starts. models/quantization.py combines these rules with the device into
the layers' specs.

Formats read:
- compressed-tensors (`quant_method` "compressed-tensors", `format` "float-quantized" or
  "naive-quantized"): `config_groups` whose `weights` are 8-bit floats per tensor, per channel
  or per block, and whose `input_activations` are static per tensor (`input_scale` tensors) or
  dynamic (taken per token; none: also per token on CUDA), each group applying to the layers
  its `targets` name ("Linear", a name, or "re:" a regular expression); `ignore` lists the
  layers left dense.
- Hugging Face's and vLLM's `fp8` (`quant_method` "fp8"): `weight_block_size` [Bn, Bk] with
  `weight_scale_inv` per block and dynamic activations (Qwen3's FP8 checkpoints), or without
  blocks one `weight_scale` per tensor and `activation_scheme` static (`input_scale`) or
  dynamic; `modules_to_not_convert` (or `ignored_layers`) left dense.
Anything else is refused, naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from minisgl.models.int_quant import CT_PACKED, INT_METHODS

ONLINE = "fp8"  # the one quantization done as a checkpoint loads
# vLLM's names for the checkpoint methods read ("..._marlin" name its kernels for the same
# checkpoints), each to the method it names: as the `quantization` setting they state what the
# checkpoint is, and are checked against its config.json
CHECKPOINT_NAMES: Dict[str, str] = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq",
                                    "gptq_marlin": "gptq",
                                    "compressed-tensors": "compressed-tensors"}
QUANTIZATIONS = (ONLINE, *CHECKPOINT_NAMES)  # what the `quantization` setting takes


def online(setting: Optional[str]) -> Optional[str]:
    """The quantization a `quantization` setting asks to be done at load: ONLINE, or None
    (unset, or a checkpoint method's name, which only states what the checkpoint is)."""
    return setting if setting == ONLINE else None


_CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class CheckpointFp8:
    """How a checkpoint stores one layer in FP8: `block` (Bn, Bk), the weight-scale block (None:
    a scale per output row or per tensor); `static_input`, a per-tensor activation scale given
    (`input_scale`), else activations scaled per token."""

    block: Optional[Tuple[int, int]] = None
    static_input: bool = False

    def __post_init__(self) -> None:
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"an FP8 weight block is two positive sizes, got {self.block}")


@dataclass(frozen=True)
class QuantGroup:
    """A compressed-tensors config group: the layers it targets and their format."""

    targets: Tuple[str, ...]
    spec: CheckpointFp8


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's FP8 layout: the method, its groups (first match wins), the layers left
    dense."""

    method: str
    groups: Tuple[QuantGroup, ...]
    ignore: Tuple[str, ...] = ()

    def spec_for(self, module: str) -> Optional[CheckpointFp8]:
        """The format of layer `module` (a checkpoint name, e.g. model.layers.0.mlp.up_proj);
        None where it is dense."""
        if any(_matches(entry, module) for entry in self.ignore):
            return None
        for group in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in group.targets):
                return group.spec
        return None


def _matches(entry: str, module: str) -> bool:
    """A target or ignore entry names `module`: "re:" a regular expression matched from the
    start (compressed-tensors), the name itself, or a module above it (Hugging Face's
    `modules_to_not_convert`: "lm_head", "model.layers.3")."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module or f"{entry}." in f"{module}."


def parse_quantization(cfg: Dict[str, Any]) -> Optional[CheckpointQuant]:
    """A config.json's `quantization_config` (or compressed-tensors' older
    `compression_config`) read; None where there is none. ValueError naming what is not
    supported."""
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _hf_fp8(q)
    if method in INT_METHODS:  # integer weights: models/int_quant.py
        return None
    raise ValueError(f"config.json's quantization_config has quant_method {method!r}, which "
                     f"minisgl does not read; supported: 'compressed-tensors' (FP8 "
                     f"float-quantized), 'fp8', 'awq' and 'gptq'")


def _compressed_tensors(q: Dict[str, Any]) -> Optional[CheckpointQuant]:
    fmt = q.get("format")
    if fmt == CT_PACKED:  # integer weights: models/int_quant.py
        return None
    if fmt not in _CT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: "
                         f"{', '.join(_CT_FORMATS)} (FP8 weights), {CT_PACKED} (integers)")
    groups = []
    for name, group in (q.get("config_groups") or {}).items():
        if group.get("format", fmt) not in _CT_FORMATS:
            raise ValueError(f"compressed-tensors group {name!r} has format "
                             f"{group.get('format')!r}; supported: {', '.join(_CT_FORMATS)}")
        groups.append(QuantGroup(tuple(group.get("targets") or ()),
                                 _ct_spec(name, group.get("weights") or {},
                                          group.get("input_activations"))))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    return CheckpointQuant("compressed-tensors", tuple(groups), tuple(q.get("ignore") or ()))


def _ct_spec(group: str, weights: Dict[str, Any], acts: Optional[Dict[str, Any]]) -> CheckpointFp8:
    where = f"compressed-tensors group {group!r}"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"{where}: weights of type {weights.get('type')!r} with "
                         f"{weights.get('num_bits')} bits are not supported; supported: 8-bit "
                         f"float (FP8)")
    if weights.get("symmetric") is False or weights.get("dynamic"):
        raise ValueError(f"{where}: FP8 weights must be symmetric and static")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2):
            raise ValueError(f"{where}: block weights need a block_structure [Bn, Bk], got "
                             f"{structure!r}")
        block = (int(structure[0]), int(structure[1]))
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported; supported: "
                         f"tensor, channel, block")
    static = False
    if acts is not None:
        if acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise ValueError(f"{where}: input activations of type {acts.get('type')!r} with "
                             f"{acts.get('num_bits')} bits are not supported (8-bit float only)")
        static = not acts.get("dynamic", False)
        if static and acts.get("strategy") != "tensor":
            raise ValueError(f"{where}: static input activations must be per tensor, got "
                             f"strategy {acts.get('strategy')!r}")
        if static and block is not None:
            raise ValueError(f"{where}: block weights take dynamic activations only")
        group_size = acts.get("group_size")
        if block is not None and group_size not in (None, block[1]):
            raise ValueError(f"{where}: activations of block weights are scaled per 1 x "
                             f"{block[1]} group (the block's width), got group_size "
                             f"{group_size}")
    return CheckpointFp8(block=block, static_input=static)


def _hf_fp8(q: Dict[str, Any]) -> CheckpointQuant:
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 quantization_config fmt {q.get('fmt')!r} is not supported "
                         f"(e4m3 only)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported; supported: "
                         f"dynamic, static")
    size = q.get("weight_block_size")
    block = None
    if size is not None:
        if not (isinstance(size, list) and len(size) == 2):
            raise ValueError(f"fp8 weight_block_size must be [Bn, Bk], got {size!r}")
        block = (int(size[0]), int(size[1]))
        if scheme != "dynamic":
            raise ValueError("fp8 with weight_block_size takes activation_scheme 'dynamic' only")
    ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    spec = CheckpointFp8(block=block, static_input=scheme == "static")
    return CheckpointQuant("fp8", (QuantGroup(("Linear",), spec),), ignore)
