"""Sleep mode: an idle engine hands its device memory back, and takes it again to serve.

vLLM's two levels (`--enable-sleep-mode`): level 1 keeps a host copy of every tensor of the
model and forgets the KV cache; level 2 forgets the checkpoint's tensors too (parameters and
persistent buffers: a reload fills them again), keeping host copies of the model's other tensors
(rotary tables, LoRA slots), which no checkpoint fills. Waking takes the memory again: a
forgotten tensor comes back zeroed, a kept one copied back.

How: every tensor is a view of some storage, and `resize_(0)` on a storage frees its memory
while every tensor viewing it stays the same Python object (the modules, the attention backend
and the KV pool keep their references and their views' shapes); resizing it back allocates
anew. New memory has new addresses, so the engine drops its CUDA graphs before and captures
them again after (Engine.sleep / Engine.wake_up). A tensor that no module or pool reaches is
not freed (the engine logs how much memory stays allocated).

The host copy is one buffer (pinned on a GPU), which the engine keeps after waking for the next
level-1 sleep: an RL loop sleeps every step, and pinning the weights' size of host memory takes
seconds where copying into it takes a fraction of one.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

logger = logging.getLogger(__name__)


class Held(NamedTuple):
    """One storage of a sleeping part: its size and, where kept, its bytes in host memory."""

    storage: torch.UntypedStorage
    nbytes: int
    backup: Optional[torch.Tensor]  # uint8 host copy; None: forgotten (zeroed on waking)


class Part:
    """A set of storages that sleeps and wakes together (the weights, or the KV cache).

    `storages`: each storage once, with whether its content is the checkpoint's (`sleep`
    forgets those unless told to keep them)."""

    def __init__(self, storages: List[Tuple[torch.UntypedStorage, bool]]) -> None:
        self.storages = storages
        self.held: Optional[List[Held]] = None  # asleep: what waking restores
        self.buffer: Optional[torch.Tensor] = None  # the host copies (Held.backup: views)
        self.kept = True  # the last sleep kept the checkpoint's content

    def sleep(self, keep_checkpoint: bool, pin: bool,
              buffer: Optional[torch.Tensor] = None) -> int:
        """Free the part's memory after copying to host memory what is kept (the
        non-checkpoint storages always; the checkpoint's with `keep_checkpoint`): into
        `buffer` (a uint8 host tensor) where it is large enough, else into a new one (pinned
        with `pin`: pinning is the slow part, so a caller that sleeps again passes the last
        one back: `self.buffer`). The bytes freed. Raises before freeing anything where the
        copy cannot be made."""
        kept = [keep_checkpoint or not checkpoint for _, checkpoint in self.storages]
        need = sum(s.nbytes() for (s, _), k in zip(self.storages, kept) if k)
        if buffer is None or buffer.numel() < need:
            buffer = _host_buffer(need, pin)
        held, offset = [], 0
        for (storage, _), keep in zip(self.storages, kept):
            backup = None
            if keep:
                backup = buffer[offset:offset + storage.nbytes()]
                backup.copy_(_bytes_of(storage), non_blocking=True)
                offset += storage.nbytes()
            held.append(Held(storage, storage.nbytes(), backup))
        if held and held[0].storage.device.type == "cuda":
            torch.cuda.synchronize(held[0].storage.device)  # copied before it is freed
        for h in held:
            h.storage.resize_(0)
        self.held, self.buffer, self.kept = held, buffer, keep_checkpoint
        return sum(h.nbytes for h in held)

    def wake(self) -> None:
        """Allocate the part's memory again and restore it (zeros where forgotten). Raises
        (e.g. the device is out of memory) with the part asleep as before."""
        held = self.held
        if held is None:
            return
        try:
            for h in held:
                h.storage.resize_(h.nbytes)
                data = _bytes_of(h.storage)
                if h.backup is None:
                    data.zero_()
                else:
                    data.copy_(h.backup, non_blocking=True)
        except Exception:
            for h in held:
                h.storage.resize_(0)
            raise
        if held and held[0].storage.device.type == "cuda":
            torch.cuda.synchronize(held[0].storage.device)  # the pinned copies are read
        self.held = None


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory, pinned with `pin` where the driver can map it (a device full
    to the last bytes cannot: CUDA says out of memory), else pageable (slower copies)."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:  # torch.AcceleratorError is one
            logger.warning("sleep: %.2f GiB of pinned host memory not had (%s): the host copy "
                           "is pageable", nbytes / 2**30, str(e).splitlines()[0])
    return torch.empty(nbytes, dtype=torch.uint8)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a module of `model` holds: parameters, buffers and tensor attributes
    (directly or in a list or tuple)."""
    for module in model.modules():
        yield from (p for p in module._parameters.values() if p is not None)
        yield from (b for b in module._buffers.values() if b is not None)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (v for v in value if isinstance(v, torch.Tensor))


def _storage_key(t: torch.Tensor) -> Tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def weights_part(model: nn.Module, device: torch.device) -> Part:
    """The storages of `model` on `device` (each once; taken as it sleeps, since a load may
    have replaced a tensor), those of its state dict (parameters, persistent buffers: what a
    checkpoint fills) marked as the checkpoint's."""
    checkpoint = {_storage_key(t) for t in model.state_dict(keep_vars=True).values()}
    storages: Dict[Tuple[torch.device, int], Tuple[torch.UntypedStorage, bool]] = {}
    for t in _module_tensors(model):
        key = _storage_key(t)
        if t.device != device or key[1] == 0 or key in storages:  # elsewhere, empty, or seen
            continue
        storages[key] = (t.untyped_storage(), key in checkpoint)
    return Part(list(storages.values()))


def tensors_part(tensors: Iterable[torch.Tensor]) -> Part:
    """A part of `tensors`' storages (each once), all forgotten at sleep (the KV cache)."""
    storages: Dict[Tuple[torch.device, int], Tuple[torch.UntypedStorage, bool]] = {}
    for t in tensors:
        storages.setdefault(_storage_key(t), (t.untyped_storage(), True))
    return Part(list(storages.values()))
