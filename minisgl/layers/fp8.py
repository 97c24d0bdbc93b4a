"""FP8 weights of the linear layers: how a layer holds them, loads its shard of them, quantizes
a dense checkpoint's shard online, and multiplies by them.

An FP8 layer holds `weight` in float8_e4m3fn and `weight_scale` in float32, the factor that
dequantizes it (w = weight * weight_scale, broadcast):
- per output row, [N]: per-channel checkpoints, online quantization, and per-tensor
  checkpoints, whose one scale per checkpoint tensor is written to that tensor's rows. A fused
  projection (QKV, gate/up) whose parts carry different per-tensor scales so keeps each part's
  own scale, exactly, with no requantization;
- per Bn x Bk block, [ceil(N / Bn), ceil(K / Bk)] (Hugging Face's `fp8` format,
  `weight_block_size`, and compressed-tensors' block strategy). A shard must then hold whole
  blocks (checked when the layer is built).
A static checkpoint's activation scale, `input_scale` [1], is the largest of the fused parts'
(no part's activations then overflow).

Where the spec says `weight_only` (the CPU), `finish_loading` dequantizes every FP8 layer to the
compute dtype once the weights are in, and the model runs as a dense one: its numerics are the
checkpoint's weights exactly. Elsewhere (CUDA) the projections are W8A8: activations are
quantized per token (per 1 x Bk group with block scales; the checkpoint's per-tensor scale when
static) and multiplied by scaled FP8 GEMMs (kernels/fp8.py); one-token projections take the
FP8 GEMV with bfloat16 activations (kernels/gemv.py, layers/linear.project).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import nn

from minisgl.distributed import Shard
from minisgl.kernels.types import FP8, FP8_MAX, FP8_MIN_AMAX as MIN_AMAX, ProductScales
from minisgl.layers.source import TensorSource, copy_into

if TYPE_CHECKING:  # kernels/fp8.py imports triton: only CUDA paths load it
    from minisgl.kernels.fp8 import Quantized, RowwisePlan

# Rowwise products: torch._scaled_mm where it applies, Triton, or (Hopper) per shape the
# fastest of those and an unscaled tensorwise product rescaled after (kernels/fp8.rowwise_plan).
GEMMS = ("scaled_mm", "triton", "auto")
SCALE_PARAMS = ("weight_scale", "input_scale")  # checkpoint tensors of an FP8 layer besides weight


@dataclass(frozen=True)
class Fp8Spec:
    """How one linear layer's weights are FP8.

    `block`: (Bn, Bk), the weight-scale block; None: a scale per output row. `static_input`:
    the checkpoint gives a per-tensor activation scale (`input_scale`); else activations are
    scaled dynamically per token (per 1 x Bk group with blocks). `online`: the checkpoint is
    dense and each rank quantizes its own shard per output row as it loads. `weight_only`:
    dequantize to `dtype` after loading (the CPU). `gemm`: which rowwise GEMM runs on CUDA."""

    block: Optional[Tuple[int, int]] = None
    static_input: bool = False
    online: bool = False
    weight_only: bool = False
    dtype: torch.dtype = torch.float32
    gemm: str = "scaled_mm"

    def __post_init__(self) -> None:
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"an FP8 weight block is two positive sizes, got {self.block}")
        if self.online and (self.block is not None or self.static_input):
            raise ValueError("online FP8 quantization is per output row with dynamic "
                             "activations (no block, no static input scale)")
        if self.gemm not in GEMMS:
            raise ValueError(f"FP8 gemm must be one of {GEMMS}, got {self.gemm!r}")

    def scale_shape(self, out_features: int, in_features: int) -> Tuple[int, ...]:
        if self.block is None:
            return (out_features,)
        bn, bk = self.block
        return (-(-out_features // bn), -(-in_features // bk))


class Fp8Weight(NamedTuple):
    """What an FP8 projection multiplies by."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # float32: [N], or [ceil(N / Bn), ceil(K / Bk)] with blocks
    input_scale: Optional[torch.Tensor]  # [1] float32 for static activations
    spec: Fp8Spec
    unit: Optional[torch.Tensor] = None  # [1] float32 one on the weight's device (unscaled_mm)


