"""Which tokens of a batch run with which LoRA adapter (`Batch.lora`, per forward)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from minisgl.core import Batch, LoraRows
from minisgl.utils import to_device


def lora_rows(batch: Batch, adapters: Sequence[str], device: torch.device
              ) -> Optional[LoraRows]:
    """The batch's token rows by adapter slot (slot i: `adapters[i]`, the config's order on
    every rank); None where no request names one. Request i's tokens are rows
    [sum(extend_lens[:i]), + extend_lens[i]) of the forward, as the engine lays them out. A
    name outside `adapters` is a ValueError: check_request refused such requests before."""
    if not adapters:
        return None
    slots: Dict[int, List[int]] = {}
    start = 0
    for req, ext in zip(batch.reqs, batch.extend_lens):
        name = req.params.lora_name
        if name is not None:
            slots.setdefault(adapters.index(name), []).extend(range(start, start + ext))
        start += ext
    if not slots:
        return None
    return LoraRows(tuple((slot, to_device(rows, torch.int64, device))
                          for slot, rows in sorted(slots.items())))
