"""AWQ, GPTQ and compressed-tensors integer weights (models/int_quant.py) dequantized as they
load: each quantized layer's parts (AWQ / GPTQ: `qweight`, `qzeros`, `scales`, GPTQ's
`g_idx`; compressed-tensors: `weight_packed`, `weight_scale`, `weight_shape`,
`weight_g_idx`) become one dense `weight` source that dequantizes only the slice a rank reads
(its rows or columns, widened to whole packed words), in float32, as
w[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]. A dense layer reads it so (the CPU, and layers
models/int_plan.py leaves dense); a packed layer (the GPU) reads the same slice as integers
(`int_block`) and packs them again (layers/packed.py).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

from minisgl.layers.packed import IntBlock
from minisgl.layers.source import TensorSource
from minisgl.models.int_quant import IntQuant

_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape",
                                 "weight_g_idx")}
_REQUIRED = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
             "compressed-tensors": ("weight_packed", "weight_scale")}
# AWQ packs the 8 outputs of a word interleaved: output j of a word is value _AWQ_ORDER[j]
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def dense_int_weights(tensors: Iterator[Tuple[str, TensorSource]], spec: IntQuant
                      ) -> Iterator[Tuple[str, TensorSource]]:
    """The checkpoint's tensors with each quantized layer's parts replaced by its dense
    `weight` (an `IntWeightSource`, after every other tensor: a layer's parts may lie in
    several files); ValueError naming a layer whose parts are incomplete or do not fit."""
    layers: Dict[str, Dict[str, TensorSource]] = {}
    for name, src in tensors:
        prefix, _, part = name.rpartition(".")
        if part in _PARTS[spec.method]:
            layers.setdefault(prefix, {})[part] = src
        else:
            yield name, src
    for prefix, parts in layers.items():
        yield f"{prefix}.weight", IntWeightSource(prefix, parts, spec)


def _unpack(packed: torch.Tensor, bits: int, along_rows: bool,
            order: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """The values of int32 words `packed` [R, C]: [R * n, C] (packed along the rows) or
    [R, C * n] (along the columns), n = 32 / bits, the first value in the lowest bits (or in
    `order`: position j of a word holds value order[j])."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    words = packed.to(torch.int32)
    if along_rows:
        vals = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [R, n, C]
        return vals.reshape(-1, words.shape[1])
    vals = (words.unsqueeze(-1) >> shifts) & mask  # [R, C, n]
    if order is not None:
        vals = vals[..., list(order)]
    return vals.reshape(words.shape[0], words.shape[1] * per_word)


