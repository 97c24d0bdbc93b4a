"""The routed experts' weights of a mixture-of-experts layer: their tensor-parallel slices,
their checkpoint names, FP8 experts' scales and packed experts' integers.

Each rank holds a 1/tp slice of every expert's intermediate features: w13 [E, 2 * I/tp, H]
(gate rows, then up rows, split by output rows as ColumnParallelLinear splits them) and w2
[E, H, I/tp] (split by input columns as RowParallelLinear). With expert parallelism each rank
holds instead 1/tp of the experts, whole: experts [r E/tp, (r + 1) E/tp) of rank r (`owned`),
renumbered from 0, w13 [E/tp, 2I, H] and w2 [E/tp, H, I]; the formats below apply alike, with
the rank's experts for E and the whole I for I/tp.

With an `Fp8Spec` the weights are float8_e4m3fn and carry scales laid out for the fused kernels
(kernels/types.ExpertScales): w13_weight_scale [E, 2, I/tp] per output row (gate's, then up's)
or [E, 2, ceil(I/tp / Bn), ceil(H / Bk)] per block; w2_weight_scale [E, H] or [E, ceil(H / Bn),
ceil(I/tp / Bk)]. A checkpoint's per-tensor scale is written to its tensor's rows. With static
activations, w13_input_scale and w2_input_scale [1] hold the largest of the experts' scales (as
vLLM takes them: one quantization of a token serves every expert it is routed to). Online
quantization takes each slice per output row as it loads. Where the spec is weight-only (the
CPU) `dequantize_fp8` turns them back into dense weights once loaded.

With a `PackedSpec` (AWQ / GPTQ experts on the GPU) they hold, per GEMM, each expert's packed
integers in layers/packed.py's layout (kernels/types.PackedGemm), each rank its slice: w13's
columns (gate's, then up's) and w2's inputs with the groups they use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from minisgl.distributed import DistributedInfo, Shard
from minisgl.kernels.types import FP8, ExpertScales, PackedGemm
from minisgl.layers import fp8, packed
from minisgl.layers.fp8 import Fp8Spec, Part
from minisgl.layers.packed import PackedSpec
from minisgl.layers.readback import Piece, not_readable
from minisgl.layers.source import TensorSource, copy_into
from minisgl.layers.weight_format import WeightFormat

# checkpoint name of an expert's projection -> (our weight, its place in the expert's shards)
_EXPERT_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
# checkpoint parameter of an expert's projection -> the suffix of ours (w13_weight_scale, ...)
_EXPERT_PARAMS = {"weight": "", "weight_scale": "_weight_scale", "input_scale": "_input_scale"}


class ExpertsShape(NamedTuple):
    """The routed experts' whole sizes (the layer holds its rank's slice)."""

    num_experts: int
    hidden: int
    intermediate: int  # of one expert


def expert_param(path: List[str], param: str) -> Optional[Tuple[str, str, int]]:
    """(module, parameter, shard) of a checkpoint tensor `path`.`param` of one expert,
    `...experts.N.{gate_proj,up_proj,down_proj}.{weight,weight_scale,input_scale}` (Hugging
    Face's per-expert names); None for any other name."""
    if len(path) < 3 or path[-3] != "experts" or not path[-2].isdigit():
        return None
    if path[-1] not in _EXPERT_PROJ or param not in _EXPERT_PARAMS:
        return None
    ours, half = _EXPERT_PROJ[path[-1]]
    expert = int(path[-2])
    shard = 2 * expert + half if ours == "w13" else expert
    return ".".join(path[:-2]), ours + _EXPERT_PARAMS[param], shard


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


@dataclass
class _PackedView:
    """One expert's packed tensors for one GEMM (views of the experts' buffers), as
    layers/packed.py loads, fills and dequantizes a linear layer's."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    groups_loaded: bool = False
    group_run: int = 0


def _common_run(runs: List[int]) -> int:
    """The group run every expert shares (layers/packed.group_run), else 0."""
    return runs[0] if runs and all(r == runs[0] for r in runs) else 0


class Experts(nn.Module):
    """This rank's slice of every routed expert (see the module's docstring for the layout).
    `fmt.fp8`: FP8 weights in that format (`fp8` is None once dense: after a weight-only
    `dequantize_fp8`); `fmt.packed`: the checkpoint's integers kept packed (the GPU; see
    `packed_gemms`); neither: dense. `expert_parallel`: this rank holds its 1/tp of the
    experts whole (`owned`, global expert ids) instead of a slice of each.
    ValueError naming the numbers where a tp split would cut the spec's blocks."""

    w13_weight_scale: torch.Tensor
    w2_weight_scale: torch.Tensor
    w13_input_scale: torch.Tensor
    w2_input_scale: torch.Tensor
    # packed (`_make_packed`): per GEMM (13, 2) qweight, scales, zeros, g_idx
    q13: torch.Tensor
    s13: torch.Tensor
    z13: torch.Tensor
    g13: torch.Tensor
    q2: torch.Tensor
    s2: torch.Tensor
    z2: torch.Tensor
    g2: torch.Tensor

    def __init__(self, shape: ExpertsShape, info: DistributedInfo,
                 fmt: WeightFormat = WeightFormat(), expert_parallel: bool = False) -> None:
        super().__init__()
        e, h, i = shape
        if expert_parallel:
            self.owned = info.shard(e, "routed experts (expert parallelism)")
            self.shard, split = Shard(0, i), 1
        else:
            self.owned = Shard(0, e)
            self.shard, split = info.shard(i, "expert intermediate features"), info.size
        self.intermediate = i
        self.fp8 = fp8_spec = fmt.fp8
        self.packed = fmt.packed
        local = self.shard.size
        held = ExpertsShape(self.owned.size, h, i)
        if fmt.packed is not None:
            self._make_packed(fmt.packed, held)
            return
        dtype = FP8 if fp8_spec is not None else None
        self.w13 = _param(torch.empty(held.num_experts, 2 * local, h, dtype=dtype))
        self.w2 = _param(torch.empty(held.num_experts, h, local, dtype=dtype))
        if fp8_spec is not None:
            self._make_scales(fp8_spec, held, split)

    @property
    def checkpoint_params(self) -> Tuple[str, ...]:
        """What the loader fills (packed buffers take the checkpoint's w13 / w2 tensors)."""
        return ("w13", "w2")

    def _make_packed(self, spec: PackedSpec, shape: ExpertsShape) -> None:
        """Buffers per GEMM (kernels/types.PackedGemm) of the `shape.num_experts` experts held:
        w13's columns the gate's, then up's."""
        e, h, i = shape
        local = self.shard.size
        for name, k, n, groups in (("13", h, 2 * local, spec.groups(h, Shard(0, h))),
                                   ("2", local, h, spec.groups(i, self.shard))):
            self.register_buffer("q" + name, torch.zeros(e, -(-k // spec.per_word), n,
                                                         dtype=torch.int32))
            self.register_buffer("s" + name, torch.zeros(e, groups, n, dtype=torch.float32))
            self.register_buffer("z" + name, torch.zeros(e, groups, n, dtype=torch.float16))
            self.register_buffer("g" + name, torch.zeros(e, k, dtype=torch.int32))
        self.loaded13 = [False] * e  # each expert's w13 groups set by its first part
        # each expert's layers/packed.group_run per GEMM, as loaded (0: not loaded)
        self.runs: Dict[str, List[int]] = {"13": [0] * e, "2": [0] * e}

    def _view(self, gemm: str, expert: int) -> _PackedView:
        q, s, z, g = (getattr(self, t + gemm)[expert] for t in "qszg")
        return _PackedView(q, s, z, g, gemm == "13" and self.loaded13[expert],
                           self.runs[gemm][expert])

    def _keep(self, gemm: str, expert: int, view: _PackedView) -> None:
        """What loading or filling `view` learnt of the expert's groups."""
        self.runs[gemm][expert] = view.group_run
        if gemm == "13":
            self.loaded13[expert] = view.groups_loaded

    def packed_gemms(self) -> Optional[Tuple[PackedGemm, PackedGemm]]:
        """The packed experts' two GEMMs for the fused kernels; None unless packed."""
        if self.packed is None:
            return None
        bits = self.packed.bits
        run13, run2 = (_common_run(self.runs[gemm]) for gemm in ("13", "2"))
        return (PackedGemm(self.q13, self.s13, self.z13, self.g13, bits, run13),
                PackedGemm(self.q2, self.s2, self.z2, self.g2, bits, run2))

    def _make_scales(self, spec: Fp8Spec, shape: ExpertsShape, tp: int) -> None:
        """The scales of the `shape.num_experts` experts held, each split over `tp` ranks."""
        e, h, i = shape
        local = self.shard.size
        if spec.block is not None:
            bk = spec.block[1]
            if bk < 32 or bk & (bk - 1):
                raise ValueError(f"FP8 experts in {spec.block[0]}x{bk} blocks: the fused "
                                 f"kernels take K blocks of a power of two from 32, not {bk}")
            try:
                fp8.check_block_split(spec, [Part(self.shard, 0, i)], Shard(0, h), h, tp,
                                      "the experts' gate and up projections")
                fp8.check_block_split(spec, [Part(Shard(0, h), 0, h)], self.shard, i, tp,
                                      "the experts' down projection")
            except ValueError as err:
                raise ValueError(f"{err} (--enable-expert-parallel holds whole experts "
                                 f"instead)") from None
        s13 = torch.ones(e, 2, *spec.scale_shape(local, h), dtype=torch.float32)
        s2 = torch.ones(e, *spec.scale_shape(h, local), dtype=torch.float32)
        for name, scale in (("w13_weight_scale", s13), ("w2_weight_scale", s2)):
            if spec.online:
                self.register_buffer(name, scale, persistent=False)
            else:
                setattr(self, name, _param(scale))
        if spec.static_input:
            self.w13_input_scale = _param(torch.zeros(1, dtype=torch.float32))
            self.w2_input_scale = _param(torch.zeros(1, dtype=torch.float32))

    def scales(self) -> Optional[ExpertScales]:
        """What the fused kernels multiply FP8 weights by; None for dense weights."""
        if self.fp8 is None:
            return None
        static = self.fp8.static_input
        return ExpertScales(self.w13_weight_scale, self.w2_weight_scale, self.fp8.block,
                            self.w13_input_scale if static else None,
                            self.w2_input_scale if static else None)

    def dense(self, expert: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s (w13, w2) in the compute dtype: the weights as they are, or FP8
        or packed ones dequantized (the torch path, one expert at a time)."""
        if self.packed is not None:  # float32: the caller rounds to its dtype
            return (packed.dequantize(self._view("13", expert), self.packed.bits,
                                      torch.float32),
                    packed.dequantize(self._view("2", expert), self.packed.bits,
                                      torch.float32))
        if self.fp8 is None:
            return self.w13[expert], self.w2[expert]
        w13 = self.w13[expert].view(2, -1, self.w13.shape[-1])
        gate_up = [fp8.dequantize(w13[j], self.w13_weight_scale[expert, j], self.fp8.block,
                                  self.fp8.dtype) for j in range(2)]
        down = fp8.dequantize(self.w2[expert], self.w2_weight_scale[expert], self.fp8.block,
                              self.fp8.dtype)
        return torch.cat(gate_up), down

    # --- loading ----------------------------------------------------------------------------
    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        """`shard_id` as `expert_param` numbers it: 2 * expert + (0 gate, 1 up) for w13's
        tensors, the expert for w2's (global ids: another rank's expert is not read)."""
        expert, half = divmod(shard_id, 2) if param.startswith("w13") else (shard_id, 0)
        what = f"{param}[{expert}]" + (f"[{half}]" if param.startswith("w13") else "")
        if not self.owned.start <= expert < self.owned.stop:
            return
        expert -= self.owned.start
        s = self.shard
        spec = self.fp8
        if self.packed is not None and param == "w13":
            view = self._view("13", expert)
            packed.load_columns(view, self.packed, src, s.start, s.stop, half * s.size, what)
            self._keep("13", expert, view)
        elif self.packed is not None and param == "w2":
            view = self._view("2", expert)
            packed.load_rows(view, self.packed, src, s.start, s.stop, what)
            self._keep("2", expert, view)
        elif param in ("w13", "w2"):
            rows = (self.w13.data[expert, half * s.size:(half + 1) * s.size] if param == "w13"
                    else self.w2.data[expert])
            part = src.read(0, s.start, s.stop) if param == "w13" else src.read(1, s.start,
                                                                                s.stop)
            if spec is None:
                copy_into(rows, part, what)
            else:
                fp8.load_weight(rows, self._row_scales(param, expert, half), spec, part, what)
        elif spec is None:
            raise ValueError(f"{what}: the experts are not FP8 (no such tensor to load)")
        elif param == "w13_weight_scale" and not spec.online:
            fp8.load_column_scale(self.w13_weight_scale.data[expert, half], spec, src,
                                  Part(s, 0, self.intermediate), what)
        elif param == "w2_weight_scale" and not spec.online:
            fp8.load_row_scale(self.w2_weight_scale.data[expert], spec, src, s, what)
        elif param in ("w13_input_scale", "w2_input_scale") and spec.static_input:
            fp8.load_input_scale(getattr(self, param).data, src, what)
        else:
            raise ValueError(f"{what}: FP8 experts ({spec}) have no such tensor to load")

    def piece(self, param: str, shard_id: int = 0) -> Piece:
        """Expert `shard_id`'s gate or up rows (w13, numbered as `load` numbers them) or its
        down columns (w2) this rank holds: none of an expert another rank owns (expert
        parallelism)."""
        kept = self.packed if self.packed is not None else self.fp8
        if kept is not None or param not in ("w13", "w2"):
            raise not_readable(f"experts' {param}", f"kept quantized ({kept})" if kept
                               else "no such parameter")
        expert, half = divmod(shard_id, 2) if param == "w13" else (shard_id, 0)
        s, full = self.shard, self.intermediate
        if not self.owned.start <= expert < self.owned.stop:
            return (Piece(self.w13.new_empty(0, self.w13.shape[-1]), 0, 0, full)
                    if param == "w13" else Piece(self.w2.new_empty(self.w2.shape[1], 0), 1, 0,
                                                 full))
        local = expert - self.owned.start
        if param == "w13":
            return Piece(self.w13[local, half * s.size:(half + 1) * s.size], 0, s.start, full)
        return Piece(self.w2[local], 1, s.start, full)

    def _row_scales(self, param: str, expert: int, half: int) -> Optional[torch.Tensor]:
        """Where online quantization writes a slice's per-row scales (None with blocks)."""
        if self.fp8 is None or self.fp8.block is not None:
            return None
        if param == "w13":
            return self.w13_weight_scale.data[expert, half]
        return self.w2_weight_scale.data[expert]

    # --- after loading ----------------------------------------------------------------------
    @torch.no_grad()
    def dequantize_fp8(self) -> None:
        """Weight-only FP8 (the CPU): every expert dequantized to the compute dtype, the scales
        dropped; the experts are dense from then on."""
        spec = self.fp8
        if spec is None or not spec.weight_only:
            return
        w13 = torch.empty(self.w13.shape, dtype=spec.dtype, device=self.w13.device)
        w2 = torch.empty(self.w2.shape, dtype=spec.dtype, device=self.w2.device)
        for e in range(self.w13.shape[0]):
            w13[e], w2[e] = self.dense(e)
        for name in ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale"):
            if hasattr(self, name):
                delattr(self, name)
        self.w13, self.w2 = _param(w13), _param(w2)
        self.fp8 = None

    @torch.no_grad()
    def fill_quantized_random(self, gen: torch.Generator, std: float) -> None:
        """Random FP8 experts (normal, `std`), quantized as the spec lays out their scales,
        static activation scales that hold values up to 8; or random packed integers."""
        if self.packed is not None:
            for e in range(self.q13.shape[0]):
                for gemm in ("13", "2"):
                    view = self._view(gemm, e)
                    packed.fill_random(view, self.packed, gen, std)
                    self._keep(gemm, e, view)
            return
        spec = self.fp8
        if spec is None:
            return
        h = self.w13.shape[-1]
        for e in range(self.w13.shape[0]):
            halves = self.w13.data[e].view(2, -1, h)
            for j in range(2):
                self._fill(halves[j], self.w13_weight_scale.data[e, j], spec, gen, std)
            self._fill(self.w2.data[e], self.w2_weight_scale.data[e], spec, gen, std)
        if spec.static_input:
            self.w13_input_scale.data.fill_(8.0 / fp8.FP8_MAX)
            self.w2_input_scale.data.fill_(8.0 / fp8.FP8_MAX)

    @staticmethod
    def _fill(weight: torch.Tensor, scale: torch.Tensor, spec: Fp8Spec, gen: torch.Generator,
              std: float) -> None:
        w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        w.normal_(0.0, std, generator=gen)
        q, s = fp8.quantize_rows(w) if spec.block is None else fp8.quantize_blocks(w, spec.block)
        weight.copy_(q)
        scale.copy_(s)
