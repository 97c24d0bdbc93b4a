"""Packed integer weights of the linear layers (AWQ, GPTQ, compressed-tensors W4A16 / W8A16 on
the GPU): how a layer holds them, loads its shard of them, and multiplies by them.

A packed layer holds (as buffers) the layout kernels/int_mm.py reads: `qweight` [ceil(K / P),
N] int32 (P = 32 / bits values a word along the inputs), `scales` [G, N] float32, `zeros` [G,
N] float16 and `g_idx` [K] int32, each input's group among this layer's G. The checkpoint's own packing
(AWQ's interleaved words, GPTQ's minus-one zero points, compressed-tensors' offset values) is
undone by its source (models/int_weights.IntWeightSource.int_block), which hands over plain
integers; the layer packs them again its one way, so every format runs the same kernel.

Sharding: a column-parallel layer takes its rows' outputs of every part (each part's own
scales and zeros; their inputs, and so their groups, are the same: act-order checkpoints give
the parts of one fused layer one permutation, which models/int_plan.py checks before choosing
packing); a row-parallel layer takes its inputs and only the groups they use (renumbered from
0). The weights stay packed in memory: a 4-bit model takes about a quarter of its 16-bit
bytes. On the CPU layers are not packed: the checkpoint is dequantized as it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from minisgl.distributed import Shard
from minisgl.layers.source import RowsOf, TensorSource, copy_into


@dataclass(frozen=True)
class PackedSpec:
    """A layer's packed integer weights: `bits` a value (4 or 8), groups of `group_size`
    inputs (0: one group), `act_order`: the checkpoint assigns inputs to groups in its own
    order (GPTQ's desc_act), so a rank's inputs may use any group."""

    bits: int
    group_size: int = 0
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.group_size < 0:
            raise ValueError(f"packed integer weights have 4 or 8 bits and groups of a "
                             f"positive size (0: one), got {self.bits} and {self.group_size}")

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int, inputs: Shard) -> int:
        """How many groups of scales a layer holds for its `inputs` of the weight's
        `in_features`: all of them with act-order, else those its inputs touch."""
        if not self.group_size:
            return 1
        total = -(-in_features // self.group_size)
        if self.act_order:
            return total
        first, last = inputs.start // self.group_size, -(-inputs.stop // self.group_size)
        return min(total, max(1, last - first))


class IntBlock(NamedTuple):
    """A slice of a quantized checkpoint weight as plain integers: w[o, i] = (values[i, o] -
    zeros[groups[i], o]) * scales[groups[i], o]."""

    values: torch.Tensor  # [inputs, outputs] int32, 0 <= v < 2^bits
    scales: torch.Tensor  # [groups, outputs] float32: every group of the weight
    zeros: torch.Tensor  # [groups, outputs] float32 (whole numbers)
    groups: torch.Tensor  # [inputs] int64


@runtime_checkable
class IntSource(Protocol):
    """A checkpoint weight held as integers (models/int_weights.IntWeightSource)."""

    def int_block(self, dim: Optional[int], start: int, stop: int) -> IntBlock: ...


class PackedWeight(NamedTuple):
    """What a packed projection multiplies by (kernels/int_mm.int_mm's operands)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    spec: PackedSpec
    group_run: int = 0  # `group_run(g_idx)`: g_idx[i] == i // group_run (0: read g_idx)
    arrivals: Optional[torch.Tensor] = None  # int_mm's counters, the layer's own


def make_buffers(module: nn.Module, spec: PackedSpec, out_features: int, inputs: Shard,
                 in_features: int) -> None:
    """Give a linear layer of `out_features` outputs and the `inputs` of a weight of
    `in_features` its packed tensors, as buffers: the checkpoint's one `weight` (an IntSource)
    fills them all, and the loader counts that weight as the layer's."""
    groups = spec.groups(in_features, inputs)
    module.register_buffer("qweight", torch.zeros(-(-inputs.size // spec.per_word),
                                                  out_features, dtype=torch.int32))
    module.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float32))
    module.register_buffer("zeros", torch.zeros(groups, out_features, dtype=torch.float16))
    module.register_buffer("g_idx", torch.zeros(inputs.size, dtype=torch.int32))
    # The one-row product's counters (int_mm's `arrivals`): state of the kernel, not the
    # model, so no checkpoint holds them. Packed layers exist only where int_mm runs.
    from minisgl.kernels.int_mm import arrival_slots
    module.register_buffer("arrivals", torch.zeros(arrival_slots(out_features),
                                                   dtype=torch.int32), persistent=False)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integers in [0, 2^bits) -> [ceil(K / P), N] int32 words, input k at bits
    (k % P) * bits of word k // P."""
    per_word = 32 // bits
    k, n = values.shape
    padded = torch.zeros(-(-k // per_word) * per_word, n, dtype=torch.int64,
                         device=values.device)
    padded[:k] = values.to(torch.int64)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (padded.view(-1, per_word, n) << shifts.view(1, -1, 1)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _int_block(src: TensorSource, dim: int, start: int, stop: int, what: str) -> IntBlock:
    """The integers of a slice of `src`: an IntSource, or rows of one (a checkpoint's fused
    projection, layers/source.RowsOf)."""
    if isinstance(src, RowsOf) and isinstance(src.src, IntSource):
        if dim == 0:
            return src.src.int_block(0, src.start + start, src.start + stop)
        raise ValueError(f"{what}: a fused checkpoint projection's inputs are not split")
    if not isinstance(src, IntSource):
        raise ValueError(f"{what}: the layer holds packed integer weights, but the checkpoint "
                         f"gives a dense tensor {tuple(src.shape)}")
    return src.int_block(dim, start, stop)


class PackedLayer(Protocol):
    """A linear layer holding packed weights (`make_buffers` gave it its tensors)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    groups_loaded: bool  # g_idx holds a loaded part's groups (False once built)
    group_run: int  # group_run(g_idx) of what was loaded (0 once built)


def load_columns(layer: PackedLayer, spec: PackedSpec, src: TensorSource, start: int,
                 stop: int, offset: int, what: str) -> None:
    """A column-parallel layer's share of one part: outputs [start, stop) of the checkpoint
    weight into the layer's outputs from `offset`. The first part loaded sets the inputs'
    groups, which the others must share (ValueError naming the part where they do not)."""
    block = _int_block(src, 0, start, stop, what)
    cols = slice(offset, offset + stop - start)
    groups = block.scales.shape[0]
    if groups > layer.scales.shape[0]:
        raise ValueError(f"{what}: {groups} groups of scales, the layer holds "
                         f"{layer.scales.shape[0]}")
    copy_into(layer.qweight.data[:, cols], pack(block.values, spec.bits), what)
    copy_into(layer.scales.data[:groups, cols], block.scales, f"{what} (scales)")
    copy_into(layer.zeros.data[:groups, cols], block.zeros, f"{what} (zeros)")
    g_idx = block.groups.to(torch.int32).to(layer.g_idx.device)
    if not layer.groups_loaded:
        layer.g_idx.data.copy_(g_idx)
        layer.groups_loaded = True
        layer.group_run = group_run(block.groups)
    elif not torch.equal(layer.g_idx.data, g_idx):
        raise ValueError(f"{what}: its inputs' groups (act-order g_idx) differ from the other "
                         f"parts' of this fused layer, which share one")


def load_rows(layer: PackedLayer, spec: PackedSpec, src: TensorSource, start: int, stop: int,
              what: str) -> None:
    """A row-parallel layer's share: inputs [start, stop) of the checkpoint weight, and the
    groups those inputs use, renumbered from the first."""
    block = _int_block(src, 1, start, stop, what)
    lo = int(block.groups.min()) if block.groups.numel() else 0
    hi = int(block.groups.max()) + 1 if block.groups.numel() else 0
    if hi - lo > layer.scales.shape[0]:
        raise ValueError(f"{what}: inputs [{start}, {stop}) use {hi - lo} groups of scales, "
                         f"the layer holds {layer.scales.shape[0]}")
    copy_into(layer.qweight.data, pack(block.values, spec.bits), what)
    copy_into(layer.scales.data[:hi - lo], block.scales[lo:hi], f"{what} (scales)")
    copy_into(layer.zeros.data[:hi - lo], block.zeros[lo:hi], f"{what} (zeros)")
    layer.g_idx.data.copy_((block.groups - lo).to(torch.int32))
    layer.groups_loaded = True
    layer.group_run = group_run(block.groups - lo)


def group_run(groups: torch.Tensor) -> int:
    """R where groups[i] == i // R for every input i, R a power of two of at least 16 (a
    run of R inputs a group, in order: the kernel then reads one row of scales a tile); 0
    where there is no such R (act-order, a shard starting inside a group, odd sizes)."""
    k = groups.numel()
    if k == 0:
        return 0
    groups = groups.to(torch.int64).cpu()
    ones = torch.nonzero(groups == 1)
    run = int(ones[0, 0]) if ones.numel() else 1 << max(4, (k - 1).bit_length())
    if run < 16 or run & (run - 1):
        return 0
    return run if torch.equal(groups, torch.arange(k) // run) else 0


def unpack(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """`pack`'s inverse: [ceil(K / P), N] words -> [K, N] int32 values."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    values = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, qweight.shape[1])[:k]


def dequantize(layer: PackedLayer, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [N, K] in `dtype` of packed tensors (computed in float32, rounded
    once, as kernels/int_mm.py computes it)."""
    values = unpack(layer.qweight, bits, layer.g_idx.shape[0]).float()
    groups = layer.g_idx.long()
    return ((values - layer.zeros.float()[groups]) * layer.scales[groups]).t().to(dtype)


@torch.no_grad()
def fill_random(layer: PackedLayer, spec: PackedSpec, gen: torch.Generator, std: float) -> None:
    """Random packed weights of about normal(0, `std`) values: uniform integers, zero points
    at the middle, every input in group 0 with a scale that gives that spread."""
    top = 1 << spec.bits
    values = torch.randint(0, top, (layer.g_idx.shape[0], layer.qweight.shape[1]),
                           generator=gen, device=layer.qweight.device)
    layer.qweight.data.copy_(pack(values, spec.bits))
    layer.zeros.data.fill_(top // 2)
    layer.scales.data.fill_(std * (12.0 ** 0.5) / top)  # uniform over top steps: that std
    layer.g_idx.data.zero_()
    layer.groups_loaded = True
    layer.group_run = group_run(torch.zeros(layer.g_idx.shape[0], dtype=torch.int64))


def linear(x: torch.Tensor, w: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x W^T + b by the packed weight (kernels/int_mm.py), in x's dtype."""
    from minisgl.kernels.int_mm import int_mm
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    out = int_mm(rows, w.qweight, w.scales, w.zeros, w.g_idx, w.spec.bits, bias,
                 group_size=w.group_run, arrivals=w.arrivals)
    return out.view(*x.shape[:-1], out.shape[-1])
