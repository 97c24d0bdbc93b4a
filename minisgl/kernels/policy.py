"""Which Triton kernels a model launches: one policy per engine, decided once at start-up
(engine.kernel_policy) and handed down to every layer, the attention backend, the fused
all-reduce and the sampler. It imports nothing but the standard library, so callers import it at
the top.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelPolicy:
    """`fused`: on CUDA tensors, the Triton RMSNorm (with the residual add), SiLU-and-mul, rotary
    embedding (with the K/V store) and argmax instead of torch ops; CPU tensors always take the
    torch ops. `pdl`: the decode path's Triton kernels launch with programmatic dependent launch
    (kernels/pdl.py), and one-token projections take the Triton GEMV (`gemv`). PDL needs `fused`
    (the kernels it launches are the fused ones) and a GPU of compute capability 9.0 or newer,
    which the engine checks. `batch_invariant` (deterministic inference): every projection
    takes the order-fixed GEMM (layers/blas.invariant_linear, on CPU too: routers, experts and
    LoRA deltas as well, the experts through the torch path) and the Triton attention runs
    every token through the extend kernel (keys in one tiling), so that a row's bits do not
    depend on the rows beside it; it excludes PDL, whose GEMV serves one row only. The default
    policy is torch ops everywhere."""

    fused: bool = False
    pdl: bool = False
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.pdl and not self.fused:
            raise ValueError(f"KernelPolicy(pdl={self.pdl}) needs fused=True (got "
                             f"fused={self.fused}): PDL launches the fused kernels")
        if self.pdl and self.batch_invariant:
            raise ValueError("KernelPolicy(batch_invariant=True) excludes pdl: its one-row "
                             "GEMV rounds otherwise than the rows of a larger batch")

    @property
    def gemv(self) -> bool:
        """Whether one-token projections (batch-1 decode) run the Triton GEMV (with the norm
        before them and the rotary / SiLU after them fused in where those apply). Only with PDL:
        without it the GEMV merely ties cuBLAS inside the model; with it
        each GEMV's first weight tile streams while the previous kernel finishes."""
        return self.pdl
