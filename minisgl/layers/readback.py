"""Served weights read back as the checkpoint tensors they were loaded from (SGLang's
get_weights_by_name): each layer's `piece(param, shard_id)` is the box of the checkpoint tensor
this rank holds, the inverse of its `load`; `first_rows` cuts a piece to the tensor's first rows
and copies just those to the CPU; `assemble` (rank 0) puts every rank's pieces together.

Values are the served ones: in the served dtype, and after what loading did to them (a norm's
offset is undone; folded multipliers and online quantization are not). Quantized layers (FP8,
packed integers, as kept on a GPU; experts too) have no checkpoint values to give back: their
`piece` raises ValueError.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import torch


class Piece(NamedTuple):
    """This rank's part of a checkpoint tensor: `values` are [start, start + their length)
    along `dim` of a tensor `full` long there; dim None: the whole tensor."""

    values: torch.Tensor
    dim: Optional[int] = None
    start: int = 0
    full: int = 0


@runtime_checkable
class Readable(Protocol):
    """A layer that keeps checkpoint tensors' values: their boxes on this rank."""

    def piece(self, param: str, shard_id: int = 0) -> Piece: ...


def not_readable(what: str, why: str) -> ValueError:
    return ValueError(f"{what} cannot be read back by name: {why}")


def too_many(name: str, values: int, rows: int) -> str:
    return (f"{name}: {values} values in its first {rows} rows are too many to send (ask for "
            f"fewer rows: truncate_size)")


def first_rows(piece: Piece, rows: int, name: str, max_values: int) -> Piece:
    """`piece` cut to its tensor's first `rows` rows, in float32 on the CPU (only the rows
    kept are copied); ValueError where more than `max_values` values are left."""
    values = piece.values
    if piece.dim == 0:
        values = values[:max(0, min(piece.start + values.shape[0], rows) - piece.start)]
    elif values.dim() > 0:
        values = values[:rows]
    if values.numel() > max_values:
        raise ValueError(too_many(name, values.numel(), rows))
    return piece._replace(values=values.detach().to("cpu", torch.float32))


def assemble(pieces: Sequence[Piece], name: str) -> torch.Tensor:
    """Checkpoint tensor `name`'s first rows from every rank's `first_rows` piece of them
    (ranks may hold the same range: replicated KV heads). Along dim 0 the pieces kept reach
    as far as the rows asked for; along dim 1 every piece has them all. ValueError where
    the pieces disagree on the shape or leave part of it uncovered."""
    first, dim = pieces[0], pieces[0].dim
    if dim is None:
        return first.values
    shape = list(first.values.shape)
    shape[dim] = (max((p.start + len(p.values) for p in pieces if len(p.values)), default=0)
                  if dim == 0 else first.full)
    out = torch.zeros(shape)
    covered = torch.zeros(shape[dim], dtype=torch.bool)
    for p in pieces:
        n = p.values.shape[dim] if p.dim == dim else 0
        if (p.dim, p.full) != (dim, first.full) or (n and p.start + n > shape[dim]):
            raise ValueError(f"{name}: the ranks' pieces do not fit together (piece along dim "
                             f"{p.dim} at {p.start}, {n} long, of {p.full}; tensor {shape})")
        if n:
            out.narrow(dim, p.start, n).copy_(p.values)
            covered[p.start:p.start + n] = True
    if not bool(covered.all()):
        raise ValueError(f"{name}: the ranks' pieces leave part of it uncovered")
    return out
