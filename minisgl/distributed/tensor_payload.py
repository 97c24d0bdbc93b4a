"""Weights a trainer in the same machine hands over by reference (SGLang's
update_weights_from_tensor): (name, tensor) pairs pickled with torch's multiprocessing
reductions, so that a CUDA tensor travels as an IPC handle and a CPU one as a shared-memory
file, never as its bytes; the receiving rank maps the same memory.

The payload is a pickle, and a pickle can name any function to call. `deserialize` runs an
unpickler that takes only what torch's tensor reductions name (its `rebuild_*` functions,
storages, dtypes, sizes), so a payload from the network can build tensors and nothing else.
Each payload carries one reference to the memory it names, which opening it takes over: one
payload per receiving rank, each opened once. The sender must keep its tensors alive until
the update is answered.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, List, Tuple

import torch
import torch.multiprocessing

NamedTensors = List[Tuple[str, torch.Tensor]]
_STORAGES = frozenset({"UntypedStorage", "TypedStorage"})


def serialize(named: NamedTensors) -> bytes:
    """`named` pickled by reference, as SGLang's MultiprocessingSerializer does; a CPU tensor
    as a shared-memory file by name (torch's file_system sharing, for the pickle's duration),
    which any process of this machine can open, not as a descriptor only a child can fetch."""
    buf = io.BytesIO()
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump(list(named))
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return buf.getvalue()


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
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
    if not isinstance(value, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], torch.Tensor) for p in value):
        raise ValueError("serialized_named_tensors must each hold a list of (name, tensor) "
                         "pairs")
    return value
