"""Which rank this process is, among how many."""

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
