"""Argmax over the rows of a matrix in Triton: the sampler's greedy pick on CUDA. This module
imports triton: only GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, n, stride_x, num_chunks,
                         BLOCK: tl.constexpr):
    """Program (row, chunk): the largest value of x[row, chunk*BLOCK:(chunk+1)*BLOCK] and its
    first index."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    # NaN is the largest value, as torch.argmax has it: NaN compares false, and a reduction
    # meeting it could end on a masked lane past the vocabulary (a token id no embedding has).
    x = tl.where(x != x, float("inf"), x)
    val, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, val)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + idx)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """Program row: the chunk with the largest value, the earliest on ties (chunks are in index
    order, so this is the first index of the row's maximum, as torch.argmax returns)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    vals = tl.load(val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    _, best = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + best).to(tl.int64))


_ARGMAX_BLOCK = 4096


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [B, N] (rows with unit column stride), int64 [B]: the first
    index of each row's maximum. Two launches: chunks of 4,096 columns in parallel, then a merge,
    because torch's one-block-per-row reduction leaves the GPU almost idle on a batch-1 row of a
    large vocabulary. A row holding NaN or +inf gives the first index of either (torch gives
    the first NaN's), always inside the row: an overflowed row samples a real token id."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows takes [rows, columns] with unit column stride, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    rows, n = x.shape
    chunks = triton.cdiv(n, _ARGMAX_BLOCK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](x, vals, idx, n, x.stride(0), chunks,
                                         BLOCK=_ARGMAX_BLOCK, num_warps=8)
    _argmax_merge_kernel[(rows,)](vals, idx, out, chunks,
                                  BLOCK_C=max(2, triton.next_power_of_2(chunks)))
    return out
