"""Weights a trainer in the same machine hands over by reference (SGLang's
update_weights_from_tensor): (name, tensor) pairs pickled with torch's multiprocessing
reductions, so that a CUDA tensor travels as an IPC handle and a CPU one as a shared-memory
file, never as its bytes; the receiving rank maps the same memory.

A payload is a list of (name, tensor) pairs, or SGLang's flattened bucket (its
`load_format="flattened_bucket"`): {"flattened_tensor": the tensors' bytes end to end, uint8,
"metadata": one `FlattenedTensorMetadata` (name, shape, dtype, start_idx, end_idx, numel) a
tensor, its byte range}, which `deserialize` turns back into views of those bytes.

The payload is a pickle, and a pickle can name any function to call. `deserialize` runs an
unpickler that takes only what torch's tensor reductions name (its `rebuild_*` functions,
storages, dtypes, sizes) and SGLang's metadata class (read as a plain record of its fields),
so a payload from the network can build tensors and nothing else.
Each payload carries one reference to the memory it names, which opening it takes over: one
payload per receiving rank, each opened once. The sender must keep its tensors alive until
the update is answered.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, List, Tuple

import torch
import torch.multiprocessing

NamedTensors = List[Tuple[str, torch.Tensor]]
_STORAGES = frozenset({"UntypedStorage", "TypedStorage"})
# SGLang's bucket metadata class, as its payloads name it
_BUCKET_ENTRY = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


class BucketEntry:
    """What an SGLang `FlattenedTensorMetadata` unpickles into: a record whose fields the
    payload sets (name, shape, dtype, start_idx, end_idx, numel), checked before use."""


def serialize(payload: Any) -> bytes:
    """`payload` (a list of (name, tensor) pairs, or a flattened bucket's dict) pickled by
    reference, as SGLang's MultiprocessingSerializer does; a CPU tensor as a shared-memory file
    by name (torch's file_system sharing, for the pickle's duration), which any process of
    this machine can open, not as a descriptor only a child can fetch."""
    buf = io.BytesIO()
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump(payload if isinstance(payload, dict) else list(payload))
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return buf.getvalue()


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _BUCKET_ENTRY:
            return BucketEntry
        if _allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it may hold (name, tensor) pairs only, and names "
                                     f"{module}.{name}")


def _allowed(module: str, name: str) -> bool:
    if module == "torch.multiprocessing.reductions":
        return name.startswith("rebuild_")
    if module == "torch":
        return name in ("Tensor", "Size", "device") or isinstance(getattr(torch, name, None),
                                                                 torch.dtype)
    return module == "torch.storage" and name in _STORAGES


def deserialize(data: bytes) -> NamedTensors:
    """The (name, tensor) pairs of a `serialize` payload (another process's memory, mapped);
    ValueError where it names anything but tensors' parts, or is not a list of pairs."""
    try:
        value = _TensorsOnly(io.BytesIO(data)).load()
    except RuntimeError as e:  # the memory it names cannot be mapped (the sender is gone?)
        raise ValueError(f"serialized_named_tensors: the tensors cannot be opened here: "
                         f"{str(e).splitlines()[0]}") from None
    except Exception as e:  # whatever a malformed pickle raises
        raise ValueError(f"serialized_named_tensors: not a tensor payload: {e}") from None
    if isinstance(value, dict):
        return unbucket(value)
    if not isinstance(value, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], torch.Tensor) for p in value):
        raise ValueError("serialized_named_tensors must each hold a list of (name, tensor) "
                         "pairs")
    return value


def unbucket(bucket: Dict[str, Any]) -> NamedTensors:
    """SGLang's flattened bucket as (name, tensor) pairs, each a view of the bucket's bytes
    (`start_idx` to `end_idx`, its dtype, its shape); ValueError naming the entry and the
    numbers where a range does not hold its tensor or lies outside the bytes."""
    flat, entries = bucket.get("flattened_tensor"), bucket.get("metadata")
    if (set(bucket) != {"flattened_tensor", "metadata"} or not isinstance(flat, torch.Tensor)
            or flat.dim() != 1 or not isinstance(entries, list)):
        raise ValueError("serialized_named_tensors must each hold a list of (name, tensor) "
                         "pairs or a flattened bucket: {\"flattened_tensor\": a 1-D tensor, "
                         "\"metadata\": a list of FlattenedTensorMetadata}")
    flat = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    named: NamedTensors = []
    for i, e in enumerate(entries):
        f = getattr(e, "__dict__", {}) if isinstance(e, BucketEntry) else {}
        name, shape, dtype = f.get("name"), f.get("shape"), f.get("dtype")
        start, end = f.get("start_idx"), f.get("end_idx")
        if not (isinstance(name, str) and isinstance(dtype, torch.dtype)
                and isinstance(shape, (tuple, list)) and isinstance(start, int)
                and isinstance(end, int)):
            raise ValueError(f"serialized_named_tensors: bucket entry {i} is no "
                             f"FlattenedTensorMetadata (name, shape, dtype, start_idx, end_idx)")
        size = torch.Size(shape).numel() * dtype.itemsize
        if not 0 <= start <= end <= flat.numel() or end - start != size:
            raise ValueError(f"serialized_named_tensors: bucket entry {name} spans bytes "
                             f"[{start}, {end}) of {flat.numel()}, for {size} bytes of "
                             f"{tuple(shape)} {dtype}")
        part = flat[start:end]
        if start % dtype.itemsize:  # a view must start on its dtype's size: copy it there
            part = part.clone()
        named.append((name, part.view(dtype).reshape(shape)))
    return named
