"""CUDA graphs for short prefills of one request.

A prefill of up to about a thousand tokens runs each of its several hundred kernels for less
time than the host takes to launch it (tens of microseconds of Python and Triton dispatch each),
so the device waits: the time to first token of such a prompt is launch-bound (on an H200 with
the Llama-3.1-8B shape, served prompts of 553-927 tokens waited 49-61 ms for their first token
eagerly, against 20-26 ms for 217-505 tokens through graphs; RESULTS.md, sixteenth session). One
graph per token bucket (`bucket_sizes`: 64, 96, 128, 192, ... up to `max_tokens`) replays the
whole forward, LM head included, for a batch of exactly one request whose new tokens end in a
sampled token (a whole prompt or its last chunk, after any cached prefix). Longer prefills,
batches of several requests, and requests that want prompt log-probabilities run eagerly.

Inputs: one static int64 block per bucket of N tokens, filled by ONE host-to-device copy before a
replay: the N input ids (padded with 0), then the request's page-table row, cached prefix length,
new-token count and the index of its last new token. The graph derives the rest: positions
(prefix + i for real tokens, 0 for padding), the K/V slots (`page_table[row, position]` for real
tokens, written by the scheduler before the launch; the pool's scratch slot for padding, so
padding never touches a live request's cache), and the attention metadata (16-byte aligned int32
rows, as Triton sees every index row). Padding rows compute junk that no real row reads: every
op but attention is row-wise, and attention masks queries and keys by the real length.

Contract with the attention backend: `prefill_graph_meta(meta, max_extend)` returns metadata for
a prefill over the static int32 block `meta` [5, 4] (rows, prefix lens, extend lens, sequence
lengths, query starts in column 0) whose extend lengths are at most `max_extend`.
"""

from __future__ import annotations

import logging
from typing import Dict, List, NamedTuple, Optional, Protocol

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.cuda_graph import capture_graphs
from minisgl.models import CausalLM
from minisgl.utils import copy_from_host

logger = logging.getLogger(__name__)

MIN_TOKENS = 64
_HEADER = 4  # row, prefix length, new tokens, last new token's index


class PrefillGraphBackend(Protocol):
    def prefill_graph_meta(self, meta: torch.Tensor, max_extend: int) -> object: ...


class PrefillReplayed(NamedTuple):
    logits: torch.Tensor  # [1, vocab], valid until the next replay
    rows: torch.Tensor  # [1] int64: the request's page-table row (static buffer view)


def bucket_sizes(max_tokens: int, context: Optional[int] = None) -> List[int]:
    """MIN_TOKENS, 1.5 and 2 times that, 1.5 and 2 times that, ... (64, 96, 128, 192, ...) up
    to max_tokens and the `context` length (a page-table row: a longer bucket would index
    past it), empty below MIN_TOKENS: a prompt is padded by less than half its length, and a
    power of two's prompt fills its bucket. Every size is a multiple of 16 (Triton specializes
    integer arguments on that, as it does for the eager steps' counts)."""
    if context is not None:
        max_tokens = min(max_tokens, context)
    sizes, n = [], MIN_TOKENS
    while n <= max_tokens:
        sizes.append(n)
        if n * 3 // 2 <= max_tokens:
            sizes.append(n * 3 // 2)
        n *= 2
    return sizes


class PrefillGraphs:
    """Captures at construction (model, pool and page table ready, decode graphs captured); the
    engine calls `replay` for the batches `can_run` accepts. Every rank takes the same path for
    the same batch (the choice reads only the batch), so tp ranks stay in lockstep."""

    def __init__(self, model: CausalLM, backend: PrefillGraphBackend, max_tokens: int,
                 page_table: torch.Tensor, scratch_slot: int) -> None:
        self.model = model
        self.backend = backend
        self.page_table = page_table
        self.scratch_slot = scratch_slot
        self.sizes = bucket_sizes(max_tokens, page_table.shape[1])
        device = page_table.device
        self.blocks = {n: torch.zeros(n + _HEADER, dtype=torch.int64, device=device)
                       for n in self.sizes}
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: Dict[int, torch.Tensor] = {}
        self._capture_all(device)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def _run(self, n: int) -> torch.Tensor:
        block = self.blocks[n]
        ids, header = block[:n], block[n:]
        row, prefix, ext, last = header[0:1], header[1:2], header[2:3], header[3:4]
        index = torch.arange(n, device=block.device)
        real = index < ext
        positions = torch.where(real, prefix + index, 0)
        slots = torch.where(real, self.page_table[row, positions].to(torch.int64),
                            self.scratch_slot)
        # rows, prefix lens, extend lens, seq lens, query starts: one 16-byte row each
        meta = torch.stack([row, prefix, ext, prefix + ext, torch.zeros_like(row)])
        meta = meta.to(torch.int32).expand(5, 4).contiguous()
        batch = Batch(Phase.PREFILL, [], [0], [n], [True])
        batch.out_slots = slots
        batch.attn_meta = self.backend.prefill_graph_meta(meta, n)
        return self.model(ids, positions, batch, self.backend, last)  # type: ignore[arg-type]

    def _capture_all(self, device: torch.device) -> None:
        spare = self.page_table.shape[0] - 1  # the spare row, at init used by no request
        for n in self.sizes:  # capture-time values: a whole bucket of new tokens
            self.blocks[n][n:].copy_(torch.tensor([spare, 0, n, n - 1]))
        self.graphs, self.logits = capture_graphs(self.sizes, self._run, device)
        logger.info("captured %d prefill CUDA graphs (one request, %d..%d tokens)",
                    len(self.sizes), self.sizes[0], self.max_tokens)

    def can_run(self, batch: Batch) -> bool:
        return (batch.phase is Phase.PREFILL and batch.size == 1 and batch.sample[0]
                and batch.extend_lens[0] <= self.max_tokens)

    def replay(self, batch: Batch) -> PrefillReplayed:
        req, prefix, ext = batch.reqs[0], batch.prefix_lens[0], batch.extend_lens[0]
        n = next(s for s in self.sizes if s >= ext)
        block = self.blocks[n]
        values: List[int] = req.token_ids[prefix:prefix + ext]
        copy_from_host(block, [*values, *[0] * (n - ext), req.table_row, prefix, ext, ext - 1])
        self.graphs[n].replay()
        return PrefillReplayed(self.logits[n], block[n:n + 1])


def capture_prefill_graphs(model: CausalLM, backend: object, max_tokens: int,
                           page_table: torch.Tensor, scratch_slot: int
                           ) -> Optional[PrefillGraphs]:
    """The prefill graphs, or None (logged) where none apply: no bucket, a backend without
    the contract, or a model whose prefill cannot be captured."""
    if not bucket_sizes(max_tokens, page_table.shape[1]) or not hasattr(backend,
                                                                          "prefill_graph_meta"):
        return None
    try:
        return PrefillGraphs(model, backend, max_tokens,  # type: ignore[arg-type]
                             page_table, scratch_slot)
    except RuntimeError as e:  # e.g. a host sync inside the forward: eager prefill still works
        logger.warning("prefill CUDA graphs not captured, prefill runs eagerly: %s", e)
        torch.cuda.synchronize(page_table.device)
        return None
