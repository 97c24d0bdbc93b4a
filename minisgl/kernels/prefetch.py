"""Warming weights into the GPU's L2 cache from a latency-bound kernel (Hopper and newer).

At small decode batches the attention kernels read little (a 512-token context is ~1 MB a
layer) and take microseconds of latency, during which the memory is idle; the projection after
them (o_proj, then the MLP's gate/up) is pure weight streaming. The attention kernel therefore
issues bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, fire-and-forget: no registers, no
result) of the first bytes those projections will read, so that their first loads hit L2.

A prefetch changes no value anywhere: weights are never written during a forward pass, so it
may be issued before the kernel's PDL wait. The plan is made on the host (`plan_l2_prefetch`)
from the tensors' addresses, which a CUDA graph records like any scalar argument (the weights
never move). This module imports triton: only GPU kernel modules import it, and the interpreter
(TRITON_INTERPRET=1) cannot run the inline assembly, so CPU runs never turn it on.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import torch
import triton
import triton.language as tl

MAX_RANGES = 3  # the kernel argument slots: o_proj, and gate/up's gate and up halves
_ALIGN = 16  # the bulk prefetch's address and size granularity
_MIN_CHUNK = 1024  # bytes one prefetch instruction covers, at least


class L2Prefetch(NamedTuple):
    """Up to MAX_RANGES byte ranges to prefetch, cut into `chunk`-byte prefetches numbered
    across the launch: range i's prefetches are elements [firsts[i], firsts[i] + its count) of
    the program-major numbering (program p owns elements [p * per_program, (p + 1) *
    per_program)). Unused ranges have nbytes 0. Every address and size is 16-byte aligned."""

    addrs: Tuple[int, int, int]
    nbytes: Tuple[int, int, int]
    firsts: Tuple[int, int, int]
    chunk: int

    @property
    def total(self) -> int:
        return sum(self.nbytes)


def prefetch_ranges(tensors: Sequence[torch.Tensor], budget: int) -> Tuple[Tuple[int, int], ...]:
    """(address, bytes) of the leading bytes of each tensor (each dense), in order of need,
    within `budget` bytes: the first tensor as much as fits, the rest share what is left
    evenly (they are read side by side: gate/up's program p reads gate rows and up rows alike).
    Sizes are rounded down to 16 bytes; empty ranges are dropped."""
    if len(tensors) > MAX_RANGES:
        raise ValueError(f"at most {MAX_RANGES} tensors to prefetch, got {len(tensors)}")
    out = []
    left = max(budget, 0)
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"prefetch needs dense tensors; got strides {t.stride()} for "
                             f"shape {tuple(t.shape)}")
        share = left if i == 0 else left // (len(tensors) - i)
        size = min(t.numel() * t.element_size(), share) // _ALIGN * _ALIGN
        if t.data_ptr() % _ALIGN or size <= 0:
            continue
        out.append((t.data_ptr(), size))
        left -= size
    return tuple(out)


def plan_l2_prefetch(ranges: Sequence[Tuple[int, int]], programs: int,
                     per_program: int) -> L2Prefetch:
    """Cut `ranges` into prefetches for a launch of `programs` programs of `per_program`
    elements each (one per thread: 32 x num_warps), as few and as large as fit."""
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"at most {MAX_RANGES} prefetch ranges, got {len(ranges)}")
    slots = max(programs * per_program, 1)
    total = sum(n for _, n in ranges)
    chunk = max(_MIN_CHUNK, triton.cdiv(triton.cdiv(total, slots), _MIN_CHUNK) * _MIN_CHUNK)
    while sum(triton.cdiv(n, chunk) for _, n in ranges) > slots:  # each range rounds up
        chunk += _MIN_CHUNK
    addrs, sizes, firsts = [0] * MAX_RANGES, [0] * MAX_RANGES, [0] * MAX_RANGES
    first = 0
    for i, (addr, n) in enumerate(ranges):
        addrs[i], sizes[i], firsts[i] = addr, n, first
        first += triton.cdiv(n, chunk)
    return L2Prefetch(tuple(addrs), tuple(sizes), tuple(firsts), chunk)  # type: ignore[arg-type]


NO_PREFETCH = L2Prefetch((0, 0, 0), (0, 0, 0), (0, 0, 0), _MIN_CHUNK)


@triton.jit
def _bulk_prefetch(addr, size):
    """Prefetch `size` bytes (16-byte multiple) at `addr` into L2 where size > 0."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.b32 $0, 0;\n}",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_span(e, nbytes, first, chunk):
    """Elements `e`' byte offsets into a range of `nbytes` whose prefetches start at element
    `first`, and their sizes (0 outside the range)."""
    off = (e - first).to(tl.int64) * chunk
    size = tl.where(e >= first, tl.minimum(tl.maximum(nbytes - off, 0), chunk), 0)
    return off, size.to(tl.int32)


@triton.jit
def _prefetch_range(e, addr, nbytes, first, chunk):
    off, size = prefetch_span(e, nbytes, first, chunk)
    _bulk_prefetch(addr + off, size)


@triton.jit
def l2_prefetch(program, a0, n0, f0, a1, n1, f1, a2, n2, f2, chunk, PER_PROGRAM: tl.constexpr):
    """This program's share of an L2Prefetch plan (its fields passed flat); `program` its
    program-major index. Issue it before the PDL wait: it reads nothing another kernel writes."""
    e = program * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    _prefetch_range(e, a0, n0, f0, chunk)
    _prefetch_range(e, a1, n1, f1, chunk)
    _prefetch_range(e, a2, n2, f2, chunk)


def prefetch_args(plan: L2Prefetch) -> Tuple[int, ...]:
    """The plan's fields in l2_prefetch's argument order (after `program`)."""
    return (*(x for i in range(MAX_RANGES)
              for x in (plan.addrs[i], plan.nbytes[i], plan.firsts[i])), plan.chunk)
