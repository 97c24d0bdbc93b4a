"""How a projection's GEMM reaches the BLAS: on CUDA, which library runs it at a given row
count, chosen by timing both; on CPU, small float32 products split over torch's threads
(`_cpu_split`: MKL runs a GEMV on one core).

For the same decode-sized GEMM, cuBLAS and cuBLASLt pick different kernels, and neither library
wins for every projection. Timed per projection with the weights streamed from memory, as in a
model step, cuBLASLt wins mostly for the O projection and at small batches. The end-to-end gain
is small and a timed choice can differ between runs (and with it the bf16 rounding), so tuning
is opt-in.

torch offers the choice only as a process-wide switch (`torch.backends.cuda.
preferred_blas_library`), so `linear` sets it around one call and restores it. That is safe
because the model runs from one thread: a scheduler process's, or the caller's for the
in-process `LLM` (which must not run GEMMs from another thread meanwhile). A CUDA graph
records the kernel picked at capture, so a replay pays nothing for the choice.

Who fills the tables: the engine calls `tune` once, before it captures the decode graphs, for
the graphs' batch sizes. Each rank tunes its own shards; ranks may choose differently, and that
is harmless: lockstep needs identical batches, not identical kernels.
"""

from __future__ import annotations

from typing import (Callable, ContextManager, Dict, Iterable, List, NamedTuple, Optional,
                    Protocol, Sequence, Tuple, cast)

import torch
import torch.nn.functional as F

from minisgl.utils import checked_out, temporarily

DEFAULT = "cublas"
LIBRARIES = (DEFAULT, "cublaslt")
# cuBLASLt must beat cuBLAS by more than this fraction to be chosen: near-ties keep the default,
# so timing noise does not flip a choice (and the bf16 rounding with it) from run to run.
MARGIN = 0.03

# (input rows [rows, in_features], weight [out, in], library) -> microseconds per call
Timer = Callable[[torch.Tensor, torch.Tensor, str], float]


def preferred_library(library: str) -> ContextManager[None]:
    """torch's process-wide BLAS preference set to `library` inside the block, restored after
    (also on error)."""
    prefer = torch.backends.cuda.preferred_blas_library
    # The getter returns torch's enum and the setter takes it or a name: one value type to mypy.
    return temporarily(prefer, prefer, library)  # type: ignore[arg-type]


# Up to this many rows, a float32 CPU product splits the weight's rows into one part per torch
# thread, run as one batched GEMM (torch spreads a batch over its threads; MKL runs a GEMV or a
# GEMM of a few rows on one core). On an AMD EPYC (2 threads) the default model's projections,
# weights read from DRAM, took 25 / 41 / 50 / 42 ms a step at 1 / 2 / 3 / 8 rows against
# F.linear's 48 / 78 / 97 / 56, bit for bit the same but at 5 rows; its LM head at 512 rows
# lost (233 / 193 ms).
CPU_SPLIT_MAX_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           library: Optional[str], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), with `library` preferred for a CUDA input when given (None:
    torch's current preference, cuBLAS unless the user changed it; off CUDA there is no BLAS
    choice to make, and a CPU build of torch refuses to prefer cuBLASLt). `out`: where given,
    the result is written there and returned (utils.checked_out), by the same GEMM F.linear
    runs (mm, or addmm with a bias, over x's rows). On CPU, up to CPU_SPLIT_MAX_ROWS rows run as
    one batched GEMM over torch's threads (`_cpu_split`), the same products to float rounding
    (mostly to the bit)."""
    if library is None or not x.is_cuda:
        return _linear(x, weight, bias, out)
    with preferred_library(library):
        return _linear(x, weight, bias, out)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            out: Optional[torch.Tensor]) -> torch.Tensor:
    split = None if x.is_cuda else _cpu_split(x.reshape(-1, x.shape[-1]), weight, bias)
    if split is not None:
        if out is None:
            return split.view(*x.shape[:-1], weight.shape[0])
        return checked_out(out, (*x.shape[:-1], weight.shape[0]), x).copy_(split.view(out.shape))
    if out is None:
        return F.linear(x, weight, bias)
    out = checked_out(out, (*x.shape[:-1], weight.shape[0]), x)
    rows, into = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(rows, weight.t(), out=into)
    else:
        torch.addmm(bias, rows, weight.t(), out=into)
    return out


def _cpu_split(rows: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """rows W^T + b as one batched GEMM over torch's threads, each thread a slice of W's rows
    (CPU_SPLIT_MAX_ROWS); None where it does not apply: one thread, more rows, W not contiguous
    or its rows not divisible among the threads, or not float32 (bf16 / fp16 products run in
    oneDNN, which uses every thread already: the split cost 5-20% there)."""
    parts = torch.get_num_threads()
    if (parts < 2 or rows.dtype != torch.float32 or rows.shape[0] > CPU_SPLIT_MAX_ROWS
            or weight.shape[0] % parts or not weight.is_contiguous()):
        return None
    slices = weight.view(parts, -1, weight.shape[1]).transpose(1, 2)
    each = rows.unsqueeze(0).expand(parts, -1, -1)
    product = (torch.bmm(each, slices) if bias is None
               else torch.baddbmm(bias.view(parts, 1, -1), each, slices))
    return product.transpose(0, 1).reshape(rows.shape[0], weight.shape[0])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) whose every row's bits are independent of the other rows
    (deterministic inference): on CUDA the order-fixed Triton GEMM (kernels/invariant_mm.py);
    elsewhere one row at a time, as a CPU BLAS also picks its kernel by the row count (a
    prompt's projections take one call a token: slow, and exact). `out` as for `linear`."""
    if x.is_cuda:
        from minisgl.kernels.invariant_mm import invariant_linear as triton_linear
        return triton_linear(x, weight, bias, out)
    out = checked_out(out, (*x.shape[:-1], weight.shape[0]), x)
    rows, into = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    for i in range(rows.shape[0]):
        _linear(rows[i:i + 1], weight, bias, into[i:i + 1])
    return out


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 invariant: bool = False) -> torch.Tensor:
    """F.linear, or `invariant_linear` where `invariant` (deterministic inference): the small
    replicated layers' and the torch experts' product, which take no library choice."""
    return invariant_linear(x, weight, bias) if invariant else F.linear(x, weight, bias)


