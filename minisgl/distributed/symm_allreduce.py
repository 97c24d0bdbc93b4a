"""One-shot all-reduce (sum) over PyTorch symmetric memory: CUDA peer-to-peer loads, no multicast.

Why: at decode the tensor-parallel all-reduces are tiny (hidden 4096 in bfloat16 is 8 KB per
token, 2 MiB at batch 256) and NCCL's fixed cost per call dominates them. Here every rank owns
one buffer that every peer has mapped into its address space (CUDA IPC, set up once by
`rendezvous`); an all-reduce is ONE kernel, `torch.ops.symm_mem.one_shot_all_reduce_copy`: it
copies the local input into this rank's buffer, meets the peers at a device-side barrier, loads
every peer's buffer over NVLink, writes the sum to a new tensor, and meets the peers again (so the
next call may overwrite the buffer).

Never multicast: the one-shot kernel only does plain peer loads, and before allocating we force
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 so the allocator never creates a multicast object either
(NVLink SHARP / cuMulticastCreate is unsupported or forbidden on the machines we run on).

Contract:
- Allocation: `SymmMemAllReduce.create` is a collective. Every rank of the group calls it once,
  after the process groups exist and before any CUDA graph that should use it is captured. It
  owns one buffer of `max_bytes` bytes on `device`; the ranks agree (over the gloo control group)
  so that either every rank gets an instance or every rank gets None and the same reason.
- Calls: `all_reduce` is a collective. Every rank calls it in the same order with tensors of the
  same shape, dtype and layout (the lockstep invariant guarantees this for the forward pass).
  Whether a tensor fits depends only on those, so every rank takes the same path.
- Streams: calls share one buffer and one set of signal pads, so they must be issued on one
  stream at a time (the forward pass runs on one stream).
- CUDA graphs: a call is one kernel launch, no host synchronization, and its output comes from
  the caching allocator (the graph's pool during capture), so it can be captured; a captured call
  refers to this object's buffer, which lives as long as the object.

`all_reduce_rmsnorm` (mode "symm-fused") goes one step further: one Triton kernel
(kernels/allreduce.py) stages, sums in rank order, adds the residual and applies the RMSNorm, with
its own barrier flags after the staging bytes of the same buffer (never torch's signal pads, so
the two kinds of call cannot take each other's signals). The same contract holds for it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import PeerBuffers

logger = logging.getLogger(__name__)

# Largest tensor (bytes) sent through symmetric memory; bigger ones (prefill) use NCCL. 2 MiB is
# the decode batch of 256 tokens at hidden 4096 in bfloat16 (the default largest decode graph of
# an 8B model); beyond that one-shot reads grow with the world size while NCCL's fixed cost stops
# mattering. It also sizes the one buffer each rank allocates. Retune: scripts/bench_allreduce.py.
DEFAULT_SYMM_MAX_BYTES = 2 << 20
# The dtypes the symm_mem reduce kernels dispatch on (AT_DISPATCH_FLOAT_AND_BFLOAT16).
SYMM_DTYPES = (torch.bfloat16, torch.float32)
# The kernel vectorizes by the alignment of the input's offset and size; we take only 16-byte
# aligned tensors, so the local input and the buffer view always agree (the op checks that).
_ALIGN = 16
_OP = "one_shot_all_reduce_copy"
# The fused kernel holds a row in registers (one program per row); wider rows use the two-kernel
# path. Llama-3.1-70B's hidden size is 8192.
_FUSED_MAX_COLS = 16384
# Failed tries of one barrier flag before the fused kernel gives up and traps. Uncalibrated:
# tens of seconds if a try (a system-scope CAS plus two CTA barriers) costs about a microsecond.
# A live peer can be seconds late (its first call JIT-compiles the kernel); a dead or diverged
# one never comes.
DEFAULT_SPIN_LIMIT = 1 << 26


def symm_mem_problem(device: torch.device) -> Optional[str]:
    """Why this process cannot use symmetric-memory all-reduce on `device` (None: it can).
    Local checks only; peers are checked by `SymmMemAllReduce.create`."""
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({e})"
    missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
    if missing:
        return f"torch {torch.__version__}: _symmetric_memory lacks {', '.join(missing)}"
    if not hasattr(torch.ops.symm_mem, _OP):
        # The plain one-shot op (no copy) is not a substitute: older versions of its kernel
        # have no closing barrier, so reusing the buffer for the next call could race a peer.
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{_OP}"
    return None


def _peer_problem(device: torch.device, devices: Sequence[int], rank: int) -> Optional[str]:
    """Why this rank cannot load from every peer's device (engine ranks see every GPU)."""
    for peer, index in enumerate(devices):
        if peer == rank:
            continue
        if index == device.index:
            return f"ranks {rank} and {peer} share cuda:{index}"
        if index < torch.cuda.device_count() and not torch.cuda.can_device_access_peer(
                device.index, index):
            return f"cuda:{device.index} cannot access cuda:{index} peer-to-peer"
    return None


