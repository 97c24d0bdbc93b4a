"""CUDA graphs for speculative decoding's verify batches (Phase.VERIFY).

A verify step extends each running request by its newest token and up to K draft tokens and
samples every one of those positions: a forward of a few tokens per request, as launch-bound
as a decode step (hundreds of small kernels), which eagerly cost more than the drafts saved.
One graph per batch size in `graph_sizes(max_bs)` replays the whole forward, LM head
included, for `bs` requests of at most `tokens` (= K + 1) new tokens each.

Inputs: one static int64 block per size, filled by ONE host-to-device copy before a replay:
the requests' new tokens (request i's at [i * tokens, i * tokens + count_i), padded with 0);
the logits rows to compute, compacted (request i's j-th new token is row i * tokens + j),
padded with row 0; the page-table row of each logits row (padding: the spare row); and per
request its page-table row, cached length (prefix) and new-token count. Padding requests sit
on the spare row with one token, as a decode graph's padding does. The graph derives each
token's position (prefix + j), K/V slot (`page_table[row, position]`, written by the scheduler
before the launch) and attention metadata: every token is a decode row over its request's
page-table row whose sequence ends at that token (the backend's decode `graph_meta`; the
new tokens' K/V are stored before attention reads them), as the Triton backend's eager verify
step attends (`TritonBackend.verify_meta`). Padding tokens are decode rows on the spare row at
position 0, whose slot is the pool's scratch slot, so padding never touches a live request's
cache, and compute junk that no real row reads.

The logits come back in the eager verify step's order (request by request, position by
position), so sampling (engine.verify_views, draft_prefixes) reads them as it reads eager ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.cuda_graph import (Capture, GraphableBackend, capture_graphs, graph_sizes,
                                       logits_buffer)
from minisgl.models import CausalLM
from minisgl.utils import aligned_width, copy_from_host

logger = logging.getLogger(__name__)

# The most tokens a verify graph holds (batch size x (K + 1)); vLLM captures its graphs up to
# 512 tokens by default. Larger verify batches run eagerly, where the step is compute-bound
# anyway.
MAX_GRAPH_TOKENS = 512

class VerifyReplayed(NamedTuple):
    logits: torch.Tensor  # [new tokens of the batch, vocab], valid until the next replay
    rows: torch.Tensor  # [new tokens] int64 page-table row of each logits row (static view)


@dataclass(frozen=True)
class VerifyLayout:
    """Where a block of `bs` requests of `tokens` slots keeps each field (offsets into it)."""

    bs: int
    tokens: int

    @property
    def width(self) -> int:
        return self.bs * self.tokens

    @property
    def ids(self) -> slice:
        return slice(0, self.width)

    @property
    def logit_index(self) -> slice:
        return slice(self.width, 2 * self.width)

    @property
    def logit_rows(self) -> slice:
        return slice(2 * self.width, 3 * self.width)

    @property
    def rows(self) -> slice:
        return slice(3 * self.width, 3 * self.width + self.bs)

    @property
    def prefix(self) -> slice:
        return slice(3 * self.width + self.bs, 3 * self.width + 2 * self.bs)

    @property
    def counts(self) -> slice:
        return slice(3 * self.width + 2 * self.bs, 3 * self.width + 3 * self.bs)

    @property
    def size(self) -> int:
        return 3 * self.width + 3 * self.bs


class VerifyGraphs:
    """Captures at construction (model, pool and page table ready); the engine calls `replay`
    for the verify batches `can_run` accepts. Every rank takes the same path for the same
    batch (the choice reads only the batch), so tp ranks stay in lockstep."""

    def __init__(self, model: CausalLM, backend: GraphableBackend, max_bs: int, tokens: int,
                 page_table: torch.Tensor, pad_row: int, scratch_slot: int,
                 capture: Capture = capture_graphs) -> None:
        """`tokens`: the most new tokens a request brings (1 + the drafts' K); `pad_row`: the
        spare page-table row, whose position 0 maps to `scratch_slot`; the backend's graph
        buffers (`init_graph_buffers`, the decode graphs') hold at least max_bs * tokens
        rows. `capture(keys, run, device)` records `run(key)` for each key (a test may pass
        one that records nothing, to run the graphs' bodies eagerly on the CPU)."""
        if tokens < 1 or max_bs < 1:
            raise ValueError(f"verify graphs need at least one request of one token, got "
                             f"max_bs {max_bs}, tokens {tokens}")
        self.model = model
        self.backend = backend
        self.page_table = page_table
        self.pad_row = pad_row
        self.scratch_slot = scratch_slot
        self.tokens = tokens
        page_table[pad_row, 0] = scratch_slot  # padding requests write and read only there
        self.sizes = graph_sizes(max_bs)
        device = page_table.device
        self.blocks = {bs: torch.zeros(VerifyLayout(bs, tokens).size, dtype=torch.int64,
                                       device=device) for bs in self.sizes}
        self.out = logits_buffer(model, self.sizes[-1] * tokens, device)
        for bs in self.sizes:  # capture-time values: padding requests only
            self.blocks[bs].copy_(torch.tensor(self._values(bs, [], [], [], [])))
        self.graphs: Dict[int, torch.cuda.CUDAGraph]
        self.logits: Dict[int, torch.Tensor]
        self.graphs, self.logits = capture(self.sizes, self.run, device)
        logger.info("captured %d verify CUDA graphs (batch sizes %d..%d, up to %d tokens a "
                    "request)", len(self.sizes), self.sizes[0], self.max_bs, tokens)

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def run(self, bs: int) -> torch.Tensor:
        """The forward a graph of `bs` requests holds, over its static block (what `fill`
        wrote): logits [bs * tokens, vocab], a view of the buffer all graphs share, whose first
        rows are the batch's new tokens in order."""
        lay = VerifyLayout(bs, self.tokens)
        block = self.blocks[bs]
        rows, prefix, count = block[lay.rows], block[lay.prefix], block[lay.counts]
        j = torch.arange(self.tokens, device=block.device)
        real = j[None, :] < count[:, None]  # [bs, tokens]
        positions = torch.where(real, prefix[:, None] + j[None, :], 0)
        # padding tokens attend as a padding decode row does: the spare row's scratch slot
        token_rows = torch.where(real, rows[:, None], self.pad_row).flatten()
        slots = self.page_table[token_rows, positions.flatten()].to(torch.int64)
        # rows, positions, sequence lengths: one 16-byte aligned int32 row each
        meta = torch.zeros((3, aligned_width(lay.width, torch.int32)), dtype=torch.int32,
                           device=block.device)
        meta[:, :lay.width] = torch.stack([token_rows, positions.flatten(),
                                           positions.flatten() + 1])
        batch = Batch(Phase.VERIFY, [], [0] * bs, [self.tokens] * bs, [True] * bs)
        batch.out_slots = slots
        batch.attn_meta = self.backend.graph_meta(*meta[:, :lay.width])
        return self.model(block[lay.ids], self.model.rope_index.of_positions(positions.flatten()),
                          batch, self.backend, block[lay.logit_index],
                          out=self.out[:lay.width])

    def _values(self, bs: int, ids: List[List[int]], rows: List[int], prefix: List[int],
                logit_rows: List[int]) -> List[int]:
        """A block's host values (the layout `run` reads) for requests whose new tokens are
        `ids` (one list each) at page-table `rows` after `prefix` cached tokens, padded to `bs`
        requests of `tokens` slots."""
        t, pad = self.tokens, bs - len(ids)
        flat = [tok for new in ids for tok in (*new, *[0] * (t - len(new)))] + [0] * (pad * t)
        index = [i * t + j for i, new in enumerate(ids) for j in range(len(new))]
        index += [0] * (bs * t - len(index))
        per_row = [*logit_rows, *[self.pad_row] * (bs * t - len(logit_rows))]
        return [*flat, *index, *per_row, *rows, *[self.pad_row] * pad, *prefix, *[0] * pad,
                *(len(new) for new in ids), *[1] * pad]

    def can_run(self, batch: Batch) -> bool:
        """A verify batch of at most max_bs requests of at most `tokens` new tokens each, none
        a long longrope sequence's (the graph derives rope indices from positions alone)."""
        return (batch.phase is Phase.VERIFY and batch.drafts is not None
                and batch.size <= self.max_bs and max(batch.extend_lens) <= self.tokens
                and not any(r.long_rope for r in batch.reqs))

    def fill(self, batch: Batch) -> int:
        """Write a batch `can_run` accepts into the static block of its graph; that graph's
        batch size (the next one up)."""
        bs = next(s for s in self.sizes if s >= batch.size)
        drafts = batch.drafts or []
        ids = [[req.token_ids[prefix], *draft]
               for req, prefix, draft in zip(batch.reqs, batch.prefix_lens, drafts)]
        logit_rows = [r.table_row for r, n in zip(batch.reqs, batch.extend_lens)
                      for _ in range(n)]
        copy_from_host(self.blocks[bs], self._values(
            bs, ids, [r.table_row for r in batch.reqs], batch.prefix_lens, logit_rows))
        return bs

    def token_rows(self, batch: Batch) -> List[int]:
        """Where a replay of `batch` computes its tokens, in the batch's order (request i's
        from row i * tokens: its hidden states' rows)."""
        return [i * self.tokens + j for i, n in enumerate(batch.extend_lens) for j in range(n)]

    def replay(self, batch: Batch) -> VerifyReplayed:
        bs = self.fill(batch)
        self.graphs[bs].replay()
        n = sum(batch.extend_lens)
        lay = VerifyLayout(bs, self.tokens)
        return VerifyReplayed(self.logits[bs][:n], self.blocks[bs][lay.logit_rows][:n])


def verify_graph_bs(graph_bs: int, tokens: int, max_requests: Optional[int] = None) -> int:
    """The largest verify graph's batch size: at most `graph_bs` requests (the decode graphs'),
    MAX_GRAPH_TOKENS tokens in all, and `max_requests` requests (past which no step drafts;
    None: no limit); 0: none. The backend's graph buffers must hold its rows
    (`graph_buffer_rows`)."""
    bs = min(graph_bs, MAX_GRAPH_TOKENS // max(tokens, 1))
    return bs if max_requests is None else min(bs, max_requests)


def graph_buffer_rows(graph_bs: int, tokens: int, max_requests: Optional[int] = None) -> int:
    """The rows the backend's graph buffers need for decode graphs of `graph_bs` requests and,
    with `tokens` (> 0: speculation), verify graphs of `verify_graph_bs` requests of `tokens`
    rows each: at batch 1 the verify graph needs `tokens` rows where the decode graph needs one."""
    if tokens <= 0:
        return graph_bs
    return max(graph_bs, verify_graph_bs(graph_bs, tokens, max_requests) * tokens)


def capture_verify_graphs(model: CausalLM, backend: object, max_bs: int, tokens: int,
                          page_table: torch.Tensor, pad_row: int,
                          scratch_slot: int) -> Optional[VerifyGraphs]:
    """The verify graphs of up to `max_bs` requests (`verify_graph_bs`; after the decode
    graphs, whose backend buffers hold `graph_buffer_rows` rows), or None (logged) where none
    apply: no batch size, a backend without the contract, or a model whose forward cannot be
    captured."""
    if not max_bs or not isinstance(backend, GraphableBackend):
        return None
    try:
        return VerifyGraphs(model, backend, max_bs, tokens, page_table, pad_row, scratch_slot)
    except RuntimeError as e:  # e.g. a host sync inside the forward: eager verify still works
        logger.warning("verify CUDA graphs not captured, verify steps run eagerly: %s", e)
        torch.cuda.synchronize(page_table.device)
        return None
