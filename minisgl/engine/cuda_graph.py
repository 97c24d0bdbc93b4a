"""CUDA graphs for decode batches.

Decode is a few hundred small kernel launches per step; replaying a captured graph removes the
launch gaps. One graph per batch size in `sizes` (a real batch is padded up to the next one),
all sharing one memory pool. Padding rows read the spare page-table row and write their K/V to
the pool's scratch slot, so they never touch a live request's cache.

Contract with the attention backend (`GraphableBackend`): `graph_meta(bs)` returns metadata
viewing static buffers sized for `max_bs`; `fill_graph_meta(batch, bs)` copies a real batch's
values into them (padded) before each replay.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Protocol

import torch

from minisgl.core import Batch, Phase
from minisgl.models import CausalLM

logger = logging.getLogger(__name__)


class GraphableBackend(Protocol):
    def init_graph_buffers(self, max_bs: int, pad_row: int) -> None: ...

    def graph_meta(self, bs: int) -> object: ...

    def fill_graph_meta(self, batch: Batch, bs: int) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: Batch) -> torch.Tensor: ...


def graph_sizes(max_bs: int) -> List[int]:
    """1, 2, 4, 8, then every 8 (then every 16 past 128) up to max_bs."""
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    sizes += list(range(8, min(max_bs, 128) + 1, 8)) + list(range(144, max_bs + 1, 16))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(s for s in sizes if s <= max_bs))


class DecodeGraphs:
    def __init__(self, model: CausalLM, backend: GraphableBackend, max_bs: int, pad_row: int,
                 scratch_slot: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.sizes = graph_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_slots = torch.full((self.max_bs,), scratch_slot, dtype=torch.int64,
                                    device=device)
        self.rows = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        backend.init_graph_buffers(self.max_bs, pad_row)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: Dict[int, torch.Tensor] = {}
        self._capture_all(device)

    def _stub(self, bs: int) -> Batch:
        batch = Batch(Phase.DECODE, [], [0] * bs, [1] * bs, [True] * bs)
        batch.out_slots = self.out_slots[:bs]
        batch.attn_meta = self.backend.graph_meta(bs)
        return batch

    def _run(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._stub(bs),
                          self.backend, self.rows[:bs])  # type: ignore[arg-type]

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        pool = None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: later graphs reuse its memory
                self._run(bs)  # warm up (triton compiles, allocator settles)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bs] = self._run(bs)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d)", len(self.sizes),
                    self.sizes[0], self.max_bs)

    def can_run(self, batch: Batch) -> bool:
        return batch.phase is Phase.DECODE and batch.size <= self.max_bs

    def replay(self, batch: Batch) -> torch.Tensor:
        """Logits [batch.size, vocab] of a decode batch whose inputs the engine prepared."""
        n = batch.size
        bs = next(s for s in self.sizes if s >= n)
        assert batch.input_ids is not None and batch.positions is not None
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)  # type: ignore[arg-type]
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_slots[n:bs].fill_(self.scratch_slot)
        self.backend.fill_graph_meta(batch, bs)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
