"""The `allreduce` setting's modes and their check (torch-free: the engine's config, which the
launcher reads, validates the setting before any rank starts)."""

from __future__ import annotations

# "symm-fused": "symm", plus the all-reduce fused with the residual add and RMSNorm that follow
# it (SymmMemAllReduce.all_reduce_rmsnorm). Opt-in until measured; "auto" never fuses.
# "ordered": every rank gathers the partials and adds them in rank order in float32, rounded
# once: each element's bits depend on the ranks' partials alone, never on the tensor's size
# (deterministic inference past two ranks; NCCL's algorithm, and so its order, follows size).
ALLREDUCE_MODES = ("auto", "nccl", "symm", "symm-fused", "ordered")
SYMM_MODES = ("symm", "symm-fused")  # symmetric memory required: start-up fails without it


def check_allreduce_mode(mode: str, device_type: str) -> None:
    """Raise ValueError for an unknown mode, or for 'symm' / 'symm-fused' off CUDA (symmetric
    memory is CUDA only; 'auto' is the mode that quietly uses gloo / NCCL where it is
    unavailable)."""
    if mode not in ALLREDUCE_MODES:
        raise ValueError(f"allreduce must be one of {', '.join(ALLREDUCE_MODES)}, got {mode!r}")
    if mode in SYMM_MODES and device_type != "cuda":
        raise ValueError(f"allreduce {mode!r} needs CUDA (symmetric memory), but the device is "
                         f"{device_type!r}; use 'auto' or 'nccl'")