class UnscaledProduct(NamedTuple):
    """An FP8 product before its scales (kernels/fp8.unscaled_mm): the value is
    product * scales.row * scales.col, applied by whoever reads it."""

    product: torch.Tensor  # [M, N] bfloat16
    scales: ProductScales


def fp8_gemm(device: torch.device, dtype: torch.dtype) -> str:
    """The rowwise GEMM FP8 layers use on `device` computing in `dtype` (see Fp8Spec.gemm).
    ValueError naming the GPU where it has no FP8 (compute capability below 8.9). Rowwise
    torch._scaled_mm (CUTLASS / cuBLASLt) with a bfloat16 output on the architectures torch
    builds it for (8.9 to 10.x), on Hopper (9.x) "auto": Triton for the shapes where
    cuBLASLt's rowwise kernel is slow, or its tensorwise one, unscaled, and the scales after
    (kernels/fp8.rowwise_plan); Triton
    elsewhere."""
    if device.type != "cuda":
        return "triton"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, "
                         f"Hopper); {device} ({torch.cuda.get_device_name(device)}) has "
                         f"{major}.{minor}")
    if major == 9 and dtype == torch.bfloat16:
        return "auto"
    return "scaled_mm" if major < 11 and dtype == torch.bfloat16 else "triton"


# --- quantization and dequantization (torch: loading and references) ------------------------
def quantize_rows(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 [N, K], float32 scales [N]): each row divided by amax / 448."""
    w = w.float()
    scale = torch.linalg.vector_norm(w, float("inf"), dim=1).clamp(min=MIN_AMAX) / FP8_MAX
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def _expand_blocks(scale: torch.Tensor, block: Tuple[int, int], n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def quantize_blocks(w: torch.Tensor, block: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 [N, K], float32 scales [ceil(N / Bn), ceil(K / Bk)]): each block divided
    by its amax / 448."""
    n, k = w.shape
    bn, bk = block
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (w.float() / _expand_blocks(scale, block, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Optional[Tuple[int, int]],
               dtype: torch.dtype) -> torch.Tensor:
    """weight * scale (broadcast per row or per block) in float32, rounded once to `dtype`."""
    n, k = weight.shape
    full = scale[:, None] if block is None else _expand_blocks(scale, block, n, k)
    return (weight.float() * full).to(dtype)


# --- building and loading a layer -------------------------------------------------------------
def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def make_params(module: nn.Module, spec: Fp8Spec, out_features: int, in_features: int) -> None:
    """Give a linear layer its FP8 tensors: `weight`, `weight_scale` (a parameter the checkpoint
    must hold, or a buffer when quantizing online) and, for static activations, `input_scale`."""
    module.weight = _param(torch.empty(out_features, in_features, dtype=FP8))
    scale = torch.ones(spec.scale_shape(out_features, in_features), dtype=torch.float32)
    if spec.online:
        module.register_buffer("weight_scale", scale, persistent=False)
    else:
        module.weight_scale = _param(scale)
    if spec.static_input:
        module.input_scale = _param(torch.zeros(1, dtype=torch.float32))
    module.register_buffer("unit_scale", torch.ones(1, dtype=torch.float32), persistent=False)


class Part(NamedTuple):
    """One logical output of a column-parallel layer on this rank: its shard of the checkpoint
    tensor's rows, where they go in the layer's weight, and the tensor's full row count."""

    shard: Shard
    offset: int
    full: int


def check_block_split(spec: Fp8Spec, parts: Sequence[Part], in_shard: Shard, in_full: int,
                      tp: int, what: str) -> None:
    """With block scales, ValueError naming the numbers when this rank's rows or input columns
    are not whole blocks: a part's rows start and end on a Bn boundary (a ragged end only at
    the end of the tensor, in the weight's last part), and the columns likewise on Bk."""
    if spec.block is None:
        return
    bn, bk = spec.block
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        ends_ok = p.shard.size % bn == 0 or (last and p.shard.stop == p.full)
        if p.shard.start % bn or p.offset % bn or not ends_ok:
            raise ValueError(
                f"FP8 weights in {bn}x{bk} blocks cannot be split so: {what} output part {i} "
                f"gets rows [{p.shard.start}, {p.shard.stop}) of {p.full} at tp={tp}, which "
                f"is not a whole number of {bn}-row blocks")
    if in_shard.start % bk or (in_shard.size % bk and in_shard.stop != in_full):
        raise ValueError(
            f"FP8 weights in {bn}x{bk} blocks cannot be split so: {what} gets input columns "
            f"[{in_shard.start}, {in_shard.stop}) of {in_full} at tp={tp}, which is not a "
            f"whole number of {bk}-column blocks")


def load_weight(weight: torch.Tensor, row_scale: Optional[torch.Tensor], spec: Fp8Spec,
                src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint slice into (rows of) an FP8 weight: as is where it is FP8; quantized
    per row (scales into `row_scale`, the same rows of weight_scale) where the checkpoint is
    dense and the spec is online. Done on the weight's device, one slice at a time."""
    if src.dtype == FP8:
        copy_into(weight, src, what)
        return
    if not spec.online or row_scale is None:
        raise ValueError(f"{what} is {src.dtype} in the checkpoint, but its quantization config "
                         f"makes the layer FP8 (no FP8 weight and scale to load)")
    q, scale = quantize_rows(src.to(weight.device))
    copy_into(weight, q, what)
    copy_into(row_scale, scale, f"{what} (scales)")


def _scale_value(src: TensorSource, what: str) -> torch.Tensor:
    t = src.read()
    if t.numel() != 1:
        raise ValueError(f"{what}: a per-tensor scale has one element, got shape {tuple(t.shape)}")
    return t.reshape(1).float()


def load_input_scale(dst: torch.Tensor, src: TensorSource, what: str) -> None:
    """The static activation scale: the largest over the parts fused into the layer."""
    dst.copy_(torch.maximum(dst, _scale_value(src, what).to(dst.device)))


def load_column_scale(scale: torch.Tensor, spec: Fp8Spec, src: TensorSource, part: Part,
                      what: str) -> None:
    """A column-parallel layer's share of one part's weight scale: per tensor (written to the
    part's rows), per row (its shard's rows) or per block (its shard's block rows)."""
    s = part.shard
    if spec.block is not None:
        bn = spec.block[0]
        first, stop = s.start // bn, -(-s.stop // bn)
        dst = scale[part.offset // bn: part.offset // bn + stop - first]
        copy_into(dst, src.read(0, first, stop).float(), what)
        return
    rows = scale[part.offset: part.offset + s.size]
    shape = tuple(src.shape)
    if int(torch.Size(shape).numel()) == 1:
        rows.copy_(_scale_value(src, what).expand(s.size))
    elif shape in ((part.full,), (part.full, 1)):
        copy_into(rows, src.read(0, s.start, s.stop).reshape(-1).float(), what)
    else:
        raise ValueError(f"{what}: a weight scale is per tensor or per output row ({part.full}), "
                         f"got shape {shape}")


def load_row_scale(scale: torch.Tensor, spec: Fp8Spec, src: TensorSource, in_shard: Shard,
                   what: str) -> None:
    """A row-parallel layer's weight scale: whole per tensor or per row (the output rows are not
    split), its shard's block columns per block."""
    if spec.block is not None:
        bk = spec.block[1]
        copy_into(scale, src.read(1, in_shard.start // bk, -(-in_shard.stop // bk)).float(), what)
        return
    shape = tuple(src.shape)
    if int(torch.Size(shape).numel()) == 1:
        scale.copy_(_scale_value(src, what).expand(scale.shape[0]))
    elif shape in ((scale.shape[0],), (scale.shape[0], 1)):
        copy_into(scale, src.read().reshape(-1).float(), what)
    else:
        raise ValueError(f"{what}: a weight scale is per tensor or per output row "
                         f"({scale.shape[0]}), got shape {shape}")


class Fp8Layer(Protocol):
    """A linear layer holding FP8 weights (`make_params` gave it its tensors; input_scale only
    with static activations)."""

    fp8: Optional[Fp8Spec]
    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor


class Fp8Module(Protocol):
    """A module holding FP8 weights while `fp8` is a spec: the linear layers (one weight and its
    scales, as here) and the MoE experts (layers/experts.py, their own layout); each fills and
    dequantizes its own tensors."""

    fp8: Optional[Fp8Spec]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[Tuple[str, nn.Parameter]]: ...

    def fill_quantized_random(self, gen: torch.Generator, std: float) -> None: ...

    def dequantize_fp8(self) -> None: ...


def fp8_layers(model: nn.Module) -> Iterator[Tuple[str, Fp8Module]]:
    """(name, module) of every module holding FP8 weights."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "fp8", None), Fp8Spec):
            yield name, cast(Fp8Module, module)


def _spec(module: Fp8Layer) -> Fp8Spec:
    if module.fp8 is None:
        raise RuntimeError("an FP8 layer's spec is gone: it was dequantized already")
    return module.fp8


def _unit(w: Fp8Weight) -> torch.Tensor:
    """The weight's unit scale, which `_plan` requires for a tensorwise product."""
    if w.unit is None:
        raise RuntimeError("a tensorwise FP8 product needs the layer's unit scale")
    return w.unit


@torch.no_grad()
def fill_random(module: Fp8Layer, gen: torch.Generator, std: float) -> None:
    """A linear layer's random FP8 weights (normal, `std`, quantized as the spec's scales are
    laid out) and, for static activations, an activation scale that holds values up to 8."""
    spec = _spec(module)
    w = torch.empty(module.weight.shape, dtype=torch.float32, device=module.weight.device)
    w.normal_(0.0, std, generator=gen)
    q, scale = quantize_rows(w) if spec.block is None else quantize_blocks(w, spec.block)
    module.weight.data.copy_(q)
    module.weight_scale.data.copy_(scale)
    if spec.static_input:
        module.input_scale.data.fill_(8.0 / FP8_MAX)


@torch.no_grad()
def dequantize_layer(module: Fp8Layer) -> None:
    """A weight-only linear layer dequantized to its compute dtype: a plain dense layer from
    then on (its spec None); any other layer is left as it is."""
    spec = _spec(module)
    if not spec.weight_only:
        return
    dense = dequantize(module.weight.data, module.weight_scale.data, spec.block, spec.dtype)
    del module.weight_scale
    if spec.static_input:
        del module.input_scale
    module.weight = _param(dense)
    module.fp8 = None


@torch.no_grad()
def start_loading(model: nn.Module) -> None:
    """Before a checkpoint's tensors load: every static activation scale back to zero, since
    loading keeps the largest of the fused parts' or experts' (load_input_scale); a reload of
    other weights into the same tensors then takes its own, not the largest of both."""
    for _, module in fp8_layers(model):
        for name, scale in module.named_parameters(recurse=False):
            if name.endswith("input_scale"):  # a layer's, or an expert GEMM's (w13_, w2_)
                scale.zero_()


@torch.no_grad()
def finish_loading(model: nn.Module) -> None:
    """After every weight is in: the weight-only modules dequantized to their compute dtype (and
    plain dense ones from then on); the others stay FP8. On CUDA the quantization's
    temporaries go back to the driver, so the KV pool sizes itself from the memory truly free
    (torch.cuda.mem_get_info counts the allocator's cached blocks as used)."""
    layers = list(fp8_layers(model))
    if any(p.is_cuda for _, m in layers for _, p in m.named_parameters()):
        torch.cuda.empty_cache()
    for _, module in layers:
        module.dequantize_fp8()


def linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x W^T + b on CUDA for FP8 weights: x quantized (per token, per 1 x Bk group with blocks,
    or by the static scale), then the scaled GEMM; the output in x's dtype."""
    from minisgl.kernels import fp8 as kernels
    k, n = x.shape[-1], w.weight.shape[0]
    rows = x.reshape(-1, k)
    if w.spec.block is not None:
        a = kernels.quantize_groups(rows.contiguous(), w.spec.block[1])
        out = kernels.scaled_mm(a, w.weight, w.scale, bias, x.dtype, w.spec.block)
    else:
        out = rowwise_product(kernels.quantize_tokens(rows.contiguous(), w.input_scale), w,
                              bias, x.dtype)
    return out.view(*x.shape[:-1], n)


def takes_tokens(w: Fp8Weight) -> bool:
    """Whether `linear` quantizes its input per token, dynamically (weights scaled per output
    row, no static activation scale): then the kernel that produces the input can quantize it
    on the way out instead (kernels/rmsnorm.rmsnorm_quantized,
    kernels/activation.act_and_mul_quantized), and `rowwise_product` finishes the product."""
    return w.spec.block is None and not w.spec.static_input and not w.spec.weight_only


def rowwise_product(a: Quantized, w: Fp8Weight, bias: Optional[torch.Tensor],
                    dtype: torch.dtype) -> torch.Tensor:
    """(a.values * a.scales) (weight * scale)^T + b for rows quantized per token (or by the
    static scale), [M, N] in `dtype`, as `_plan` says: torch._scaled_mm rowwise, the Triton
    scaled GEMM, or (Hopper's "auto", kernels/fp8.rowwise_plan) `unscaled_product` and a
    rescale launch."""
    from minisgl.kernels import fp8 as kernels
    plan = _plan(a, w, dtype)
    if plan.kind == "tensorwise":
        return kernels.rescale(kernels.unscaled_mm(a.values, w.weight, _unit(w)), a.scales,
                               w.scale, bias, dtype)
    if plan.kind == "cublaslt":
        return kernels.rowwise_mm(a, w.weight, w.scale, bias)
    return kernels.scaled_mm(a, w.weight, w.scale, bias, dtype, tiles=plan.tiles)


def unscaled_product(a: Quantized, w: Fp8Weight, dtype: torch.dtype
                     ) -> Optional[UnscaledProduct]:
    """The product without its scales, where `_plan` says tensorwise (Hopper's "auto" GEMM at
    decode-batch sizes, a bfloat16 output); None otherwise (nothing computed). The caller
    applies the scales (and any bias): kernels/fp8.rescale, or a kernel that reads the
    product anyway (SiLU-and-mul)."""
    if w.spec.block is not None or _plan(a, w, dtype).kind != "tensorwise":
        return None
    from minisgl.kernels import fp8 as kernels
    return UnscaledProduct(kernels.unscaled_mm(a.values, w.weight, _unit(w)),
                           ProductScales(a.scales, w.scale))


def apply_scales(product: torch.Tensor, scales: ProductScales) -> torch.Tensor:
    """An unscaled product's value, in its dtype: product * scales.row * scales.col in one
    launch (kernels/fp8.rescale), where no kernel that reads it next takes the scales."""
    from minisgl.kernels import fp8 as kernels
    return kernels.rescale(product, scales.row, scales.col, None, product.dtype)


def _plan(a: Quantized, w: Fp8Weight, dtype: torch.dtype) -> RowwisePlan:
    """How a rowwise product of this shape runs under the spec's GEMM: "scaled_mm" takes
    torch._scaled_mm where it applies (bfloat16 out, K and N multiples of 16), "auto"
    kernels/fp8.rowwise_plan's choice where the shape and the layer allow it (torch._scaled_mm
    applies; a unit scale for the tensorwise product), and Triton is the rest."""
    from minisgl.kernels import fp8 as kernels
    (m, k), n = a.values.shape, w.weight.shape[0]
    applies = kernels.rowwise_mm_applies(k, n, dtype)
    if w.spec.gemm == "triton" or not applies and w.spec.gemm == "scaled_mm":
        return kernels.RowwisePlan("triton")
    if w.spec.gemm == "scaled_mm":
        return kernels.RowwisePlan("cublaslt")
    plan = kernels.rowwise_plan(m, n)
    if plan.kind != "triton" and not applies:
        return kernels.RowwisePlan("triton")
    if plan.kind == "tensorwise" and w.unit is None:
        return kernels.RowwisePlan("cublaslt")
    return plan
