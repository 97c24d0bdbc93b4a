"""A checkpoint's integer weight quantization (AWQ, GPTQ) read from config.json's
`quantization_config`. Torch-free: the launcher reads it (and refuses what it cannot serve,
naming it) before any rank starts; models/int_weights.py dequantizes the tensors as they load.

Formats read:
- AWQ (`quant_method` "awq", AutoAWQ's `version` "gemm"): 4-bit weights with a zero point per
  group of `group_size` input features; `qweight` [in, out / 8] and `qzeros` [groups, out / 8]
  int32, eight values a word in AWQ's interleaved order, `scales` [groups, out].
- GPTQ (`quant_method` "gptq", AutoGPTQ / GPTQModel / optimum): 4- or 8-bit weights;
  `qweight` [in * bits / 32, out] packed along the input features, `qzeros` [groups, out * bits
  / 32] packed along the outputs (stored minus one in the original `checkpoint_format`
  "gptq", as they are in "gptq_v2"), `scales` [groups, out], and with `desc_act` (act-order)
  `g_idx` [in], each input feature's group.
- compressed-tensors `pack-quantized` (llm-compressor's W4A16 / W8A16, the "...quantized.w4a16"
  checkpoints): symmetric integer weights per group or per output channel, activations left
  alone; `weight_packed` [out, in * bits / 32] int32 packed along the input features, each
  value stored plus 2^(bits - 1), `weight_scale` [out, groups], `weight_shape`, and with
  act-order `weight_g_idx` [in].
A weight is w[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o] (compressed-tensors: z the constant
2^(bits - 1)). Layers without packed weights in the checkpoint (the LM head, those ignored)
are dense as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

INT_METHODS = ("awq", "gptq")
CT_PACKED = "pack-quantized"  # compressed-tensors' format of integer weights


@dataclass(frozen=True)
class IntQuant:
    """How a checkpoint packs its integer weights (see the module's docstring). `group_size`
    0: one group over all input features; `zero_offset`: added to each stored zero point
    (GPTQ's original format stores them minus one)."""

    method: str
    bits: int
    group_size: int
    zero_offset: int = 0
    act_order: bool = False  # GPTQ's desc_act, compressed-tensors' actorder: g_idx permutes

    @property
    def per_word(self) -> int:
        """Values packed in one int32."""
        return 32 // self.bits

    @property
    def label(self) -> str:
        return "compressed-tensors" if self.method == "compressed-tensors" else self.method.upper()

    def describe(self) -> str:
        group = f"groups of {self.group_size}" if self.group_size else "one group per row"
        return f"{self.label} {self.bits}-bit, {group}"


def parse_int_quant(q: Dict[str, Any]) -> Optional[IntQuant]:
    """The integer layout of a `quantization_config`; None for another method. ValueError
    naming what is not supported."""
    method = q.get("quant_method")
    if method == "compressed-tensors" and q.get("format") == CT_PACKED:
        return _compressed_tensors(q)
    if method not in INT_METHODS:
        return None
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise ValueError(f"{method} group_size must be a positive integer or -1, got {group!r}")
    group = 0 if group == -1 else group
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (its weights are packed "
                             f"otherwise); supported: 'gemm'")
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not supported; supported: 4")
        if q.get("zero_point", True) is not True:
            raise ValueError("AWQ without zero points (zero_point false) is not supported")
        return IntQuant("awq", 4, group)
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported; supported: 4, 8")
    if q.get("dynamic"):
        raise ValueError("GPTQ's per-module `dynamic` overrides are not supported")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; supported: 'gptq', "
                         f"'gptq_v2'")
    return IntQuant("gptq", int(bits), group, 1 if fmt == "gptq" else 0,
                    bool(q.get("desc_act", False)))


def _compressed_tensors(q: Dict[str, Any]) -> IntQuant:
    """compressed-tensors' pack-quantized layout: every config group's weights alike (one
    layout for the model), symmetric integers per group or channel, no activation
    quantization."""
    specs = set()
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        where = f"compressed-tensors group {name!r}"
        if group.get("input_activations") is not None:
            raise ValueError(f"{where}: quantized input activations (W{w.get('num_bits')}A"
                             f"{group['input_activations'].get('num_bits')}) are not "
                             f"supported; supported: weight-only integers (W4A16, W8A16)")
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError(f"{where}: weights of type {w.get('type')!r} with "
                             f"{w.get('num_bits')} bits are not supported in "
                             f"{CT_PACKED}; supported: 4- and 8-bit int")
        if not w.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric integer weights are not supported")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{where}: weight strategy {strategy!r} is not supported; "
                             f"supported: group, channel")
        size = int(w.get("group_size") or 0) if strategy == "group" else 0
        specs.add((int(w["num_bits"]), size, w.get("actorder") not in (None, False)))
    if len(specs) != 1:
        raise ValueError(f"compressed-tensors {CT_PACKED} needs one weight layout for the "
                         f"model, got {sorted(specs) or 'none'}")
    bits, size, act_order = specs.pop()
    return IntQuant("compressed-tensors", bits, size, act_order=act_order)
