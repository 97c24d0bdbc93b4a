"""Which tokens of a batch run with which LoRA adapter (`Batch.lora`, per forward)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from minisgl.core import Batch, LoraRows
from minisgl.utils import to_device


def lora_rows(batch: Batch, device: torch.device) -> Optional[LoraRows]:
    """The batch's token rows by adapter slot (`Req.lora`, which the scheduler bound as it
    took the request); None where no request runs with one. Request i's tokens are rows
    [sum(extend_lens[:i]), + extend_lens[i]) of the forward, as the engine lays them out."""
    slots: Dict[int, List[int]] = {}
    start = 0
    for req, ext in zip(batch.reqs, batch.extend_lens):
        if req.lora is not None:
            slots.setdefault(req.lora.slot, []).extend(range(start, start + ext))
        start += ext
    if not slots:
        return None
    return LoraRows(tuple((slot, to_device(rows, torch.int64, device))
                          for slot, rows in sorted(slots.items())))