def pick(us: Dict[str, float]) -> str:
    """The library for one (shape, rows): cuBLASLt only where it is faster by more than MARGIN."""
    lt, default = us["cublaslt"], us[DEFAULT]
    return "cublaslt" if lt < default * (1 - MARGIN) else DEFAULT


# Successive timed calls rotate over copies of the weight totalling at least this much, so
# that each call streams its weight from memory as in a model step (an H200's L2 holds 50 MB,
# more than an 8B model's O projection) instead of finding it in L2.
ROTATE_BYTES = 256 << 20
MAX_COPIES = 8


def cuda_timer(reps: int = 20, warmup: int = 3) -> Timer:
    """A Timer for CUDA tensors: the best of two rounds of `reps` calls, timed with events, each
    call on the next of a few copies of the weight (ROTATE_BYTES)."""
    def time_us(x: torch.Tensor, weight: torch.Tensor, library: str) -> float:
        nbytes = weight.numel() * weight.element_size()
        copies = [weight] + [weight.clone() for _ in range(
            min(MAX_COPIES, -(-ROTATE_BYTES // nbytes)) - 1)]
        best = float("inf")
        with preferred_library(library):
            for i in range(warmup):
                F.linear(x, copies[i % len(copies)])
            for _ in range(2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for i in range(reps):
                    F.linear(x, copies[i % len(copies)])
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) * 1e3 / reps)
        return best
    return time_us


class Tunable(Protocol):
    """A layer `tune` applies to: a 2-D weight and its table of rows -> library."""

    weight: torch.Tensor
    blas_by_rows: Dict[int, str]


class Tuned(NamedTuple):
    """What one `tune` timed (its choices live in the layers' tables: see `describe`)."""

    shapes: int  # distinct weight shapes timed
    pairs: int  # (shape, rows) pairs timed


def tune(layers: Iterable[Tunable], rows: Sequence[int], timer: Timer) -> Tuned:
    """Fill each layer's `blas_by_rows` (rows -> library) for every row count in `rows`.

    `layers` are modules with a 2-D `weight` and a dict `blas_by_rows` (the linear layers and
    the LM head); layers with equal weight shape and dtype share one timing. Only cuBLASLt's
    wins are stored: a missing entry means the default. Timed without bias: with one, torch's
    addmm may take cuBLASLt's bias epilogue whatever the preference."""
    groups: Dict[Tuple[Tuple[int, ...], torch.dtype], List[Tunable]] = {}
    for layer in layers:
        groups.setdefault((tuple(layer.weight.shape), layer.weight.dtype), []).append(layer)
    for (shape, dtype), members in groups.items():
        weight = members[0].weight
        for n in rows:
            x = torch.randn(n, shape[1], dtype=dtype, device=weight.device)
            choice = pick({lib: timer(x, weight, lib) for lib in LIBRARIES})
            for layer in members:
                if choice == DEFAULT:
                    layer.blas_by_rows.pop(n, None)
                else:
                    layer.blas_by_rows[n] = choice
    return Tuned(len(groups), len(groups) * len(rows))


def tunable_layers(model: torch.nn.Module) -> List[Tunable]:
    """The modules `tune` applies to: those carrying a `blas_by_rows` table whose weight is in
    a BLAS dtype (FP8 and packed integer layers run their own GEMMs: layers/fp8.py,
    layers/packed.py)."""
    return [cast(Tunable, m) for m in model.modules()
            if isinstance(getattr(m, "blas_by_rows", None), dict)
            and getattr(m, "packed", None) is None and m.weight.dtype != torch.float8_e4m3fn]


def describe(model: torch.nn.Module) -> str:
    """The model's cuBLASLt choices as `out x in @ rows` items ("none": all cuBLAS)."""
    pairs = sorted({(tuple(m.weight.shape), n) for m in tunable_layers(model)
                    for n in m.blas_by_rows})
    return ", ".join(f"{o}x{i}@{n}" for (o, i), n in pairs) or "none"