class IntWeightSource:
    """The dense weight [out, in] of one quantized layer (see the module's docstring)."""

    def __init__(self, name: str, parts: Dict[str, TensorSource], spec: IntQuant) -> None:
        missing = [p for p in _REQUIRED[spec.method] if p not in parts]
        if missing:
            raise ValueError(f"{spec.label} layer {name} lacks {', '.join(missing)} in the "
                             f"checkpoint")
        self.name, self.parts, self.spec = name, parts, spec
        self.ct = spec.method == "compressed-tensors"
        n = spec.per_word
        if self.ct:  # [out, in / n] and [out, groups]
            q = parts["weight_packed"].shape
            shape = parts.get("weight_shape")
            self.out_features, self.in_features = ((int(d) for d in shape.read().tolist())
                                                   if shape is not None else (q[0], q[1] * n))
            s = tuple(reversed(parts["weight_scale"].shape))
        else:
            q, s = parts["qweight"].shape, parts["scales"].shape
            awq = spec.method == "awq"
            self.in_features = q[0] if awq else q[0] * n
            self.out_features = q[1] * n if awq else q[1]
        groups = -(-self.in_features // spec.group_size) if spec.group_size else 1
        g_idx = parts.get("weight_g_idx" if self.ct else "g_idx")
        if len(s) != 2 or s[1] != self.out_features or (s[0] != groups and g_idx is None):
            raise ValueError(f"{spec.describe()} layer {name}: packed weight {tuple(q)} and "
                             f"scales {tuple(s)} do not fit together ({self.in_features} "
                             f"inputs, {self.out_features} outputs, {groups} groups expected)")
        if g_idx is not None and tuple(g_idx.shape) != (self.in_features,):
            raise ValueError(f"{spec.label} layer {name}: g_idx {tuple(g_idx.shape)} for "
                             f"{self.in_features} inputs")
        self.g_idx = g_idx

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.out_features, self.in_features)

    def read(self, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Rows (dim 0: outputs) or columns (dim 1: inputs) [start, stop) of the weight, or
        all of it (dim None), dequantized in float32."""
        q, scales, zeros, groups = self.int_block(dim, start, stop)
        return ((q.float() - zeros[groups]) * scales[groups]).t().contiguous()

    def int_block(self, dim: Optional[int], start: int, stop: int) -> IntBlock:
        """The same slice as integers, with every group's scales and zero points of its
        outputs and each input's group (layers/packed.py packs them again)."""
        outs = (0, self.out_features) if dim != 0 else (start, stop)
        ins = (0, self.in_features) if dim != 1 else (start, stop)
        if dim not in (None, 0, 1):
            raise ValueError(f"cannot slice {self.name}'s weight along dim {dim}")
        q = self._values(outs, ins)  # [inputs, outputs]
        if self.ct:  # symmetric: every value stored plus 2^(bits - 1)
            scales = _block(self.parts["weight_scale"], outs,
                            (0, self.parts["weight_scale"].shape[1])).float().t()
            zeros = torch.full_like(scales, float(1 << (self.spec.bits - 1)))
        else:
            scales = self.parts["scales"].read(1, *outs).float()
            zeros = self._zeros(outs).float() + self.spec.zero_offset
        return IntBlock(q.to(torch.int32), scales.contiguous(), zeros, self._groups(ins))

    def _values(self, outs: Tuple[int, int], ins: Tuple[int, int]) -> torch.Tensor:
        """The integer values of inputs x outputs, [inputs, outputs]."""
        n, bits = self.spec.per_word, self.spec.bits
        if self.ct:  # [out, in / n]: the outputs, whole words of inputs
            lo, hi = ins[0] // n, -(-ins[1] // n)
            vals = _unpack(_block(self.parts["weight_packed"], outs, (lo, hi)), bits,
                           along_rows=False)
            return vals[:, ins[0] - lo * n:ins[1] - lo * n].t()
        if self.spec.method == "awq":  # [in, out / n]: the inputs, whole words of outputs
            lo, hi = outs[0] // n, -(-outs[1] // n)
            words = _block(self.parts["qweight"], ins, (lo, hi))
            vals = _unpack(words, bits, along_rows=False, order=_AWQ_ORDER)
            return vals[:, outs[0] - lo * n:outs[1] - lo * n]
        lo, hi = ins[0] // n, -(-ins[1] // n)  # GPTQ [in / n, out]: whole words of inputs
        vals = _unpack(_block(self.parts["qweight"], (lo, hi), outs), bits, along_rows=True)
        return vals[ins[0] - lo * n:ins[1] - lo * n]

    def _zeros(self, outs: Tuple[int, int]) -> torch.Tensor:
        """Every group's zero points of outputs `outs`, [groups, outputs]."""
        n = self.spec.per_word
        lo, hi = outs[0] // n, -(-outs[1] // n)
        words = _block(self.parts["qzeros"], (0, self.parts["qzeros"].shape[0]), (lo, hi))
        order = _AWQ_ORDER if self.spec.method == "awq" else None
        vals = _unpack(words, self.spec.bits, along_rows=False, order=order)
        return vals[:, outs[0] - lo * n:outs[1] - lo * n]

    def _groups(self, ins: Tuple[int, int]) -> torch.Tensor:
        """Each input's group, for inputs `ins`."""
        if self.g_idx is not None:
            return self.g_idx.read(0, *ins).to(torch.int64)
        size = self.spec.group_size or self.in_features
        return torch.arange(ins[0], ins[1]) // size


def _block(src: TensorSource, rows: Tuple[int, int], cols: Tuple[int, int]) -> torch.Tensor:
    """Rows x columns of a checkpoint tensor, reading only what is needed along the one
    dimension that is cut (a rank's read cuts one)."""
    if cols == (0, src.shape[1]):
        return src.read() if rows == (0, src.shape[0]) else src.read(0, *rows)
    block = src.read(1, *cols)
    return block if rows == (0, src.shape[0]) else block[rows[0]:rows[1]]