def _gather(value: Any, cpu_group: dist.ProcessGroup) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(out, value, group=cpu_group)
    return out


def _agree(problem: Optional[str], cpu_group: dist.ProcessGroup) -> Optional[str]:
    """The first rank's problem, the same on every rank (every rank must call it)."""
    for rank, p in enumerate(_gather(problem, cpu_group)):
        if p is not None:
            return f"rank {rank}: {p}"
    return None


def _use_cuda_backend(symm_mem: Any, device: torch.device) -> None:
    """Select the CUDA (not NVSHMEM / NCCL) symmetric-memory backend where torch offers a
    choice; raise if another backend is already fixed for this device."""
    if hasattr(symm_mem, "set_backend"):
        try:
            symm_mem.set_backend("CUDA")
        except Exception:  # noqa: BLE001 - fixed once something was allocated; checked below
            pass
    try:
        backend = symm_mem.get_backend(device)
    except Exception:  # noqa: BLE001 - absent in this torch, or nothing chosen yet
        backend = None
    if backend not in (None, "CUDA"):
        raise RuntimeError(f"the symmetric-memory backend of {device} is {backend}, not CUDA")


class SymmMemAllReduce:
    """One symmetric buffer and the one-shot all-reduce through it (see the module docstring);
    with `fused`, also the all-reduce fused with residual add and RMSNorm."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int,
                 fused: bool = False, spin_limit: int = DEFAULT_SPIN_LIMIT) -> None:
        """Allocate and rendezvous (collective). Prefer `create`, which keeps ranks agreed."""
        if max_bytes < _ALIGN or max_bytes % _ALIGN:
            raise ValueError(f"max_bytes must be a positive multiple of {_ALIGN}, got {max_bytes}")
        import torch.distributed._symmetric_memory as symm_mem
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # never create multicast objects
        _use_cuda_backend(symm_mem, device)
        self.group_name: str = group.group_name
        self.device = device
        self.max_bytes = max_bytes
        world = dist.get_world_size(group)
        flags = _fused_flag_bytes(world) if fused else 0
        with torch.cuda.device(device):
            self.buffer = symm_mem.empty(max_bytes + flags, dtype=torch.uint8, device=device)
            if fused:  # the flags start at zero; `create` agrees before any rank may signal
                self.buffer[max_bytes:].zero_()
                torch.cuda.synchronize(device)
            self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.peers = self._peers(world, spin_limit) if fused else None

    def _peers(self, world: int, spin_limit: int) -> PeerBuffers:
        """The fused kernel's view of every rank's buffer."""
        ptrs = _buffer_ptrs(self.handle, world)
        if ptrs[self.handle.rank] != self.buffer.data_ptr():
            raise RuntimeError("symmetric memory: this rank's entry of buffer_ptrs is not its "
                               "own buffer")
        return PeerBuffers(self.buffer, torch.tensor(ptrs, dtype=torch.int64, device=self.device),
                           self.handle.rank, world, self.max_bytes,
                           torch.zeros(1, dtype=torch.int32, device=self.device), spin_limit,
                           trap=True)

    @classmethod
    def create(cls, group: dist.ProcessGroup, cpu_group: dist.ProcessGroup,
               device: torch.device, max_bytes: int = DEFAULT_SYMM_MAX_BYTES,
               fused: bool = False) -> Tuple[Optional["SymmMemAllReduce"], Optional[str]]:
        """(instance, None) on every rank, or (None, the same reason) on every rank.

        Collective over `group` (whose name the ops use) and `cpu_group` (gloo, for agreeing);
        the two must hold the same ranks in the same order. `fused`: also set up
        `all_reduce_rmsnorm` (every rank must pass the same)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        rank = dist.get_rank(cpu_group)
        devices = _gather(device.index if device.type == "cuda" else -1, cpu_group)
        problem = symm_mem_problem(device) or _peer_problem(device, devices, rank)
        problem = _agree(problem, cpu_group)
        if problem is not None:
            return None, problem
        instance: Optional[SymmMemAllReduce] = None
        try:
            instance = cls(group, device, max_bytes, fused)
        except Exception as e:  # noqa: BLE001 - any failure here means "use NCCL"
            problem = f"{type(e).__name__}: {e}"
        problem = _agree(problem, cpu_group)
        if problem is not None:
            return None, problem
        return instance, None

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` takes this path. Depends only on x's device, dtype, shape and
        layout, so every rank of a lockstep forward pass decides the same."""
        nbytes = x.numel() * x.element_size()
        return (x.device == self.device and x.dtype in SYMM_DTYPES and x.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % _ALIGN == 0
                and (x.storage_offset() * x.element_size()) % _ALIGN == 0)

    def all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum of x over ranks in a new tensor (x is left unchanged), or None without any
        communication when x does not fit (the caller then uses NCCL)."""
        if not self.fits(x):
            return None
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)

    def fits_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `all_reduce_rmsnorm` takes the fused path. Like `fits`, it depends only on
        devices, dtypes, shapes and layouts, so every rank decides the same."""
        return (self.peers is not None and self.fits(x) and x.shape[-1] <= _FUSED_MAX_COLS
                and residual.shape == x.shape and residual.dtype == x.dtype
                and residual.device == x.device and residual.is_contiguous()
                and weight.shape == (x.shape[-1],) and weight.device == x.device
                and weight.is_contiguous())

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, policy: KernelPolicy = KernelPolicy()
                           ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(rmsnorm(sum of x over ranks + residual) * weight, that sum + residual) in new
        tensors, one kernel; the same bits as `all_reduce` then `kernels.rmsnorm.rmsnorm` at two
        ranks (float32 sums in rank order and one rounding, so beyond two ranks the sum may
        differ from the one-shot op's in the last bit, but never between ranks). None, without
        any communication, when it does not fit (then use the two-step path). A collective:
        same contract as `all_reduce`. `policy.pdl`: launch with programmatic dependent launch."""
        if self.peers is None or not self.fits_rmsnorm(x, residual, weight):
            return None
        from minisgl.kernels import allreduce
        return allreduce.all_reduce_rmsnorm(x, residual, weight, eps, self.peers, policy.pdl)


def _fused_flag_bytes(world: int) -> int:
    from minisgl.kernels.allreduce import flag_bytes
    return flag_bytes(world)


def _buffer_ptrs(handle: Any, world: int) -> List[int]:
    """Every rank's buffer address in this process (index = rank)."""
    ptrs = getattr(handle, "buffer_ptrs", None)
    if ptrs is not None:
        return [int(p) for p in ptrs]
    return [handle.get_buffer(r, (1,), torch.uint8).data_ptr() for r in range(world)]
