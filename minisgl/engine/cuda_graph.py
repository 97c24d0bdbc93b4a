"""CUDA graphs for decode batches.

Decode is a few hundred small kernel launches per step; replaying a captured graph removes the
launch gaps. One graph per batch size in `sizes` (a real batch is padded up to the next one), all
sharing one memory pool.

Inputs: each size `bs` has one static int32 block [3, width] on the device (page-table row,
position, sequence length of each request), filled by ONE host-to-device copy before a replay.
The graph reads the first bs columns; `width` rounds bs up so that every row starts 16-byte
aligned, like every other index row Triton sees (it builds a kernel variant per alignment).
Everything else is derived inside the graph, so the host launches nothing else per step: the
input ids are `last_tokens[rows]` (the engine's device copy of each row's newest token) and the
KV slots `page_table[rows, positions]` (written by the scheduler before the launch). Padding
requests use the spare page-table row `pad_row` at position 0, whose entry points at the pool's
scratch slot, so they never touch a live request's cache.

With LoRA slots (`lora_slots`), a second family of graphs runs the batches where some request
has an adapter: the blocks get a fourth row, each request's adapter slot (-1: none, and for
padding), from which the graph builds its `LoraRows` (engine/lora.py) over every slot. The
base family keeps the fused kernels that LoRA's projections cannot take. Both families share
one memory pool and one logits buffer.

Contract with the attention backend (`GraphableBackend`): `init_graph_buffers(max_bs)` allocates
what the graphs share; `graph_meta(rows, positions, seq_lens)` returns metadata viewing the static
tensors (no host values baked in).
"""

from __future__ import annotations

import logging
from typing import (Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    TypeVar, runtime_checkable)

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.lora import graph_lora_rows
from minisgl.models import CausalLM
from minisgl.utils import aligned_width, copy_from_host

logger = logging.getLogger(__name__)


@runtime_checkable
class GraphableBackend(Protocol):
    def init_graph_buffers(self, max_bs: int) -> None: ...

    def graph_meta(self, rows: torch.Tensor, positions: torch.Tensor,
                   seq_lens: torch.Tensor) -> object: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: Batch) -> torch.Tensor: ...


class Replayed(NamedTuple):
    logits: torch.Tensor  # [batch.size, vocab] in the model's dtype, valid until the next replay
    rows: torch.Tensor  # [batch.size] int32 page-table rows on the device (static buffer view)


def graph_sizes(max_bs: int) -> List[int]:
    """1, 2, 4, then every 8 up to max_bs (and max_bs itself): a batch pads by at most 7, which
    matters at large batches, where the projections cost in proportion to the padded size."""
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    sizes += list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(s for s in sizes if s <= max_bs))


def static_input_blocks(sizes: Sequence[int], pad_row: int, device: torch.device,
                        lora: bool = False) -> Dict[int, torch.Tensor]:
    """For each graph size, a contiguous int32 block [3, aligned_width(bs)] ([4, ...] with
    `lora`) in one allocation, every row 16-byte aligned, filled as all-padding (pad_row,
    position 0, length 1, adapter slot -1)."""
    height = 4 if lora else 3
    widths = {bs: aligned_width(bs, torch.int32) for bs in sizes}
    flat = torch.zeros(height * sum(widths.values()), dtype=torch.int32, device=device)
    blocks: Dict[int, torch.Tensor] = {}
    offset = 0
    for bs, width in widths.items():
        blocks[bs] = flat[offset:offset + height * width].view(height, width)
        blocks[bs][0].fill_(pad_row)
        blocks[bs][2].fill_(1)
        blocks[bs][3:].fill_(-1)
        offset += height * width
    return blocks


def input_rows(rows: Sequence[int], positions: Sequence[int], pad_row: int, width: int,
               slots: Optional[Sequence[int]] = None) -> List[List[int]]:
    """A block's host values: each request's page-table row, position and length (position + 1),
    then padding requests (pad_row, 0, 1) up to `width` columns; with `slots` (a LoRA block),
    each request's adapter slot (-1: none) and -1 for the padding."""
    pad = width - len(rows)
    if pad < 0 or len(positions) != len(rows) or (slots is not None and len(slots) != len(rows)):
        raise ValueError(f"{len(rows)} rows, {len(positions)} positions and "
                         f"{'no' if slots is None else len(slots)} adapter slots for a block "
                         f"of {width} columns")
    values = [[*rows, *[pad_row] * pad], [*positions, *[0] * pad],
              [*(p + 1 for p in positions), *[1] * pad]]
    return values if slots is None else [*values, [*slots, *[-1] * pad]]


def logits_buffer(model: CausalLM, rows: int, device: torch.device) -> torch.Tensor:
    """[rows, padded vocabulary] in the LM head's dtype: the one buffer that a family of graphs
    writes its logits into, each graph its first rows. Graphs never replay at once, and a
    replay's logits are sampled before the next launch (the scheduler's loop), so one buffer
    serves them all: the decode graphs' own outputs held 1.08 GB at batch sizes up to 256 and a
    128K vocabulary, outside the KV pool's budget."""
    head = model.lm_head
    return torch.empty((rows, head.padded_vocab), dtype=head.weight.dtype, device=device)


