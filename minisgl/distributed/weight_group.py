"""A trainer's process group that pushes weights into the service (SGLang's
/init_weights_update_group and /update_weights_from_distributed, as RL loops use them).

The trainer is rank 0 of a group of `world_size` and hosts its TCP store at (master_address,
master_port); each rank of the service joins as `rank_offset` + its global rank (replica * tp +
tp rank). The group is the service's only contact with the trainer: it is not any rank's
default group, and the ranks' own groups stay as they are. The keys in the store are laid out as
torch's `new_group` lays out a group's (the group's name, then "<name>/", then the device's
"cpu/" or "cuda/"), which is how SGLang's trainers (`init_custom_process_group`) create their
side; a trainer may equally build it from the same public classes (tests/test_weight_group.py).

Then for each update the trainer broadcasts, from rank 0, each named tensor in the order the
update lists them (names, dtypes, shapes); every rank receives each one whole (its checkpoint
name's shape) and keeps its own shard as a checkpoint's loading does. Collectives are gloo's on
CPU tensors or NCCL's on the rank's GPU (`backend`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator, List, Sequence, Tuple, cast

if TYPE_CHECKING:  # imported where a tensor is made: the API server checks a GroupSpec
    import torch

BACKENDS = ("nccl", "gloo")
# The dtypes a trainer may send (torch's names; "torch.bfloat16" as well)
DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8",
          "uint8", "int32", "int64", "bool")
JOIN_TIMEOUT_S = 120.0  # within the watchdog's step limit (300 s by default)


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to join a trainer's group (the HTTP body's fields, SGLang's names)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    def check(self, service_ranks: int) -> None:
        """ValueError naming the field where the group cannot hold the service's ranks after
        the trainer's (ranks rank_offset .. rank_offset + service_ranks - 1 of world_size)."""
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'nccl' or 'gloo', not {self.backend!r}")
        if not self.group_name:
            raise ValueError("group_name must not be empty")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if self.rank_offset < 1 or self.rank_offset + service_ranks > self.world_size:
            raise ValueError(f"a group of world_size {self.world_size} with rank_offset "
                             f"{self.rank_offset} cannot hold this service's {service_ranks} "
                             f"ranks after the trainer's rank 0 (need rank_offset >= 1 and "
                             f"rank_offset + {service_ranks} <= world_size)")


class WeightGroup:
    """This rank's membership of one trainer group (join with `WeightGroup.join`)."""

    def __init__(self, spec: GroupSpec, backend: object, device: torch.device) -> None:
        self.spec, self._backend, self.device = spec, backend, device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, device: torch.device,
             timeout_s: float = JOIN_TIMEOUT_S) -> "WeightGroup":
        """Join as `rank` (blocks until every member has: at most `timeout_s`); the error of
        the store or the backend where that fails (the trainer never came, a port refused)."""
        import torch
        import torch.distributed as dist
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size,
                              is_master=False, timeout=timeout)
        on_gpu = spec.backend == "nccl"
        prefixed = dist.PrefixStore(f"{spec.group_name}/", dist.PrefixStore(spec.group_name,
                                                                             store))
        keys = dist.PrefixStore("cuda/" if on_gpu else "cpu/", prefixed)
        if on_gpu:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend: object = dist.ProcessGroupNCCL(keys, rank, spec.world_size, options)
            where = device
        else:  # on the address that reaches the trainer (the ranks' own gloo is pinned to
            # theirs: loopback on one host, where a trainer on another could not connect)
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(
                hostname=_address_towards(spec.master_address, spec.master_port))]
            backend = dist.ProcessGroupGloo(keys, rank, spec.world_size, options)
            where = torch.device("cpu")
        return cls(spec, backend, where)

    def receive(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The next tensor the trainer broadcasts from rank 0."""
        import torch
        import torch.distributed as dist
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._backend.broadcast([tensor], dist.BroadcastOptions()).wait()  # type: ignore
        return tensor

    def receive_all(self, specs: List[Tuple[str, torch.dtype, Tuple[int, ...]]]
                    ) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name, tensor) for each (name, dtype, shape), received one by one as the consumer
        takes them (a consumer that stops early must drain the rest: the trainer sends them
        all)."""
        for name, dtype, shape in specs:
            yield name, self.receive(dtype, shape)


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to (host, port) (a UDP socket's connect sends
    nothing)."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(where)
        return str(s.getsockname()[0])


def check_dtype(name: str) -> str:
    """A dtype named as SGLang's clients name them ("bfloat16", "torch.bfloat16"), as torch
    names it; ValueError naming another."""
    bare = name.removeprefix("torch.")
    if bare not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}")
    return bare


def check_update(names: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[Sequence[int]]) -> Tuple[str, ...]:
    """An update's dtypes as torch names them; ValueError where the three lists differ in
    length, a dtype is unknown, or a size is negative (checked before anything is sent: a
    trainer's broadcasts are received only by an update that reaches the ranks)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must be as long as each other "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    if any(d < 0 for shape in shapes for d in shape):
        raise ValueError("shapes must not hold negative sizes")
    return tuple(check_dtype(d) for d in dtypes)


def parse_dtype(name: str) -> "torch.dtype":
    """The torch dtype `check_dtype` accepts."""
    import torch
    return cast("torch.dtype", getattr(torch, check_dtype(name)))  # DTYPES names dtypes only
