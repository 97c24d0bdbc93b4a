"""A served weight read back by its checkpoint name (SGLang's get_weights_by_name; message
`WeightReadMsg`): what RL loops compare with their trainer's tensors after an update.

Every rank of the replica runs `read_weight` on the same message at the same step: it cuts its
own piece of the tensor to the rows asked for (models/decoder.read_back) and the ranks put
their pieces, or why they have none, together over gloo; rank 0 assembles the tensor
(layers/readback.assemble). Nothing changes; a refusal (an unknown name, a layer kept
quantized, the weights asleep, too many values) is the same on every rank.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch.distributed import ProcessGroup

from minisgl.distributed import every_ranks
from minisgl.layers.readback import Piece, assemble, too_many
from minisgl.message.tensors import to_wire
from minisgl.message.types import MAX_READ_VALUES, WeightReadMsg, WireTensor
from minisgl.scheduler.changes import WEIGHTS_ASLEEP
from minisgl.scheduler.engine_api import StepEngine

MAX_READ_ROWS = 1 << 20  # truncate_size at most (the values are capped by MAX_READ_VALUES too)


class WeightRead(NamedTuple):
    tensor: Optional[WireTensor]  # rank 0's answer (None on the other ranks)
    error: Optional[str]  # why there is none (every rank's answer alike)


def _own_pieces(engine: StepEngine, msg: WeightReadMsg) -> Tuple[Optional[str],
                                                                    List[Piece]]:
    if not 1 <= msg.truncate_size <= MAX_READ_ROWS:
        return f"truncate_size must be 1 to {MAX_READ_ROWS} rows, got {msg.truncate_size}", []
    if "weights" in engine.asleep:
        return WEIGHTS_ASLEEP, []
    try:
        return None, engine.read_back(msg.name, msg.truncate_size, MAX_READ_VALUES)
    except ValueError as e:
        return str(e), []


def read_weight(engine: StepEngine, msg: WeightReadMsg, rank: int,
                cpu_group: Optional[ProcessGroup]) -> WeightRead:
    """This rank's side of `msg` (every rank must call it at the same step)."""
    answers = every_ranks(_own_pieces(engine, msg), cpu_group)
    error = next((e for e, _ in answers if e is not None), None)
    if error is not None:
        return WeightRead(None, error)
    if rank != 0:
        return WeightRead(None, None)
    try:
        # one part a projection the checkpoint fuses along its rows (Phi-3's qkv_proj)
        values = torch.cat([assemble([pieces[i] for _, pieces in answers], msg.name)
                            for i in range(len(answers[0][1]))])
    except ValueError as e:  # the pieces do not fit: answer so, and go on serving
        return WeightRead(None, str(e))
    if values.numel() > MAX_READ_VALUES:
        return WeightRead(None, too_many(msg.name, values.numel(), msg.truncate_size))
    return WeightRead(to_wire(values), None)

