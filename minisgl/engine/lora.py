"""Which tokens of a batch run with which LoRA adapter (`Batch.lora`, per forward)."""

from __future__ import annotations

from typing import List, Optional

import torch

from minisgl.core import Batch, LoraRows
from minisgl.utils import to_device


def adapter_mask(index: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, k] in `dtype` from each token's adapter column `index` [T] (-1: none): 1 at
    (t, index[t]), else 0. No host value: the decode graphs build it inside a replay."""
    return (index.unsqueeze(1) == torch.arange(k, dtype=index.dtype,
                                               device=index.device)).to(dtype)


def lora_rows(batch: Batch, device: torch.device, dtype: torch.dtype,
              every_slot: int = 0) -> Optional[LoraRows]:
    """The batch's tokens by adapter (`Req.lora`, which the scheduler bound as it took the
    request), over the slots they use, the mask in `dtype` (the activations'); None where no
    request runs with one. Request i's tokens are rows [sum(extend_lens[:i]), +
    extend_lens[i]) of the forward, as the engine lays them out. `every_slot` (deterministic
    inference: the model's slot count): the mask spans every slot (picks None), so that a
    token's delta sums over the same columns whichever adapters share its batch."""
    picks = sorted({req.lora.slot for req in batch.reqs if req.lora is not None})
    if not picks:
        return None
    column = {slot: slot if every_slot else j for j, slot in enumerate(picks)}
    index: List[int] = []
    for req, ext in zip(batch.reqs, batch.extend_lens):
        index += [-1 if req.lora is None else column[req.lora.slot]] * ext
    mask = adapter_mask(to_device(index, torch.int64, device), every_slot or len(picks), dtype)
    return LoraRows(mask) if every_slot else LoraRows(mask, to_device(picks, torch.int64, device))


def graph_lora_rows(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> LoraRows:
    """A decode graph's rows: `slots` [bs] holds each request's adapter slot (-1: none), a
    static input the replay fills; the mask spans every slot (picks None)."""
    return LoraRows(adapter_mask(slots, num_slots, dtype))
