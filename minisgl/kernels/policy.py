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
    which the engine checks. `l2_prefetch`: bytes of the next projections' weights that a
    small batch's decode attention warms into L2 (kernels/prefetch.py); 0: none. It needs PDL
    (the same compute capability, 9.0+, for the bulk prefetch). The default policy is torch ops
    everywhere."""

    fused: bool = False
    pdl: bool = False
    l2_prefetch: int = 0

    def __post_init__(self) -> None:
        if self.pdl and not self.fused:
            raise ValueError(f"KernelPolicy(pdl={self.pdl}) needs fused=True (got "
                             f"fused={self.fused}): PDL launches the fused kernels")
        if self.l2_prefetch < 0 or (self.l2_prefetch and not self.pdl):
            raise ValueError(f"KernelPolicy(l2_prefetch={self.l2_prefetch}) needs a byte count "
                             f">= 0, and pdl=True where it is not 0 (got pdl={self.pdl})")

    @property
    def gemv(self) -> bool:
        """Whether one-token projections (batch-1 decode) run the Triton GEMV (with the norm
        before them and the rotary / SiLU after them fused in where those apply). Only with PDL:
        without it the GEMV merely ties cuBLAS inside the model; with it
        each GEMV's first weight tile streams while the previous kernel finishes."""
        return self.pdl
