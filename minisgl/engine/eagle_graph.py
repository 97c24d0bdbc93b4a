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

A second family (`proposals`) holds a verify step's whole greedy proposal for requests that
each draft the same count: from each request's kept state, the LM head, the draft
vocabulary's argmax mapped to the target's tokens and, for every draft but the last, a step of
the head at the next position (`greedy_drafts`, which the eager path runs too). Its input
block holds each request's page-table row and the verify's first position; a padding row stays
at position 0 on the spare row through every step. Eagerly that proposal is a few hundred
launches and copies; replayed it is one copy in and one graph.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.cuda_graph import (Capture, GraphableBackend, capture_graphs, graph_sizes,
                                       input_rows, static_input_blocks)
from minisgl.engine.sampler import greedy
from minisgl.kernels.policy import KernelPolicy
from minisgl.models.eagle3 import LlamaForCausalLMEagle3
from minisgl.utils import copy_from_host

logger = logging.getLogger(__name__)


Step = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def greedy_draft(model: LlamaForCausalLMEagle3, policy: KernelPolicy, target_ids: torch.Tensor,
                 states: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's greedy draft from its head state (before the final norm): the
    draft vocabulary's first argmax mapped through `target_ids` (the target's sampler takes
    the first largest, and d2t keeps the tokens' order)."""
    return target_ids[greedy(model.lm_head(model.model.norm(states)), policy)]


def greedy_drafts(model: LlamaForCausalLMEagle3, policy: KernelPolicy, target_ids: torch.Tensor,
                  states: torch.Tensor, count: int, step: Step) -> torch.Tensor:
    """int64 [rows, count]: `count` greedy drafts (`greedy_draft`) of each row from its head
    state `states`, each but the last followed by `step(j, draft j, states)`, the head's next
    states (its step at the verify's position + j, writing that position's K/V)."""
    drafts: List[torch.Tensor] = []
    for j in range(count):
        drafts.append(greedy_draft(model, policy, target_ids, states))
        if j + 1 < count:
            states = step(j, drafts[-1], states)
    return torch.stack(drafts, dim=1)


class Proposing(NamedTuple):
    """What the proposal graphs read besides their block: `draft_count` drafts a request, from the
    head's kept `states` (by page-table row, read at replay), draft tokens mapped through
    `target_ids`, argmax by `policy`."""

    draft_count: int
    states: torch.Tensor
    target_ids: torch.Tensor
    policy: KernelPolicy


class EagleGraphs:
    """Captures at construction (the head, its pool and the page table ready); `replay` runs
    the head's step over at most `max_rows` rows whose slots are in the page table.
    `capture(sizes, run, device)` records `run(n)` for each size (a test may pass one that
    records nothing and call the bodies, `_run` and `proposal`, eagerly)."""

    def __init__(self, model: LlamaForCausalLMEagle3, backend: GraphableBackend, max_rows: int,
                 page_table: torch.Tensor, pad_row: int, scratch_slot: int,
                 capture: Capture = capture_graphs) -> None:
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
        self._capture = capture
        self.graphs, self.states = capture(self.sizes, self._run, device)
        self.proposing: Optional[Proposing] = None
        self.proposal_sizes: List[int] = []
        self.proposal_blocks: Dict[int, torch.Tensor] = {}
        self.proposals: Dict[int, torch.cuda.CUDAGraph] = {}
        self.drafts: Dict[int, torch.Tensor] = {}

    def capture_proposals(self, max_requests: int, proposing: Proposing) -> None:
        """Capture the greedy proposals of `proposing.draft_count` drafts (>= 1) for up to
        `max_requests` requests (at most max_rows)."""
        self.proposing = proposing
        self.proposal_sizes = graph_sizes(min(max_requests, self.max_rows))
        self.proposal_blocks = static_input_blocks(self.proposal_sizes, self.pad_row,
                                                   self.page_table.device)
        self.proposals, self.drafts = self._capture(self.proposal_sizes, self.proposal,
                                                    self.page_table.device)
        logger.info("captured %d EAGLE-3 proposal CUDA graphs (%d..%d requests, %d greedy "
                    "drafts each)", len(self.proposals), self.proposal_sizes[0],
                    self.proposal_sizes[-1], proposing.draft_count)

    def can_propose(self, requests: int, count: int) -> bool:
        """Whether `propose` replays for `requests` requests drafting `count` each."""
        return (self.proposing is not None and count == self.proposing.draft_count
                and requests <= self.proposal_sizes[-1])

    def fill_proposal(self, table_rows: Sequence[int], first: Sequence[int]) -> int:
        """Write the proposal block of the smallest size that holds requests at `table_rows`
        whose verify starts at positions `first`; that size."""
        size = next(s for s in self.proposal_sizes if s >= len(table_rows))
        block = self.proposal_blocks[size]
        copy_from_host(block, input_rows(table_rows, first, self.pad_row, block.shape[1]))
        return size

    def propose(self, table_rows: Sequence[int], first: Sequence[int]) -> torch.Tensor:
        """int64 [requests, count] on the device (valid until the next proposal): the greedy
        drafts of requests at `table_rows` whose verify starts at positions `first`
        (`can_propose`); the head's K/V at the slots the page table gives them."""
        size = self.fill_proposal(table_rows, first)
        self.proposals[size].replay()
        return self.drafts[size][:len(table_rows)]

    def proposal(self, n: int) -> torch.Tensor:
        """The body of the proposal graph of `n` requests (its block as `fill_proposal` wrote
        it): `greedy_drafts` with each step at the verify's position + j, a padding row
        staying at position 0 on the spare row."""
        assert self.proposing is not None  # capture_proposals set it
        count, states, target_ids, policy = self.proposing
        rows, first, _ = self.proposal_blocks[n][:, :n]
        real = (rows != self.pad_row).to(first.dtype)

        def step(j: int, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
            positions = first + j * real
            return self._step(rows, positions, positions + 1, ids, features)
        return greedy_drafts(self.model, policy, target_ids, states[rows], count, step)

    def _run(self, n: int) -> torch.Tensor:
        rows, positions, seq_lens = self.blocks[n][:, :n]
        return self._step(rows, positions, seq_lens, self.ids[:n], self.features[:n])

    def _step(self, rows: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
              ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head's step (captured) over decode rows in static int32 tensors."""
        n = rows.shape[0]
        batch = Batch(Phase.DECODE, [], [0] * n, [1] * n, [True] * n)
        batch.out_slots = self.page_table[rows, positions]
        batch.attn_meta = self.backend.graph_meta(rows, positions, seq_lens)
        return self.model.step(ids, features, self.model.rope_index.of_positions(positions),
                               batch, self.backend).residual  # type: ignore[arg-type]

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
