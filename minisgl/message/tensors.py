"""`WireTensor` to and from torch: the rank processes and `LLM` (this module imports torch; the
tokenizer, detokenizer and API server handle a WireTensor's bytes without it)."""

from __future__ import annotations

import numpy as np
import torch

from minisgl.message.types import WireTensor


def to_wire(values: torch.Tensor) -> WireTensor:
    """A CPU tensor's values as a message carries them (float32 little-endian)."""
    data = values.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()
    return WireTensor(tuple(values.shape), data)


def from_wire(tensor: WireTensor) -> torch.Tensor:
    """A WireTensor as a float32 CPU tensor of its shape (a copy: the bytes stay read-only)."""
    return torch.from_numpy(np.frombuffer(tensor.data, "<f4").reshape(tensor.shape).copy())
