"""One Triton kernel for "all-reduce, add the residual, RMSNorm" over symmetric memory.

Each rank's program p stages its rows of the partial sum into its own symmetric buffer, meets
program p of every peer at a barrier, loads the rows from every rank's buffer with plain
peer-to-peer loads (never multicast), sums them in float32 in rank order 0..W-1 (so every rank
gets the same bits), rounds to the dtype, adds the residual, stores the new residual, and applies
the RMSNorm of rmsnorm.py (the shared `rmsnorm_row_store`, launched as wide), then
meets its peers again so that the next call may overwrite the buffers. Program p handles rows
p, p + G, ... of G = min(rows, max_programs) programs; G is small enough that every program of
every rank is resident at once, which the barriers need.

Barrier (per program pair, cf. the blockwise barrier of PyTorch's symmetric-memory tests): rank
r's flag for peer q, program p, is the int32 at flags(r)[p * W + q], in the buffer right after
the staging bytes. To signal, q CASes that flag 0 -> 1 (release, system scope); to wait, r CASes
it 1 -> 0 (acquire, system scope). A flag is back at 0 once its barrier is passed, so nothing
needs resetting between calls or CUDA-graph replays; a second signal before the first was taken
waits for it, so signals on one flag are taken in the order they were sent. A CTA barrier before
each signal orders every thread's staging stores (or peer loads) before it; Triton runs a scalar
atomic on one thread and broadcasts its result, so every spin loop is uniform over the block.
Peer rows are loaded volatile (relaxed, system scope), never from a stale L1 line.

Every spin is bounded (`spin_limit` failed tries per flag): a barrier that gives up sets a bit in
the error word (1: opening barrier, 2: closing) and, on a GPU, traps, which ends the process with
a CUDA error instead of a hang. The CPU interpreter (tests) only sets the bit.

This module imports triton; only `SymmMemAllReduce.all_reduce_rmsnorm` (distributed/
symm_allreduce.py) and tests import it.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from minisgl.kernels.pdl import launch_options, pdl_enter
from minisgl.kernels.rmsnorm import rmsnorm_row_store, rmsnorm_warps
from minisgl.kernels.types import PeerBuffers

# Programs per call (and flag slots per peer). At most this many CTAs of up to 16 warps must be
# resident together on each GPU: 128 fits on any GPU with 64 or more SMs.
MAX_PROGRAMS = 128
_FLAG_BYTES = 4  # one int32 per (program, peer)


def flag_bytes(world: int) -> int:
    """Bytes of flags the kernel keeps after the staging bytes of each rank's buffer."""
    return MAX_PROGRAMS * world * _FLAG_BYTES


@triton.jit
def _rows_of(stage_ptr, ptrs, rank, q):
    """Rank q's staging rows, as an offset from this rank's (`stage_ptr`, a kernel argument of
    known alignment): a pointer loaded from memory has none, and its loads would not vectorize
    like the local ones (another layout, another reduction order than rmsnorm.rmsnorm).
    Symmetric buffers are page aligned, so the distance is a multiple of 16 elements."""
    elt_bytes = stage_ptr.dtype.element_ty.primitive_bitwidth // 8  # a compile-time int
    delta = (tl.load(ptrs + q) - tl.load(ptrs + rank)) // elt_bytes
    return stage_ptr + tl.multiple_of(delta, 16)


@triton.jit
def _flags_of(ptrs, q, staging_bytes):
    return (tl.load(ptrs + q) + staging_bytes).to(tl.pointer_type(tl.int32))


