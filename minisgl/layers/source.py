"""Where a parameter's values come from while loading: a sliceable view of one checkpoint tensor.

Layers ask a `TensorSource` for just their own slice, so no rank ever materializes a full
unsharded weight (the safetensors source reads slices from disk; the dummy source makes random
values of the slice's shape).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch


class TensorSource(Protocol):
    @property
    def shape(self) -> Tuple[int, ...]: ...

    def read(self, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The slice [start, stop) along `dim`, or the whole tensor when `dim` is None."""
        ...


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a loaded slice into (part of) a parameter, checking shapes with a clear message.
    An FP8 slice goes only into an FP8 parameter: converting it alone, without its scale, would
    load wrong weights silently."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch loading {what}: checkpoint slice {tuple(src.shape)}, "
                         f"parameter {tuple(dst.shape)}")
    if src.dtype == torch.float8_e4m3fn and dst.dtype != src.dtype:
        raise ValueError(f"{what} is FP8 in the checkpoint, but minisgl keeps this layer in "
                         f"{dst.dtype} (is it missing from the quantization config's ignore "
                         f"list, or is the layer one minisgl does not quantize?)")
    dst.copy_(src.to(dtype=dst.dtype))


class RowsOf:
    """Rows [start, start + size) of a checkpoint tensor, as a source of their own: one of the
    projections a checkpoint fuses along dim 0 (Phi-3's qkv_proj, gate_up_proj), read as
    lazily as the whole (a rank still reads only its slice)."""

    def __init__(self, src: TensorSource, start: int, size: int) -> None:
        self.src, self.start, self.size = src, start, size

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.size, *self.src.shape[1:])

    def read(self, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if dim == 0:
            return self.src.read(0, self.start + start, self.start + stop)
        rows = self.src.read(0, self.start, self.start + self.size)
        if dim is None:
            return rows
        return rows.narrow(dim, start, stop - start)


class TensorOf:
    """A whole tensor in memory as a source (weights a trainer pushed: a checkpoint tensor
    received rather than read from a file)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        return self.tensor if dim is None else self.tensor.narrow(dim, start, stop - start)
