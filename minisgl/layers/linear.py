"""Tensor-parallel linear layers.

Column-parallel layers split the output features (no communication); row-parallel layers split the
input features and all-reduce the partial sums. Each layer's `load` reads only this rank's slice.

At batch 1 on the GPU a projection can absorb what surrounds it into its one kernel: the RMSNorm
before it (`forward_normed*`, taking a ResidualStream), SiLU-and-mul after gate/up, and after QKV
the rotary embedding and the K/V store. That is why these layers see norms, the rotary caches and
the KV cache layout: the kernel that fuses them is the projection's.

Built with a `LoraShape` (layers/lora.py), a layer holds LoRA adapters' pairs too, and
`forward_lora` / `forward_stream(..., lora)` add their deltas to the tokens that run with one
(the plain product: the fused paths above take no adapter).

Built with a `WeightFormat` (layers/weight_format.py) naming an `Fp8Spec` (layers/fp8.py), the
column- and row-parallel layers hold FP8 weights and their scales, load their shards of them (or
quantize their shard of a dense checkpoint), and multiply by them on CUDA; on the CPU they are
dequantized once loaded and run as dense layers. Naming a `PackedSpec` (layers/packed.py: AWQ,
GPTQ, compressed-tensors integers on the GPU) they hold the packed integers and multiply by them
(kernels/int_mm.py); the batch-1 fusions (the GEMV with the norm, SiLU, rotary) read dense or
FP8 weights only and step aside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import nn

from minisgl.core import LoraRows
from minisgl.distributed import Communicator, DistributedInfo, Shard, check_head_split
from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import KVTarget, Normed, ProductScales, QKVRope
from minisgl.layers import blas
from minisgl.layers import fp8 as fp8_weights
from minisgl.layers import packed as packed_weights
from minisgl.layers.fp8 import Fp8Spec, Fp8Weight
from minisgl.layers.packed import PackedSpec, PackedWeight
from minisgl.layers.lora import LoraShape, LoraSlots
from minisgl.layers.readback import Piece, not_readable
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.layers.source import TensorSource, copy_into
from minisgl.layers.weight_format import WeightFormat

if TYPE_CHECKING:  # kernels/fp8.py imports triton: only CUDA paths load it
    from minisgl.kernels.fp8 import Quantized


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def takes_gemv(x: torch.Tensor, policy: KernelPolicy) -> bool:
    """Whether `project(x, ..., policy)` runs the Triton GEMV: with `policy.gemv`, a single token
    in a half dtype on CUDA (decode at batch 1), where `gemv_reads` its weights."""
    return (policy.gemv and x.is_cuda and x.numel() == x.shape[-1]
            and x.dtype in (torch.bfloat16, torch.float16))


def gemv_reads(quant: Optional[Fp8Weight]) -> bool:
    """Whether the GEMV reads these weights: dense ones (None), or FP8 ones scaled per output
    row (block-scaled ones take the scaled GEMM at batch 1 too)."""
    return quant is None or quant.spec.block is None


def project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
            policy: KernelPolicy = KernelPolicy(),
            blas_by_rows: Optional[Dict[int, str]] = None,
            quant: Optional[Fp8Weight] = None, out: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """x W^T + b. Where `takes_gemv(x, policy)` and `gemv_reads(quant)`, the Triton GEMV of
    kernels/gemv.py (reading FP8 weights and their row scales where `quant` gives them; x stays
    in its dtype),
    launched with programmatic dependent launch so that its weights stream while the previous
    kernel finishes; else with FP8 weights (`quant`, whose weight is `weight`) the W8A8 GEMM of
    layers/fp8.linear; anything else F.linear, by the BLAS library `blas_by_rows` names for
    x's row count (layers/blas.py; cuBLAS where it names none). `out`: where given, the
    product lands there (utils.checked_out) instead of in a new tensor, for the GEMV and the
    BLAS GEMM (the LM head's paths); the W8A8 GEMM takes none. With `policy.batch_invariant`,
    dense weights take blas.invariant_linear (the engine refuses quantized ones then)."""
    if policy.batch_invariant and quant is None:
        return blas.invariant_linear(x, weight, bias, out)
    if takes_gemv(x, policy) and gemv_reads(quant):
        from minisgl.kernels import gemv
        return gemv.gemv(x, weight, bias, pdl=policy.pdl, weight_scale=_row_scale(quant),
                         out=out)
    if quant is not None:
        if out is not None:
            raise ValueError("the FP8 W8A8 GEMM writes a new tensor; it takes no `out`")
        return fp8_weights.linear(x, quant, bias)
    library = blas_by_rows.get(x.numel() // x.shape[-1]) if blas_by_rows else None
    return blas.linear(x, weight, bias, library, out)


def _row_scale(quant: Optional[Fp8Weight]) -> Optional[torch.Tensor]:
    return None if quant is None else quant.scale


def _dense_param(layer: "_QuantizableLayer", param: str) -> torch.Tensor:
    """`param` of a layer that keeps the checkpoint's values (not FP8, not packed)."""
    kept = layer.packed if layer.packed is not None else layer.fp8
    if kept is not None and param != "bias":
        raise not_readable(f"{type(layer).__name__}.{param}", f"kept quantized ({kept})")
    if param not in ("weight", "bias") or getattr(layer, param) is None:
        raise not_readable(f"{type(layer).__name__}.{param}", "no such parameter")
    return getattr(layer, param)


def _loaded_bias(layer: "_QuantizableLayer") -> torch.Tensor:
    """The bias a checkpoint tensor loads into. CausalLM.load_weights refuses a tensor its
    module has no place for before any `load`; this guards a direct caller."""
    if layer.bias is None:
        raise ValueError(f"this {type(layer).__name__} has no bias to load")
    return layer.bias


class _QuantizableLayer(nn.Module):
    """What the column- and row-parallel layers share about quantized weights: `fp8`, their
    FP8 spec (None: dense weights, as after a weight-only layer's `finish_loading`), or
    `packed`, their packed integers' (None: not packed)."""

    fp8: Optional[Fp8Spec]
    packed: Optional[PackedSpec] = None
    # Set by _make_weight / fp8_weights.make_params (parameters, or buffers when quantizing
    # online); declared so that their type is a tensor's, not nn.Module's __getattr__ union.
    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    arrivals: torch.Tensor
    groups_loaded: bool
    group_run: int
    bias: Optional[torch.Tensor]
    policy: KernelPolicy
    blas_by_rows: Dict[int, str]

    def _make_weight(self, out_features: int, inputs: Shard, in_full: int) -> None:
        """The layer's weight for `inputs` of the checkpoint's `in_full` input features."""
        if self.packed is not None:
            packed_weights.make_buffers(self, self.packed, out_features, inputs, in_full)
            self.groups_loaded = False
            self.group_run = 0
        elif self.fp8 is None:
            self.weight = _empty(out_features, inputs.size)
        else:
            fp8_weights.make_params(self, self.fp8, out_features, inputs.size)

    def fill_quantized_random(self, gen: torch.Generator, std: float) -> None:
        """Random FP8 or packed weights (layers/fp8.fill_random, layers/packed.fill_random);
        dense layers are not touched."""
        if self.fp8 is not None:
            fp8_weights.fill_random(self, gen, std)
        elif self.packed is not None:
            packed_weights.fill_random(self, self.packed, gen, std)

    @property
    def checkpoint_params(self) -> Tuple[str, ...]:
        """What the loader fills (packed buffers take the checkpoint's one weight)."""
        return ("weight",)

    def packed_weight(self) -> Optional[PackedWeight]:
        """The packed integers the layer multiplies by; None where it holds none."""
        if self.packed is None:
            return None
        return PackedWeight(self.qweight, self.scales, self.zeros, self.g_idx, self.packed,
                            self.group_run, self.arrivals)

    def _product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x W^T + bias by whatever the layer holds: packed integers, else `project`."""
        packed = self.packed_weight()
        if packed is not None:
            return packed_weights.linear(x, packed, bias)
        return project(x, self.weight, bias, self.policy, self.blas_by_rows, self.quantized())

    def dequantize_fp8(self) -> None:
        """Weight-only FP8 weights made dense (layers/fp8.dequantize_layer)."""
        if self.fp8 is not None:
            fp8_weights.dequantize_layer(self)

    def quantized(self) -> Optional[Fp8Weight]:
        """The FP8 weight and scales `project` multiplies by; None for dense weights."""
        if self.fp8 is None:
            return None
        return Fp8Weight(self.weight, self.weight_scale, getattr(self, "input_scale", None),
                         self.fp8, getattr(self, "unit_scale", None))

    def _gemv_scale(self) -> Optional[torch.Tensor]:
        return _row_scale(self.quantized())

    def takes_quantized(self, x: torch.Tensor) -> bool:
        """Whether this layer would quantize x per token itself (FP8 weights scaled per output
        row, dynamic activations, x on CUDA and not the GEMV's one row, fused kernels): then
        the kernel that produces x hands it over quantized instead (`forward_quantized`),
        which saves the quantization's launch."""
        q = self.quantized()
        return (q is not None and fp8_weights.takes_tokens(q) and x.is_cuda
                and self.policy.fused and not (takes_gemv(x, self.policy) and gemv_reads(q)))

    def unscaled_product(self, a: Quantized, dtype: torch.dtype
                         ) -> Optional[fp8_weights.UnscaledProduct]:
        """This layer's product of quantized rows without its scales, where that is the
        faster way for this shape (layers/fp8.unscaled_product); None otherwise, nothing
        computed. The caller applies the scales; a column-parallel layer's bias too."""
        quant = self.quantized()
        return None if quant is None else fp8_weights.unscaled_product(a, quant, dtype)

    def _quantized_product(self, a: Quantized, dtype: torch.dtype,
                           bias: Optional[torch.Tensor]) -> torch.Tensor:
        quant = self.quantized()
        if quant is None:
            raise ValueError("forward_quantized needs FP8 weights (see takes_quantized)")
        return fp8_weights.rowwise_product(a, quant, bias, dtype)


class Reducer(Protocol):
    """What closes a tensor-parallel sublayer whose ranks each hold a partial sum of its output
    (a row-parallel projection, the MoE layer): the all-reduce (and any bias), alone or fused
    with the residual add and RMSNorm that follow."""

    def finish(self, partial: torch.Tensor) -> torch.Tensor: ...

    def reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                    ) -> Normed: ...

    def reduce_norm_quantized(self, partial: torch.Tensor, residual: torch.Tensor,
                              norm: RMSNorm) -> Tuple[Quantized, torch.Tensor]: ...


class RescaledProduct(NamedTuple):
    """The Reducer of an FP8 product taken unscaled (layers/fp8.UnscaledProduct) at tp=1 with
    no bias: the output is partial * scales.row * scales.col, and the norm kernel that reads
    the partial applies the scales (one launch fewer than kernels/fp8.rescale and the norm).
    Made by RowParallelLinear.forward_quantized_stream; nothing to all-reduce."""

    scales: ProductScales

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        return fp8_weights.apply_scales(partial, self.scales)

    def reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                    ) -> Normed:
        return cast(Normed, norm(partial, residual, self.scales))

    def reduce_norm_quantized(self, partial: torch.Tensor, residual: torch.Tensor,
                              norm: RMSNorm) -> Tuple[Quantized, torch.Tensor]:
        return norm.quantized(partial, residual, self.scales)


