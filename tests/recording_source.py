"""Checkpoint tensor sources for tests: one that logs what each read takes (the
sharded-loading tests check that every rank reads only its own slice of each tensor), and one
of given values."""

from __future__ import annotations

from typing import List, Tuple

import torch


class RecordingSource:
    """Wraps a TensorSource (models/weights.py); each read appends (tensor name, full shape,
    shape read) to `log`."""

    def __init__(self, inner: object, log: List[Tuple[str, tuple, tuple]]) -> None:
        self.inner, self.log = inner, log

    @property
    def shape(self) -> tuple:
        return self.inner.shape  # type: ignore[attr-defined]

    def read(self, dim: object = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        t = self.inner.read(dim, start, stop)  # type: ignore[attr-defined]
        self.log.append((self.inner.name, tuple(self.shape), tuple(t.shape)))  # type: ignore
        return t


class ValuesSource:
    """A checkpoint tensor source holding `values` (a scale's, say)."""

    def __init__(self, *values: float) -> None:
        self.values = torch.tensor(values)

    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)

    def read(self, dim: object = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return self.values
