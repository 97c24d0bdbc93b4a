"""Tensor-parallel collectives (NCCL on CUDA, gloo on CPU) and the gloo control group.

`Communicator` is what layers call inside a forward pass; with one rank every call is the identity.
`init_process_groups` joins the ranks with a timeout, so a dead peer ends a collective with an
error instead of a hang. On CUDA it can also set up the one-shot symmetric-memory all-reduce
(symm_allreduce.py), which `Communicator.all_reduce` uses for small tensors (decode) instead of
NCCL; the `allreduce` mode picks: "auto" (symmetric memory where available, else NCCL, with one
log line saying why), "nccl" (the process group's own all-reduce: NCCL, or gloo on CPU),
"symm" (symmetric memory required: start-up fails with the reason if it is unavailable) or
"symm-fused" ("symm", plus `Communicator.all_reduce_rmsnorm`: the all-reduce, the residual add
and the RMSNorm after it in one kernel) or "ordered" (an all-gather, then the partials added in
rank order: batch-invariant at any tp, for deterministic inference).
"""

from __future__ import annotations

import datetime
import logging
import zlib
from array import array
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from minisgl.distributed.bind import address_towards, listening_socket, pin_gloo
from minisgl.distributed.info import DistributedInfo
from minisgl.distributed.store import connect, parse_tcp
from minisgl.distributed.modes import SYMM_MODES, check_allreduce_mode
from minisgl.distributed.symm_allreduce import DEFAULT_SYMM_MAX_BYTES, SymmMemAllReduce
from minisgl.kernels.policy import KernelPolicy
from minisgl.utils import checked_out

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Communicator:
    """All-reduce (sum) and all-gather over one process group; identity for a single rank.

    `symm`, when given, is the symmetric-memory all-reduce of the same ranks; tensors it takes
    (small, contiguous, bfloat16 / float32) go through it, everything else through `group`.
    `fuse_norm`: `all_reduce_rmsnorm` uses symm's fused kernel (which symm must have been
    created with). `ordered`: every all-reduce is `ordered_sum` (symm must be None)."""

    def __init__(self, info: DistributedInfo, group: Optional[dist.ProcessGroup] = None,
                 symm: Optional[SymmMemAllReduce] = None, fuse_norm: bool = False,
                 ordered: bool = False) -> None:
        if ordered and symm is not None:
            raise ValueError("the ordered all-reduce takes no symmetric-memory one")
        self.info = info
        self.group = group
        self.symm = symm
        self.fuse_norm = fuse_norm
        self.ordered = ordered

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over ranks (collective: every rank calls it in the same order with the
        same shape). Callers must use the return value: NCCL / gloo reduce `x` in place and
        return it, the symmetric-memory path returns a new tensor and leaves `x` unchanged."""
        if self.info.size == 1:
            return x
        if self.ordered:
            return self.ordered_sum(x)
        if self.symm is not None:
            out = self.symm.all_reduce(x)
            if out is not None:
                return out
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def ordered_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over ranks as rank 0's partial plus rank 1's, and so on, in float32,
        rounded once to x's dtype: each element's bits depend on the partials alone (an
        all-gather moves them unchanged), never on the tensor's size. Collective like
        `all_reduce`; returns a new tensor."""
        parts = self._gathered(x)
        total = parts[0].to(torch.float32, copy=True)
        for part in parts[1:]:
            total += part
        return total.to(x.dtype)

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float,
                           policy: KernelPolicy = KernelPolicy()
                           ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(rmsnorm(all_reduce(x) + residual) * norm_weight, all_reduce(x) + residual) in one
        fused kernel, or None, without any communication, where that kernel is off, has one
        rank or does not fit; the caller then does `all_reduce` and its own norm (layers/
        linear.py `RowParallelLinear.reduce_norm`: the norm is a layer, which this module,
        below the layers, does not import). Collective like `all_reduce`; whether it returns
        None depends only on this object and the tensors' shapes, so it is the same on every
        rank. `policy.pdl`: the kernel launches with programmatic dependent launch."""
        if self.info.size == 1 or self.symm is None or not self.fuse_norm:
            return None
        return self.symm.all_reduce_rmsnorm(x, residual, norm_weight, eps, policy)

    def all_gather_last_dim(self, x: torch.Tensor, out: Optional[torch.Tensor] = None
                            ) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order (into `out`
        where given: x's shape with tp times its last dimension, x's dtype; at tp = 1, x itself
        is the result and `out` must be unset)."""
        if self.info.size == 1:
            if out is not None:
                raise ValueError("at tp = 1 the gather returns its input; write it into `out` "
                                 "where it is computed")
            return x
        parts = self._gathered(x)
        if out is None:
            return torch.cat(parts, dim=-1)
        shape = (*x.shape[:-1], self.info.size * x.shape[-1])
        return torch.cat(parts, dim=-1, out=checked_out(out, shape, x))

    def _gathered(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's `x`, in rank order (collective)."""
        parts = [torch.empty_like(x) for _ in range(self.info.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


class ProcessGroups(NamedTuple):
    comm: Communicator
    cpu_group: Optional[dist.ProcessGroup]  # gloo; scheduler control messages (message counts)


def init_process_groups(info: DistributedInfo, device: torch.device, init_method: str,
                        timeout_s: float, allreduce: str = "auto",
                        symm_max_bytes: int = DEFAULT_SYMM_MAX_BYTES,
                        store_prefix: Optional[str] = None) -> ProcessGroups:
    """Join the tensor-parallel group. Every rank must call this with the same arguments.

    `store_prefix` None: rank 0 hosts the rendezvous at `init_method` (tcp://host:port), bound
    to that host only. Else the ranks meet in an existing TCP store there (node 0's launcher
    hosts it, `store.py`) under that key prefix, one per replica. Gloo listens on the address
    this host reaches `host` from (`bind.py`: loopback on one host).

    `allreduce` is "auto", "nccl", "symm" or "symm-fused" (module docstring); with symmetric
    memory every rank allocates one `symm_max_bytes` buffer here, before the engine captures any
    CUDA graph, and all-reduces of larger tensors (prefill) use NCCL. Raises ValueError for a bad
    mode or "symm" / "symm-fused" off CUDA (before joining), RuntimeError for them where
    symmetric memory is unavailable."""
    check_allreduce_mode(allreduce, device.type)
    if info.size == 1:
        return ProcessGroups(Communicator(info), None)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: Dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    host, port = parse_tcp(init_method)
    pin_gloo(address_towards(host))
    if store_prefix is None:
        store = _rendezvous(host, port, info, timeout_s)
    else:
        store = dist.PrefixStore(store_prefix, connect(host, port, timeout_s))
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.size,
                            timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    symm = _symm_all_reduce(allreduce, info, device, cpu_group, symm_max_bytes)
    fuse_norm = symm is not None and allreduce == "symm-fused"
    if allreduce == "ordered" and info.is_primary:
        logger.info("all-reduce: ordered (an all-gather, the partials added in rank order)")
    return ProcessGroups(Communicator(info, dist.group.WORLD, symm, fuse_norm,
                                      ordered=allreduce == "ordered"), cpu_group)


def _rendezvous(host: str, port: int, info: DistributedInfo, timeout_s: float) -> dist.Store:
    """The group's TCP store at host:port: rank 0 hosts it on a socket bound to `host` alone
    (torch's own would listen on every address), the others connect to it."""
    if not info.is_primary:
        return connect(host, port, timeout_s)
    try:
        sock = listening_socket(host, port)
    except OSError as e:
        raise RuntimeError(f"rank 0 cannot listen for the other ranks on {host}:{port}: "
                           f"{e.strerror or e}") from None
    # The store owns the descriptor from now on (detach: the socket object must not close it).
    return dist.TCPStore(host, port, info.size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())


def _symm_all_reduce(mode: str, info: DistributedInfo, device: torch.device,
                     cpu_group: dist.ProcessGroup, max_bytes: int) -> Optional[SymmMemAllReduce]:
    """The symmetric-memory all-reduce the mode asks for, or None (same answer on every rank)."""
    if mode in ("nccl", "ordered") or device.type != "cuda":  # on CPU "auto" is plain gloo
        return None
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("the symmetric all-reduce needs the default process group, made first")
    symm, why = SymmMemAllReduce.create(world, cpu_group, device, max_bytes,
                                        fused=mode == "symm-fused")
    if symm is None:
        if mode in SYMM_MODES:
            raise RuntimeError(f"allreduce {mode!r}: symmetric memory is unavailable ({why})")
        if info.is_primary:
            logger.warning("all-reduce: NCCL only, symmetric memory is unavailable (%s)", why)
    elif info.is_primary:
        logger.info("all-reduce: one-shot over symmetric memory up to %d bytes, NCCL above%s",
                    max_bytes, "; fused with the RMSNorm after it" if mode == "symm-fused" else "")
    return symm


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def min_over_ranks(value: int, cpu_group: Optional[dist.ProcessGroup]) -> int:
    """The minimum of `value` over all ranks (every rank must call it): agreed start-up budgets."""
    if cpu_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    return int(t.item())


def agreed_error(error: Optional[str], cpu_group: Optional[dist.ProcessGroup], what: str
                 ) -> Optional[str]:
    """The vote on a change every rank tried (every rank must call it): None where no rank
    failed; otherwise this rank's `error`, or, on a rank that succeeded, that `what` failed on
    another rank. Where the answer is not None, each rank that made the change undoes it."""
    if min_over_ranks(int(error is None), cpu_group) == 1:
        return None
    return error or f"{what} failed on another rank (its log says why)"


def every_ranks(obj: T, cpu_group: Optional[dist.ProcessGroup]) -> List[T]:
    """Every rank's `obj` (picklable; every rank must call it), in rank order: small
    answers each rank computes alone, put together (gloo)."""
    if cpu_group is None:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(out, obj, group=cpu_group)
    return out


def true_on_all_ranks(flags: Sequence[bool], cpu_group: Optional[dist.ProcessGroup]
                      ) -> List[bool]:
    """Flag i is True where it is True on every rank (every rank must call it, with as many
    flags): the ranks' agreement on per-rank readings, e.g. which compilations have finished."""
    if cpu_group is None or not flags:
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    return [bool(x) for x in t.tolist()]


def check_same_across_ranks(values: Sequence[int], cpu_group: Optional[dist.ProcessGroup],
                            what: str) -> None:
    """Raise on every rank when `values` differ between ranks (every rank must call it).

    A debugging guard for the lockstep invariant: ranks exchange a length and a CRC32, not the
    values themselves.
    """
    if cpu_group is None:
        return
    digest = torch.tensor([len(values), zlib.crc32(array("q", values).tobytes())],
                          dtype=torch.int64)
    size = dist.get_world_size(cpu_group)
    gathered = [torch.empty_like(digest) for _ in range(size)]
    dist.all_gather(gathered, digest, group=cpu_group)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise RuntimeError(f"ranks diverged on {what}: (length, crc32) per rank = "
                           f"{[tuple(g.tolist()) for g in gathered]}")