def finish_norm_quantized(reducer: Reducer, partial: torch.Tensor, residual: torch.Tensor,
                          norm: RMSNorm) -> Tuple[Quantized, torch.Tensor]:
    """`Reducer.reduce_norm_quantized` where the norm cannot take the reduction in: `finish`
    (the all-reduce is not fused into a quantizing norm), then the quantizing norm."""
    return norm.quantized(reducer.finish(partial), residual)


def all_reduce_norm(comm: Communicator, partial: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor, norm: RMSNorm) -> Normed:
    """norm(all_reduce(partial) + bias, residual): (the normed sum, the new residual). One fused
    kernel where the communicator offers it (no bias: it is added after the reduce, before the
    norm; the norm's Triton kernel on CUDA), else the all-reduce, the bias, then `norm`. A
    collective: every rank calls it in the same order with the same shapes."""
    if bias is None and norm.policy.fused and partial.is_cuda:
        fused = comm.all_reduce_rmsnorm(partial, residual, norm.weight, norm.eps, norm.policy)
        if fused is not None:
            return Normed(*fused)
    y = comm.all_reduce(partial)
    return cast(Normed, norm(y if bias is None else y + bias, residual))


class ResidualStream(NamedTuple):
    """The residual stream between two sublayers, before the RMSNorm that opens the next one:
    the hidden state is h = reduce(partial) + residual, where reduce is `reducer.finish` (the
    all-reduce and bias of the row-parallel layer that produced `partial`) or nothing (reducer
    None), and residual None means there is none yet (h = the embeddings). Leaving both the
    reduction and the norm to the consumer lets it fuse them into its own kernel: the all-reduce
    into the norm (tp > 1), or the norm into the one-token GEMV (batch 1)."""

    partial: torch.Tensor
    residual: Optional[torch.Tensor]
    reducer: Optional[Reducer]

    def reduced(self) -> torch.Tensor:
        """reduce(partial): h - residual (a collective where there is a reducer)."""
        return self.reducer.finish(self.partial) if self.reducer is not None else self.partial

    def normed(self, norm: RMSNorm) -> Normed:
        """(norm(h), h): with a reducer and a residual, `reducer.reduce_norm` (one fused kernel
        where the communicator offers it)."""
        if self.reducer is not None and self.residual is not None:
            return self.reducer.reduce_norm(self.partial, self.residual, norm)
        h = self.reduced()
        if self.residual is None:
            return Normed(cast(torch.Tensor, norm(h)), h)
        return cast(Normed, norm(h, self.residual))

    def normed_quantized(self, norm: RMSNorm) -> Tuple[Quantized, torch.Tensor]:
        """(norm(h) quantized per token, h), for a W8A8 projection: with a reducer and a
        residual `reducer.reduce_norm_quantized`, else the norm kernel that quantizes its
        output (RMSNorm.quantized) on h."""
        if self.reducer is not None and self.residual is not None:
            return self.reducer.reduce_norm_quantized(self.partial, self.residual, norm)
        return norm.quantized(self.reduced(), self.residual)