K = TypeVar("K", int, Tuple[int, int])


# A capture of graphs keyed by batch size (`capture_graphs`'s; a test may pass one that records
# nothing and run the bodies eagerly)
Capture = Callable[[List[int], Callable[[int], torch.Tensor], torch.device],
                   Tuple[Dict[int, torch.cuda.CUDAGraph], Dict[int, torch.Tensor]]]


@torch.inference_mode()
def capture_graphs(sizes: Sequence[K], run: Callable[[K], torch.Tensor], device: torch.device
                   ) -> Tuple[Dict[K, torch.cuda.CUDAGraph], Dict[K, torch.Tensor]]:
    """One graph of `run(n)` for each key n in `sizes`, and the output tensor each replay
    refills. Captured largest first (descending keys; a tuple's first item leads) on a side
    stream, all sharing one memory pool (the later, smaller graphs reuse the largest one's
    memory), each after a warm-up run (Triton compiles, the caching allocator settles)."""
    graphs: Dict[K, torch.cuda.CUDAGraph] = {}
    outputs: Dict[K, torch.Tensor] = {}
    pool = None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for n in sorted(sizes, reverse=True):
            run(n)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[n] = run(n)
            pool = graph.pool()
            graphs[n] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs


class DecodeGraphs:
    """Captures at construction (the model, pool and page table must be ready); the engine calls
    `replay` for decode batches of at most `max_bs` requests whose slots are in the page table,
    and, with `lora_slots`, whose adapters are loaded in those slots. Graphs are keyed by
    (batch size, 1 for the LoRA family else 0)."""

    def __init__(self, model: CausalLM, backend: GraphableBackend, max_bs: int,
                 page_table: torch.Tensor, pad_row: int, scratch_slot: int,
                 last_tokens: torch.Tensor, lora_slots: int = 0,
                 dtype: torch.dtype = torch.bfloat16, buffer_rows: int = 0) -> None:
        """`dtype`: the activations' (the LoRA family's masks are in it); `buffer_rows`: the
        rows the backend's graph buffers hold if more than `max_bs` (the verify graphs')."""
        self.model = model
        self.backend = backend
        self.page_table = page_table
        self.last_tokens = last_tokens
        self.lora_slots = lora_slots
        self.dtype = dtype
        self.sizes = graph_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.pad_row = pad_row
        page_table[pad_row, 0] = scratch_slot  # padding requests write and read only there
        device = page_table.device
        self.blocks = static_input_blocks(self.sizes, pad_row, device, lora=lora_slots > 0)
        self.inputs = {bs: block[:, :bs] for bs, block in self.blocks.items()}
        backend.init_graph_buffers(max(self.max_bs, buffer_rows))
        self.out = logits_buffer(model, self.max_bs, device)
        self.graphs: Dict[Tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: Dict[Tuple[int, int], torch.Tensor] = {}
        self._capture_all(device)

    def _run(self, key: Tuple[int, int]) -> torch.Tensor:
        bs, lora = key
        rows, positions, seq_lens = self.inputs[bs][:3]
        batch = Batch(Phase.DECODE, [], [0] * bs, [1] * bs, [True] * bs)
        batch.out_slots = self.page_table[rows, positions]
        batch.attn_meta = self.backend.graph_meta(rows, positions, seq_lens)
        if lora:
            batch.lora = graph_lora_rows(self.inputs[bs][3], self.lora_slots, self.dtype)
        return self.model(self.last_tokens[rows], self.model.rope_index.of_positions(positions),
                          batch, self.backend, None,
                          out=self.out[:bs])

    def _capture_all(self, device: torch.device) -> None:
        families = (0, 1) if self.lora_slots else (0,)
        keys = [(bs, lora) for bs in self.sizes for lora in families]
        self.graphs, self.logits = capture_graphs(keys, self._run, device)
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d%s)", len(keys),
                    self.sizes[0], self.max_bs, ", with and without LoRA" if self.lora_slots
                    else "")

    def can_run(self, batch: Batch, lora: bool = False) -> bool:
        """`lora`: some request of `batch` runs with an adapter."""
        return (batch.phase is Phase.DECODE and batch.size <= self.max_bs
                and (self.lora_slots > 0 or not lora))

    def replay(self, batch: Batch, lora: bool = False) -> Replayed:
        """Run a decode batch: one input copy, then the graph of the next size up (the LoRA
        family's where `lora`: some request runs with an adapter)."""
        n = batch.size
        bs = next(s for s in self.sizes if s >= n)
        block = self.blocks[bs]
        slots = ([-1 if r.lora is None else r.lora.slot for r in batch.reqs]
                 if self.lora_slots else None)
        copy_from_host(block, input_rows([r.table_row for r in batch.reqs], batch.prefix_lens,
                                         self.pad_row, block.shape[1], slots))
        key = (bs, int(lora))
        self.graphs[key].replay()
        return Replayed(self.logits[key][:n], block[0, :n])
