"""Programmatic dependent launch (PDL) for the Triton kernels of the decode path (Hopper and newer).

A kernel launched with PDL may start while the kernel before it in the stream is still finishing;
it must execute `gdc_wait` (which returns once that kernel has completed and its writes are
visible) before it reads or writes anything earlier kernels touch. Every PDL kernel here executes
it, so ordering stays transitive along a chain of them; kernels without PDL (cuBLAS, NCCL, torch)
keep ordinary stream order. This module imports triton: only GPU kernel modules import it.

What a kernel may read before its wait: parameters (weights, scales, constant tables) and the
step's inputs (positions, slots, the page table, lengths), which are complete before the forward
pass's first kernel (the embedding lookup, an ordinary launch) starts. Never activations, nor
the KV pool's newest tokens.
"""

from __future__ import annotations

from typing import Dict

import triton
import triton.language as tl


def launch_options(pdl: bool) -> Dict[str, bool]:
    """Extra Triton launch arguments: PDL where asked for."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (PDL only). Call
    it in every program before any load of data another kernel writes, and before any store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