class Projected(NamedTuple):
    """A column-parallel layer's output on norm(h) and h (`forward_normed_unscaled`): `out` is
    the output, or with `scales` an unscaled FP8 product whose value is
    out * scales.row * scales.col (see ProductScales), for the kernel that reads it next."""

    out: torch.Tensor
    residual: torch.Tensor
    scales: Optional[ProductScales] = None

    def scaled(self) -> torch.Tensor:
        """The output itself: `out`, or (scales given) out rescaled by kernels/fp8.rescale."""
        return self.out if self.scales is None else fp8_weights.apply_scales(self.out,
                                                                             self.scales)


class ColumnParallelLinear(_QuantizableLayer):
    """y = x W^T + b with W split by output rows: this rank holds rows `out_sizes` slices.

    `out_sizes` lists the logical outputs fused into one matrix (e.g. gate and up); each is split
    across ranks separately, so shard `i` of every rank is contiguous in the local weight.
    `shards`: this rank's rows of each output, where they are not an even split over ranks.
    `fmt`: how the weights are stored (see _QuantizableLayer); FP8 blocks must not straddle
    shards (ValueError naming the numbers). `lora`: LoRA adapter slots (one pair per
    output part).
    """

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool,
                 info: DistributedInfo, policy: KernelPolicy = KernelPolicy(),
                 fmt: WeightFormat = WeightFormat(), shards: Optional[Sequence[Shard]] = None,
                 lora: Optional[LoraShape] = None) -> None:
        super().__init__()
        self.info = info
        self.policy = policy  # see project()
        self.blas_by_rows = {}  # see project(); filled by blas.tune
        self.fp8 = fp8 = fmt.fp8
        self.packed = fmt.packed
        self.full_sizes = list(out_sizes)  # each output's rows in the checkpoint
        self.shards = (list(shards) if shards is not None else
                       [info.shard(n, "linear output features") for n in out_sizes])
        self.offsets = [sum(s.size for s in self.shards[:i]) for i in range(len(self.shards))]
        local_out = sum(s.size for s in self.shards)
        if fp8 is not None:
            fp8_weights.check_block_split(fp8, self.parts, Shard(0, in_features), in_features,
                                          info.size, type(self).__name__)
        self._make_weight(local_out, Shard(0, in_features), in_features)
        self.bias = _empty(local_out) if bias else None
        self.lora = None if lora is None else LoraSlots(lora, in_features, self.shards, policy)

    @property
    def parts(self) -> List[fp8_weights.Part]:
        return [fp8_weights.Part(s, off, full)
                for s, off, full in zip(self.shards, self.offsets, self.full_sizes)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def forward_lora(self, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """The layer on x plus the LoRA deltas of the tokens `rows` names."""
        y = self(x)
        return y if self.lora is None else self.lora.add_delta(y, x, rows)

    def fuses_norm(self, stream: ResidualStream, norm: RMSNorm) -> bool:
        """Whether this layer runs on `norm(stream)` as one norm GEMV kernel (batch 1, GEMV
        path, a fused-kind norm, rows that fit a program)."""
        if not (self.packed is None and takes_gemv(stream.partial, self.policy)
                and gemv_reads(self.quantized()) and norm.policy.fused):
            return False
        from minisgl.kernels import gemv
        return self.weight.shape[1] <= gemv.NORM_GEMV_MAX_K

    def forward_normed(self, stream: ResidualStream, norm: RMSNorm) -> Normed:
        """(this layer applied to norm(h), h) for the stream's hidden state h: see
        `forward_normed_unscaled`, its scales applied where it returns them."""
        proj = self.forward_normed_unscaled(stream, norm)
        return Normed(proj.scaled(), proj.residual)

    def forward_normed_unscaled(self, stream: ResidualStream, norm: RMSNorm) -> Projected:
        """(this layer applied to norm(h), h) for the stream's hidden state h. Where
        `fuses_norm`, the norm and the residual add run inside the GEMV (gemv.norm_gemv):
        one launch instead of two. FP8 (`takes_quantized`): the norm kernel quantizes its
        output, and a product taken unscaled (layers/fp8's unscaled_product: Hopper,
        decode-batch rows; no bias) is returned so, with its scales, for the kernel that
        reads it next to apply (SiLU-and-mul, the rotary embedding)."""
        if self.fuses_norm(stream, norm):
            from minisgl.kernels import gemv
            return Projected(*gemv.norm_gemv(stream.reduced(), stream.residual, norm.weight,
                                             norm.eps, self.weight, self.bias,
                                             pdl=self.policy.pdl,
                                             weight_scale=self._gemv_scale()))
        if self.takes_quantized(stream.partial) and norm.policy.fused:
            a, h = stream.normed_quantized(norm)
            raw = self.unscaled_product(a, h.dtype) if self.bias is None else None
            if raw is not None:
                return Projected(raw.product, h, raw.scales)
            return Projected(self.forward_quantized(a, h.dtype), h)
        x, h = stream.normed(norm)
        return Projected(self(x), h)

    def forward_quantized(self, a: Quantized, dtype: torch.dtype) -> torch.Tensor:
        """This layer on rows already quantized per token (see takes_quantized): [M, N] in
        `dtype`, the bias added."""
        return self._quantized_product(a, dtype, self.bias)

    def forward_normed_act(self, stream: ResidualStream, norm: RMSNorm, act: int
                           ) -> Optional[Normed]:
        """For a layer built with out_sizes [d, d] (gate, up): (act(gate) * up of norm(h), h),
        act by its code (kernels/types.SILU or GELU_TANH), in one launch
        (gemv.norm_gate_up_act) where `fuses_norm`; else None, having done nothing."""
        if not self.fuses_norm(stream, norm):
            return None
        from minisgl.kernels import gemv
        return gemv.norm_gate_up_act(stream.reduced(), stream.residual, norm.weight,
                                     norm.eps, self.weight, self.bias, pdl=self.policy.pdl,
                                     weight_scale=self._gemv_scale(), act=act)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        shard, off = self.shards[shard_id], self.offsets[shard_id]
        what = f"{param}[{shard_id}]"
        if self.packed is not None and param == "weight":
            packed_weights.load_columns(self, self.packed, src, shard.start, shard.stop, off,
                                        what)
        elif self.fp8 is None or param == "bias":
            dst = getattr(self, param)
            copy_into(dst.data[off:off + shard.size], src.read(0, shard.start, shard.stop),
                      what)
        elif param == "weight":
            rows = (self.weight_scale.data[off:off + shard.size] if self.fp8.block is None
                    else None)
            fp8_weights.load_weight(self.weight.data[off:off + shard.size], rows, self.fp8,
                                    src.read(0, shard.start, shard.stop), what)
        elif param == "weight_scale" and not self.fp8.online:
            fp8_weights.load_column_scale(self.weight_scale.data, self.fp8, src,
                                          self.parts[shard_id], what)
        elif param == "input_scale" and self.fp8.static_input:
            fp8_weights.load_input_scale(self.input_scale.data, src, what)
        else:
            raise ValueError(f"{what}: an FP8 layer ({self.fp8}) has no such tensor to load")

    def piece(self, param: str, shard_id: int = 0) -> Piece:
        """The rows of checkpoint tensor `param` of output `shard_id` this rank holds."""
        dense = _dense_param(self, param)
        shard, off = self.shards[shard_id], self.offsets[shard_id]
        return Piece(dense[off:off + shard.size], 0, shard.start, self.full_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections. Q heads are split over ranks; KV heads are split when tp divides
    them and replicated (each rank keeps the one KV head its Q heads use) when tp exceeds them."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 info: DistributedInfo, policy: KernelPolicy = KernelPolicy(),
                 fmt: WeightFormat = WeightFormat(), lora: Optional[LoraShape] = None) -> None:
        check_head_split(num_heads, num_kv_heads, info.size)
        self.num_local_heads = num_heads // info.size
        self.num_local_kv_heads = max(1, num_kv_heads // info.size)
        kv_start = (info.rank * num_kv_heads // info.size) * head_dim
        kv = Shard(kv_start, self.num_local_kv_heads * head_dim)
        q = info.shard(num_heads * head_dim, "linear output features")
        super().__init__(hidden, [num_heads * head_dim] + [num_kv_heads * head_dim] * 2, bias,
                         info, policy, fmt, shards=[q, kv, kv], lora=lora)
        self.head_dim = head_dim

    def forward_normed_rotary(self, stream: ResidualStream, norm: RMSNorm,
                              rotary: RotaryEmbedding, positions: torch.Tensor, target: KVTarget
                              ) -> Optional[Normed]:
        """`forward_normed` with the rotary embedding and the K/V store fused in as well, at
        batch 1 (gemv.norm_qkv_rope): (qkv with q rotated, h), the rotated k and v
        written to the target's caches at its slot.
        None, having done nothing, where that kernel does not apply."""
        if not (rotary.fused and self.fuses_norm(stream, norm)):
            return None
        from minisgl.kernels import gemv
        rope = QKVRope(positions, rotary.cos, rotary.sin, self.num_local_heads,
                                   self.num_local_kv_heads, target)
        return gemv.norm_qkv_rope(stream.reduced(), stream.residual, norm.weight, norm.eps,
                                  self.weight, self.bias, rope, pdl=self.policy.pdl,
                                  weight_scale=self._gemv_scale())

    @property
    def split_sizes(self) -> List[int]:
        q = self.num_local_heads * self.head_dim
        kv = self.num_local_kv_heads * self.head_dim
        return [q, kv, kv]


class RowParallelLinear(_QuantizableLayer):
    """y = all_reduce(x_local W_local^T) + b; the input features are split over ranks.

    Where an RMSNorm follows (o_proj, down_proj), the decoder takes the partial product
    (`forward(x, reduce=False)`) and hands it to `reduce_norm`, which can do the all-reduce,
    the residual add and the norm in one kernel (Communicator.all_reduce_rmsnorm).
    `fmt`: how the weights are stored (see _QuantizableLayer); each rank's scales are its own
    shard's. `lora`: LoRA
    adapter slots (A split over ranks like the weight's columns)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, info: DistributedInfo,
                 comm: Communicator, policy: KernelPolicy = KernelPolicy(),
                 fmt: WeightFormat = WeightFormat(), lora: Optional[LoraShape] = None) -> None:
        super().__init__()
        self.policy = policy  # see project()
        self.blas_by_rows = {}  # see project(); filled by blas.tune
        self.shard = info.shard(in_features, "linear input features")
        self.in_features = in_features
        self.comm = comm
        self.tp = info.size
        self.fp8 = fp8 = fmt.fp8
        self.packed = fmt.packed
        if fp8 is not None:
            fp8_weights.check_block_split(fp8, [], self.shard, in_features, info.size,
                                          type(self).__name__)
        self._make_weight(out_features, self.shard, in_features)
        self.bias = _empty(out_features) if bias else None
        self.lora = (None if lora is None else
                     LoraSlots(lora, self.shard.size, [Shard(0, out_features)], policy))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The layer's output; with `reduce=False` only this rank's partial product (no
        all-reduce, no bias), which the caller must pass to `finish` or `reduce_norm` (e.g. in
        a ResidualStream)."""
        partial = self._product(x, None)
        return self.finish(partial) if reduce else partial

    def forward_quantized(self, a: Quantized, dtype: torch.dtype) -> torch.Tensor:
        """This rank's partial product of rows already quantized per token (see
        takes_quantized), [M, N] in `dtype`: as forward(x, reduce=False)."""
        return self._quantized_product(a, dtype, None)

    def partial_lora(self, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """forward(x, reduce=False) plus the LoRA deltas of the tokens `rows` names (each
        rank's share: the all-reduce sums them)."""
        partial = self(x, reduce=False)
        return partial if self.lora is None else self.lora.add_delta(partial, x, rows)

    def forward_stream(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                       lora: Optional[LoraRows] = None) -> ResidualStream:
        """The residual stream after this layer on x: ResidualStream(forward(x,
        reduce=False), residual, self), the LoRA deltas of the tokens `lora` names added to
        the partial product (each rank's share: the all-reduce sums them), or (FP8,
        `takes_quantized`) `forward_quantized_stream` of x quantized per token."""
        if lora is not None and self.lora is not None:
            return ResidualStream(self.partial_lora(x, lora), residual, self)
        if self.takes_quantized(x):
            from minisgl.kernels import fp8
            a = fp8.quantize_tokens(x.reshape(-1, x.shape[-1]).contiguous(), None)
            return self.forward_quantized_stream(a, x.dtype, residual)
        return ResidualStream(self(x, reduce=False), residual, self)

    def forward_quantized_stream(self, a: Quantized, dtype: torch.dtype,
                                 residual: Optional[torch.Tensor]) -> ResidualStream:
        """The residual stream after this layer on quantized rows: where the product is taken
        unscaled (layers/fp8.unscaled_product) at tp=1 without a bias, it keeps its scales
        for the norm that reads it (RescaledProduct); else forward_quantized's partial."""
        if self.tp == 1 and self.bias is None and residual is not None:
            raw = self.unscaled_product(a, dtype)
            if raw is not None:
                return ResidualStream(raw.product, residual, RescaledProduct(raw.scales))
        return ResidualStream(self.forward_quantized(a, dtype), residual, self)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """The output from the partial product: all-reduce (a collective), then the bias."""
        y = self.comm.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                    ) -> Normed:
        """norm(finish(partial), residual): `all_reduce_norm` with this layer's bias."""
        return all_reduce_norm(self.comm, partial, self.bias, residual, norm)

    def reduce_norm_quantized(self, partial: torch.Tensor, residual: torch.Tensor,
                              norm: RMSNorm) -> Tuple[Quantized, torch.Tensor]:
        return finish_norm_quantized(self, partial, residual, norm)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        if param == "bias":
            copy_into(_loaded_bias(self).data, src.read(), "bias")
        elif self.packed is not None and param == "weight":
            packed_weights.load_rows(self, self.packed, src, self.shard.start, self.shard.stop,
                                     param)
        elif self.fp8 is None:
            copy_into(self.weight.data, src.read(1, self.shard.start, self.shard.stop), param)
        elif param == "weight":
            rows = self.weight_scale.data if self.fp8.block is None else None
            fp8_weights.load_weight(self.weight.data, rows, self.fp8,
                                    src.read(1, self.shard.start, self.shard.stop), param)
        elif param == "weight_scale" and not self.fp8.online:
            fp8_weights.load_row_scale(self.weight_scale.data, self.fp8, src, self.shard, param)
        elif param == "input_scale" and self.fp8.static_input:
            fp8_weights.load_input_scale(self.input_scale.data, src, param)
        else:
            raise ValueError(f"{param}: an FP8 layer ({self.fp8}) has no such tensor to load")

    def piece(self, param: str, shard_id: int = 0) -> Piece:
        """The weight's columns this rank holds; the bias whole (every rank adds it)."""
        dense = _dense_param(self, param)
        if param == "bias":
            return Piece(dense)
        return Piece(dense, 1, self.shard.start, self.in_features)


class ReplicatedLinear(nn.Module):
    """A whole (unsplit) linear layer on every rank (small ones: routers, gates, a classifier's
    head). `policy.batch_invariant`: its product is blas.invariant_linear's."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 policy: KernelPolicy = KernelPolicy()) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features)
        self.bias: Optional[nn.Parameter] = _empty(out_features) if bias else None
        self.invariant = policy.batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blas.plain_linear(x, self.weight, self.bias, self.invariant)

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        copy_into(getattr(self, param).data, src.read(), param)

    def piece(self, param: str, shard_id: int = 0) -> Piece:
        return Piece(getattr(self, param))
