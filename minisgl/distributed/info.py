"""Which rank this process is, among how many, and how a model's heads split over them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str) -> "Shard":
        """The contiguous 1/size part of `total` items this rank owns (`what` names them)."""
        if total % self.size != 0:
            raise ValueError(f"{what} ({total}) is not divisible by tp={self.size}")
        n = total // self.size
        return Shard(self.rank * n, n)


@dataclass(frozen=True)
class Shard:
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def check_head_split(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Fail at start-up, naming the numbers, when the heads cannot be split over `tp` ranks."""
    if num_heads % tp != 0:
        raise ValueError(f"cannot split {num_heads} attention heads over tp={tp}: "
                         f"tp must divide the number of attention heads")
    if num_kv_heads % tp != 0 and tp % num_kv_heads != 0:
        raise ValueError(f"cannot split {num_kv_heads} KV heads over tp={tp}: tp must divide the "
                         f"KV heads or be a multiple of them (attention heads: {num_heads})")
