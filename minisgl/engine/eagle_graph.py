"""CUDA graphs of an EAGLE-3 head's step (engine/eagle.py) over rows that are each one token of
one request: a verify step's drafts after the first (a row a request), and the head's pass over
a decode or verify batch's tokens (a row a token). Every row is a decode row over its request's
page-table row whose sequence ends at that token, as the target's verify graphs attend
(engine/verify_graph.py): the rows' K/V are stored before attention reads them, so a request's
later rows see its earlier ones. A head's step is a dozen small kernels at a few rows: eagerly
their launches, not the device, set its time.

One graph per row count in `graph_sizes(max_rows)`. Inputs: the rows' page-table rows,
positions and lengths in one static int32 block (one host-to-device copy,
cuda_graph.input_rows; padding rows on the spare row at position 0, whose slot is the pool's
scratch slot), and their input tokens and features copied on the device into static buffers.
The output is the head's state before its final norm, one row per input row.
"""

from __future__ import annotations

from typing import List

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.cuda_graph import (GraphableBackend, capture_graphs, graph_sizes,
                                       input_rows, static_input_blocks)
from minisgl.models.eagle3 import LlamaForCausalLMEagle3
from minisgl.utils import copy_from_host


class EagleGraphs:
    """Captures at construction (the head, its pool and the page table ready); `replay` runs
    the head's step over at most `max_rows` rows whose slots are in the page table."""

    def __init__(self, model: LlamaForCausalLMEagle3, backend: GraphableBackend, max_rows: int,
                 page_table: torch.Tensor, pad_row: int, scratch_slot: int) -> None:
        self.model, self.backend, self.page_table = model, backend, page_table
        self.sizes = graph_sizes(max_rows)
        self.max_rows = self.sizes[-1]
        self.pad_row = pad_row
        page_table[pad_row, 0] = scratch_slot  # padding rows write and read only there
        device = page_table.device
        self.blocks = static_input_blocks(self.sizes, pad_row, device)
        backend.init_graph_buffers(self.max_rows)
        self.ids = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
        self.features = torch.zeros(self.max_rows, model.cfg.hidden_size,
                                    dtype=model.lm_head.weight.dtype, device=device)
        self.graphs, self.states = capture_graphs(self.sizes, self._run, device)

    def _run(self, n: int) -> torch.Tensor:
        rows, positions, seq_lens = self.blocks[n][:, :n]
        batch = Batch(Phase.DECODE, [], [0] * n, [1] * n, [True] * n)
        batch.out_slots = self.page_table[rows, positions]
        batch.attn_meta = self.backend.graph_meta(rows, positions, seq_lens)
        return self.model.step(self.ids[:n], self.features[:n],
                               self.model.rope_index.of_positions(positions), batch,
                               self.backend).residual  # type: ignore[arg-type]

    def replay(self, table_rows: List[int], positions: List[int], ids: torch.Tensor,
               features: torch.Tensor) -> torch.Tensor:
        """The head's states [rows, hidden] for rows at `table_rows` and `positions` (at most
        max_rows) on input tokens `ids` and `features`; valid until the next replay."""
        n = len(table_rows)
        size = next(s for s in self.sizes if s >= n)
        block = self.blocks[size]
        copy_from_host(block, input_rows(table_rows, positions, self.pad_row, block.shape[1]))
        self.ids[:n] = ids
        self.features[:n] = features
        self.graphs[size].replay()
        return self.states[size][:n]
