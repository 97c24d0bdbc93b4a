"""What one rank's engine is built from (identical on every rank except `tp_info.rank`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minisgl.distributed import DistributedInfo, check_allreduce_mode


PDL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tp_info: DistributedInfo
    device: str = "cpu"  # "cpu" or "cuda" (rank r uses cuda:r)
    dtype: torch.dtype = torch.float32
    page_size: int = 16
    max_running_requests: int = 256
    max_kv_tokens: Optional[int] = None  # KV pool capacity; None: CPU 16384, GPU mem_fraction
    mem_fraction: float = 0.85  # of the GPU memory free after weights, for the KV pool
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)
    attention_backend: str = "auto"  # "auto", "torch" or "triton"
    seed: int = 0
    fused_ops: bool = True  # fused Triton RMSNorm / SiLU-and-mul / rotary (CUDA only)
    # Programmatic dependent launch for the decode path's Triton kernels, and one-token
    # projections by a Triton GEMV that streams its weights while the previous kernel finishes,
    # with the norm / rotary / SiLU around them fused in (minisgl/pdl.py, layers/triton_gemv.py):
    # "auto" (on where it can be: CUDA, fused_ops, compute capability 9.0+; batch-1 decode of
    # the 8B shape on an H200 4.519 -> 4.392 ms, then 4.19 with the fusions,
    # benchmarks/RESULTS.md), "on" (required: start-up fails where it cannot be) or "off".
    pdl: str = "auto"
    cuda_graph_max_bs: int = 256  # decode CUDA graphs up to this batch size (0: off; GPU only)
    # TP all-reduce: "auto" (symmetric-memory one-shot for small tensors where CUDA offers it,
    # else NCCL / gloo), "nccl" (always the process group's own), "symm" (required; CUDA
    # only) or "symm-fused" ("symm", and each o_proj / down_proj all-reduce fused with the
    # residual add and RMSNorm after it into one Triton kernel; needs fused_ops; bit-identical
    # to "symm"; opt-in until its end-to-end tp=2 run). On 2x H200, per call in a graph: NCCL
    # 22.4 us, one-shot 6.4, one-shot + RMSNorm 7.9, fused 6.9 at one token (at 256: 48.0,
    # 24.1, 27.6, 15.6; benchmarks/RESULTS.md).
    allreduce: str = "auto"
    # Time cuBLAS against cuBLASLt for every projection shape at every decode graph size at
    # start-up and run each GEMM by the faster (layers/blas.py; the decode CUDA graphs record
    # the choice, so CUDA and the Triton backend only). Off by default: it gained 0.3% offline
    # (RESULTS.md, tenth session), and a timed choice can differ between runs, and with it the
    # bf16 rounding.
    tune_gemms: bool = False
    dist_init_method: str = "tcp://127.0.0.1:29500"
    dist_timeout_s: float = 60.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        check_allreduce_mode(self.allreduce, self.device)
        if self.pdl not in PDL_MODES:
            raise ValueError(f"pdl must be one of {', '.join(PDL_MODES)}, got {self.pdl!r}")
        if self.pdl == "on" and (self.device != "cuda" or not self.fused_ops):
            raise ValueError(f"pdl 'on' needs device 'cuda' and fused_ops (got device "
                             f"{self.device!r}, fused_ops {self.fused_ops}); use 'auto' or 'off'")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0 (0: no graphs), got "
                             f"{self.cuda_graph_max_bs}")
        if self.tune_gemms and (self.device != "cuda" or self.cuda_graph_max_bs < 1
                                or self.backend_name != "triton"):
            # Graphs are captured with the Triton backend only (engine/cuda_graph.py).
            raise ValueError(f"tune_gemms tunes the decode CUDA graphs' GEMMs and needs device "
                             f"'cuda' with cuda_graph_max_bs >= 1 and the triton attention "
                             f"backend (got device {self.device!r}, cuda_graph_max_bs "
                             f"{self.cuda_graph_max_bs}, attention backend "
                             f"{self.backend_name!r})")
        if self.allreduce == "symm-fused" and not self.fused_ops:
            raise ValueError("allreduce 'symm-fused' fuses the all-reduce into the Triton "
                             "RMSNorm and needs fused_ops; use 'symm' without them")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", self.tp_info.rank)
        return torch.device(self.device)

    @property
    def backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device == "cuda" else "torch"
