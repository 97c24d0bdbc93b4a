"""Small stateless helpers used across layers: the compute dtype, host-to-device copies of host
lists (pinned, aligned rows), the offline prefill chunk, a temporarily changed torch setting."""

from __future__ import annotations

import array
import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple, TypeVar

import torch

from minisgl.devices import dtype_name

T = TypeVar("T")


def offline_prefill_tokens(device: torch.device) -> int:
    """The offline API's default prefill chunk (tokens per prefill step) on `device`: 16,384 on
    a CUDA GPU of 70 GiB or more (A100s aside), else 8,192, as vLLM's offline entry point
    defaults: half the prefill steps for large offline batches, at no cost in prefill speed on
    large GPUs. The server keeps 8,192: a longer chunk holds back the running requests' next
    token longer. Reads the device's properties (CUDA is initialised)."""
    if device.type != "cuda":
        return 8192
    props = torch.cuda.get_device_properties(device)
    big = props.total_memory >= 70 << 30 and "a100" not in props.name.lower()
    return 16384 if big else 8192


def resolve_dtype(dtype: Optional[str], device: str) -> torch.dtype:
    """The compute dtype for a dtype setting on a resolved device (devices.dtype_name)."""
    return getattr(torch, dtype_name(dtype, device))


# Typecodes of the standard library's arrays that hold each dtype's values exactly.
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f", torch.float64: "d"}


def host_tensor(values: Sequence[Any], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A host list (or a list of equal-length lists) as a CPU tensor, optionally in pinned
    memory. Through a standard-library array where the dtype has one: `torch.tensor` on a Python
    list inspects every element, about 50 times slower, which on the GPU adds milliseconds of
    host time before a long prompt's prefill can launch."""
    code = _ARRAY_CODES.get(dtype)
    nested = bool(values) and isinstance(values[0], (list, tuple))
    if code is None or not values or (nested and not values[0]):
        return torch.tensor(values, dtype=dtype, pin_memory=pin)
    rows = values if nested else [values]
    flat = array.array(code, rows[0])
    for row in rows[1:]:
        flat += array.array(code, row)  # the constructor reads a list about twice as fast as extend
    host = torch.frombuffer(flat, dtype=dtype)
    if nested:
        host = host.view(len(values), -1)
    if not pin:
        return host.clone()  # own the memory: the array is gone with this frame
    return torch.empty(host.shape, dtype=dtype, pin_memory=True).copy_(host)


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without stalling the host. The list goes through pinned
    memory: a copy from pageable memory (and `torch.tensor(..., device=cuda)`) can wait for the
    GPU work queued before it, which would undo overlap scheduling. Torch's pinned allocator
    keeps the staging block until the copy has run."""
    if device.type != "cuda":
        return host_tensor(values, dtype)
    return host_tensor(values, dtype, pin=True).to(device, non_blocking=True)


def aligned_width(n: int, dtype: torch.dtype) -> int:
    """The smallest row length >= max(n, 1) whose bytes are a multiple of 16: rows of that
    length laid end to end each start 16-byte aligned (see `rows_to_device`)."""
    per = max(1, 16 // dtype.itemsize)
    return max(per, -(-n // per) * per)


def rows_to_device(rows: Sequence[Sequence[Any]], dtype: torch.dtype, device: torch.device
                   ) -> torch.Tensor:
    """Equal-length host lists as one [len(rows), n] device tensor, in one copy like
    `to_device`, with every row starting 16-byte aligned (rows are padded in the copy). Triton
    specializes a kernel on whether each pointer is 16-byte aligned, so a row at an unaligned
    offset (e.g. the third of three rows of an odd length) would make it build a new variant
    in the middle of serving, a stall of a fraction of a second."""
    if not rows:
        raise ValueError("rows_to_device needs at least one row")
    n = len(rows[0])
    if any(len(r) != n for r in rows):
        raise ValueError(f"rows_to_device needs equal-length rows, got {[len(r) for r in rows]}")
    width = aligned_width(n, dtype)
    padded = rows if width == n else [[*r, *[0] * (width - n)] for r in rows]
    return to_device(padded, dtype, device)[:, :n]


def copy_from_host(dst: torch.Tensor, values: Sequence[Any]) -> None:
    """dst[...] = values (a host list of dst's shape), through pinned memory like `to_device`,
    into an existing device tensor (e.g. a CUDA graph's static input)."""
    dst.copy_(host_tensor(values, dst.dtype, pin=dst.is_cuda), non_blocking=True)


@contextlib.contextmanager
def temporarily(get: Callable[[], T], put: Callable[[T], Any], value: T) -> Iterator[None]:
    """A process-wide torch setting (read by `get`, written by `put`) set to `value` inside the
    block and restored after, also on error. The caller's thread must be the only one using
    the setting meanwhile."""
    before = get()
    put(value)
    try:
        yield
    finally:
        put(before)


def checked_out(out: Optional[torch.Tensor], shape: Tuple[int, ...], like: torch.Tensor
                ) -> torch.Tensor:
    """`out` where it is a contiguous tensor of `shape` in `like`'s dtype on its device (else
    ValueError with what it is); a new tensor of that kind where it is None."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if (tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device
            or not out.is_contiguous()):
        raise ValueError(f"an output tensor must be a contiguous {like.dtype} {list(shape)} on "
                         f"{like.device}; got {out.dtype} {list(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")
    return out