@triton.jit
def _spin_cas(ptr, expect, new, spin_limit, SEM: tl.constexpr):
    """CAS *ptr from expect to new at system scope, retrying while it holds something else, at
    most spin_limit times; 1 if it swapped, 0 if it gave up."""
    tries = spin_limit * 0
    old = tl.atomic_cas(ptr, expect, new, sem=SEM, scope="sys")
    while (old != expect) & (tries < spin_limit):
        tries += 1
        old = tl.atomic_cas(ptr, expect, new, sem=SEM, scope="sys")
    return (old == expect).to(tl.int32)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("mov.u32 $0, 0; trap;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _barrier(ptrs, staging_bytes, slot, rank, spin_limit, err_ptr, CODE: tl.constexpr,
             WORLD: tl.constexpr, TRAP: tl.constexpr):
    """Meet program `slot` of every peer (module docstring). Memory operations of this program
    before the call happen before those of the peers' programs after theirs."""
    tl.debug_barrier()  # every thread's stores and loads so far, before the release below
    missed = 0
    mine = _flags_of(ptrs, rank, staging_bytes) + slot * WORLD
    for d in tl.static_range(1, WORLD):
        peer = (rank + d) % WORLD
        theirs = _flags_of(ptrs, peer, staging_bytes) + slot * WORLD
        missed += 1 - _spin_cas(theirs + rank, 0, 1, spin_limit, "release")
    for d in tl.static_range(1, WORLD):
        peer = (rank + d) % WORLD
        missed += 1 - _spin_cas(mine + peer, 1, 0, spin_limit, "acquire")
    if missed != 0:
        tl.atomic_or(err_ptr, CODE)
        if TRAP:
            _trap()


@triton.jit
def _all_reduce_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stage_ptr, ptrs,
                               err_ptr, rows, n_cols, staging_bytes, rank, spin_limit, eps,
                               WORLD: tl.constexpr, BLOCK: tl.constexpr, TRAP: tl.constexpr,
                               PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    for row in range(pid, rows, programs):
        off = tl.cast(row, tl.int64) * n_cols
        tl.store(stage_ptr + off + cols, tl.load(x_ptr + off + cols, mask=mask), mask=mask)
    _barrier(ptrs, staging_bytes, pid, rank, spin_limit, err_ptr, 1, WORLD, TRAP)
    for row in range(pid, rows, programs):
        off = tl.cast(row, tl.int64) * n_cols
        # Rank 0's row first (not 0.0 + it: that would turn a -0.0 into +0.0), then 1..W-1.
        total = tl.load(_rows_of(stage_ptr, ptrs, rank, 0) + off + cols, mask=mask, other=0.0,
                        volatile=True).to(tl.float32)
        for q in tl.static_range(1, WORLD):
            total += tl.load(_rows_of(stage_ptr, ptrs, rank, q) + off + cols, mask=mask, other=0.0,
                             volatile=True).to(tl.float32)
        # Round the sum first, then add in the dtype: what all-reduce + rmsnorm do.
        x = total.to(x_ptr.dtype.element_ty) + tl.load(res_ptr + off + cols, mask=mask,
                                                       other=0.0)
        tl.store(res_out_ptr + off + cols, x, mask=mask)
        rmsnorm_row_store(x, w_ptr, out_ptr + off, cols, mask, n_cols, eps)
    _barrier(ptrs, staging_bytes, pid, rank, spin_limit, err_ptr, 2, WORLD, TRAP)


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       peers: PeerBuffers, pdl: bool = False, max_programs: int = MAX_PROGRAMS
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum over ranks of x + residual) * weight, that sum plus residual), new tensors.

    Collective: every rank of `peers` calls it in the same order with the same shapes, dtype
    and `max_programs` (program p pairs with program p of every peer). The caller checks the
    fit: x and residual contiguous, the same shape and dtype, at most `peers.staging_bytes`
    bytes; weight [last dim]. Issue calls on one stream; capturable in a CUDA graph (one
    launch, outputs from the caching allocator)."""
    n_cols = x.shape[-1]
    rows = x.numel() // n_cols
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    _all_reduce_rmsnorm_kernel[(min(rows, max_programs),)](
        x, residual, weight, out, res_out, peers.buffer.view(x.dtype), peers.ptrs, peers.errors,
        rows, n_cols,
        peers.staging_bytes, peers.rank, peers.spin_limit, eps, WORLD=peers.world, BLOCK=block,
        TRAP=peers.trap, PDL=pdl, num_warps=rmsnorm_warps(block), **launch_options(pdl))
    return out, res_out
