"""Tensor-parallel collectives (NCCL on CUDA, gloo on CPU) and the gloo control group.

`Communicator` is what layers call inside a forward pass; with one rank every call is the identity.
`init_process_groups` joins the ranks with a timeout, so a dead peer ends a collective with an
error instead of a hang.
"""

from __future__ import annotations

import datetime
import zlib
from array import array
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from minisgl.distributed.info import DistributedInfo


class Communicator:
    """All-reduce (sum) and all-gather over one process group; identity for a single rank."""

    def __init__(self, info: DistributedInfo, group: Optional[dist.ProcessGroup] = None) -> None:
        self.info = info
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.info.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.info.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.info.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class ProcessGroups(NamedTuple):
    comm: Communicator
    cpu_group: Optional[dist.ProcessGroup]  # gloo; scheduler control messages (message counts)


def init_process_groups(info: DistributedInfo, device: torch.device, init_method: str,
                        timeout_s: float) -> ProcessGroups:
    """Join the tensor-parallel group. Every rank must call this with the same `init_method`."""
    if info.size == 1:
        return ProcessGroups(Communicator(info), None)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=info.rank,
                            world_size=info.size, timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    return ProcessGroups(Communicator(info, dist.group.WORLD), cpu_group)


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
