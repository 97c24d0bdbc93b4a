"""CUDA graphs for short prefills of one request, alone or with running requests' decode rows.

A prefill of up to about a thousand tokens runs each of its several hundred kernels for less
time than the host takes to launch it (tens of microseconds of Python and Triton dispatch each),
so the device waits: the time to first token of such a prompt is launch-bound (on an H200 with
the Llama-3.1-8B shape, served prompts of 553-927 tokens waited 49-61 ms for their first token
eagerly, against 20-26 ms for 217-505 tokens through graphs; RESULTS.md, sixteenth session). One
graph per key (n, d) replays the whole forward, LM head included, for a batch of exactly one
request whose new tokens (at most n: `bucket_sizes` 64, 96, ..., 256, 320, ...) end in a sampled
token (a whole prompt or its last chunk, after any cached prefix), followed by at most d decode
rows (a mixed step, Batch.num_decode: `decode_row_sizes` 8, 16, 32, ...; d = 0 is the plain
prefill). Longer prefills, batches of several prompts, mixed steps with more decode rows, and
requests that want prompt log-probabilities run eagerly.

Inputs: one static int64 block per key, filled by ONE host-to-device copy before a replay: the n
input ids (padded with 0); the page-table rows of the prompt and of the d decode rows (padding
rows: the spare row); the prompt's cached prefix length, new-token count and the index of its
last new token; the d decode rows' positions (their cached lengths; padding: 0). The graph
derives the rest: positions (prefix + i for real prompt tokens, 0 for padding), the decode rows'
input ids (`last_tokens[rows]`: the newest token may not have reached the host, as in a decode
graph), the K/V slots (`page_table[row, position]`, written by the scheduler before the launch;
the pool's scratch slot for padding, so padding never touches a live request's cache), and the
attention metadata (16-byte aligned int32 rows, as Triton sees every index row). Padding rows
compute junk that no real row reads: every op but attention is row-wise, attention masks the
prompt's queries and keys by its real length, and a padding decode row attends to the scratch
slot alone.

Contract with the attention backend: `prefill_graph_meta(meta, max_extend, decode)` returns
metadata for a prefill over the static int32 block `meta` [5, 4] (rows, prefix lens, extend
lens, sequence lengths, query starts in column 0) whose extend lengths are at most `max_extend`,
followed, where `decode` = (rows, sequence lengths) is given, by that many decode rows (q rows
from `max_extend` on) attended unsplit, as an eager mixed step's are.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch

from minisgl.core import Batch, Phase
from minisgl.engine.cuda_graph import capture_graphs, logits_buffer
from minisgl.models import CausalLM
from minisgl.utils import copy_from_host

logger = logging.getLogger(__name__)

MIN_TOKENS = 64
FINE_FROM, FINE_STEP = 256, 64  # bucket_sizes: steps of 64 from 256 tokens on
MIN_DECODE_ROWS = 8
_FIELDS = 3  # prefix length, new tokens, last new token's index

Key = Tuple[int, int]  # (prompt tokens, decode rows) of one graph
Capture = Callable[[List[Key], Callable[[Key], torch.Tensor], torch.device],
                   Tuple[Dict[Key, torch.cuda.CUDAGraph], Dict[Key, torch.Tensor]]]


class PrefillGraphBackend(Protocol):
    def prefill_graph_meta(self, meta: torch.Tensor, max_extend: int,
                           decode: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                           ) -> object: ...


class PrefillReplayed(NamedTuple):
    logits: torch.Tensor  # [1 + decode rows, vocab], valid until the next replay
    rows: torch.Tensor  # [1 + decode rows] int64 page-table rows (static buffer view)


def bucket_sizes(max_tokens: int, context: Optional[int] = None) -> List[int]:
    """MIN_TOKENS (64) and up, each bucket the last plus a step: below FINE_FROM (256) the
    largest power of two up to half the last (64, 96, 128, 192, 256), then 64 (320, 384, ...,
    1,024), then from 1,024 the largest power of two up to an eighth of the last; up to
    max_tokens and the `context` length (a page-table row: a longer bucket would index past
    it), empty below MIN_TOKENS. A prompt is padded by less than half its length, and from
    FINE_FROM on by at most 64 tokens or an eighth (padding rows are computed like real ones:
    a 385-token prompt in a 512 bucket did a third more work than it needed; RESULTS.md,
    seventeenth session). Every size is a multiple of 16 (Triton specializes integer arguments
    on that, as it does for the eager steps' counts)."""
    if context is not None:
        max_tokens = min(max_tokens, context)
    sizes, n = [], MIN_TOKENS
    while n <= max_tokens:
        sizes.append(n)
        half, eighth = 1 << ((n // 2).bit_length() - 1), 1 << ((n // 8).bit_length() - 1)
        n += half if n < FINE_FROM else max(FINE_STEP, eighth)
    return sizes


def decode_row_sizes(max_rows: int) -> List[int]:
    """Decode-row buckets of the mixed graphs: MIN_DECODE_ROWS, twice that, ... up to max_rows
    (and max_rows itself); empty for 0. A padding decode row is one more row of the step's
    projections (a prompt bucket has hundreds) and an attention over one slot, so coarse
    buckets keep the graph count small at little cost."""
    sizes, d = [], MIN_DECODE_ROWS
    while d < max_rows:
        sizes.append(d)
        d *= 2
    return sizes + [max_rows] if max_rows > 0 else []


class PrefillGraphs:
    """Captures at construction (model, pool and page table ready, decode graphs captured); the
    engine calls `replay` for the batches `can_run` accepts. Every rank takes the same path for
    the same batch (the choice reads only the batch), so tp ranks stay in lockstep."""

    def __init__(self, model: CausalLM, backend: PrefillGraphBackend, max_tokens: int,
                 page_table: torch.Tensor, scratch_slot: int, last_tokens: torch.Tensor,
                 max_decode_rows: int = 0, capture: Capture = capture_graphs) -> None:
        """`capture(keys, run, device)` records `run(key)` for each key (a test may pass one
        that records nothing, to run the graphs' bodies eagerly on the CPU)."""
        self.model = model
        self.backend = backend
        self.page_table = page_table
        self.last_tokens = last_tokens
        self.scratch_slot = scratch_slot
        self.spare_row = page_table.shape[0] - 1  # at init used by no request; padding's row
        page_table[self.spare_row, 0] = scratch_slot  # padding decode rows read and write there
        self.sizes = bucket_sizes(max_tokens, page_table.shape[1])
        self.decode_sizes = decode_row_sizes(max_decode_rows)
        self.keys = [(n, d) for n in self.sizes for d in [0, *self.decode_sizes]]
        device = page_table.device
        self.blocks = {(n, d): torch.zeros(n + 2 * d + 1 + _FIELDS, dtype=torch.int64,
                                           device=device) for n, d in self.keys}
        self.graphs: Dict[Key, torch.cuda.CUDAGraph] = {}
        # 85 graphs' own logits held ~0.55 GB at a 128K vocabulary: they share one buffer.
        self.out = logits_buffer(model, 1 + self.max_decode_rows, device)
        self.logits: Dict[Key, torch.Tensor] = {}
        self._capture_all(capture, device)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @property
    def max_decode_rows(self) -> int:
        return self.decode_sizes[-1] if self.decode_sizes else 0

    def run(self, key: Key) -> torch.Tensor:
        """The forward a graph of `key` holds, over its static block (what `fill` wrote):
        logits [1 + d, vocab], a view of the buffer all graphs share (`out`, logits_buffer)."""
        n, d = key
        block = self.blocks[key]
        ids, rows = block[:n], block[n:n + 1 + d]
        prefix, ext, last = (block[n + 1 + d + i:n + 2 + d + i] for i in range(_FIELDS))
        index = torch.arange(n, device=block.device)
        real = index < ext
        positions = torch.where(real, prefix + index, 0)
        slots = torch.where(real, self.page_table[rows[:1], positions].to(torch.int64),
                            self.scratch_slot)
        # rows, prefix lens, extend lens, seq lens, query starts: one 16-byte row each
        meta = torch.stack([rows[:1], prefix, ext, prefix + ext, torch.zeros_like(ext)])
        meta = meta.to(torch.int32).expand(5, 4).contiguous()
        decode = None
        if d:  # the decode rows: inputs and slots as a decode graph derives them
            drows, dpos = rows[1:], block[n + 1 + d + _FIELDS:]
            ids = torch.cat([ids, self.last_tokens[drows]])
            positions = torch.cat([positions, dpos])
            slots = torch.cat([slots, self.page_table[drows, dpos].to(torch.int64)])
            last = torch.cat([last, n + torch.arange(d, device=block.device)])
            decode = (drows.to(torch.int32), (dpos + 1).to(torch.int32))
        batch = Batch(Phase.PREFILL, [], [0] * (1 + d), [n] + [1] * d, [True] * (1 + d),
                      num_decode=d)
        batch.out_slots = slots
        batch.attn_meta = self.backend.prefill_graph_meta(meta, n, decode)
        return self.model(ids, self.model.rope_index.of_positions(positions), batch,
                          self.backend, last, out=self.out[:1 + d])

    def _values(self, key: Key, ids: List[int], rows: List[int], prefix: int,
                positions: List[int]) -> List[int]:
        """A block's host values (the layout `run` reads): the prompt's new ids padded to n,
        the prompt's and decode rows' page-table rows and the decode rows' positions padded to
        d (the spare row at position 0), and the prompt's prefix, new-token count and last
        new token's index in between."""
        n, d = key
        pad = d - len(positions)
        return [*ids, *[0] * (n - len(ids)), *rows, *[self.spare_row] * pad,
                prefix, len(ids), len(ids) - 1, *positions, *[0] * pad]

    def _capture_all(self, capture: Capture, device: torch.device) -> None:
        for key in self.keys:  # capture-time values: a whole bucket of new tokens, the spare row
            self.blocks[key].copy_(torch.tensor(
                self._values(key, [0] * key[0], [self.spare_row], 0, [])))
        self.graphs, self.logits = capture(self.keys, self.run, device)
        logger.info("captured %d prefill CUDA graphs (one request, %d..%d tokens; with up to "
                    "%d decode rows riding along: %s)", len(self.keys), self.sizes[0],
                    self.max_tokens, self.max_decode_rows, self.decode_sizes or "none")

    def can_run(self, batch: Batch, joining: int = 0) -> bool:
        """One prompt of at most max_tokens new tokens ending in a sampled token, then at most
        max_decode_rows decode rows (every one sampled, as decode rows are): those of `batch`
        and `joining` more (the scheduler asking before it mixes a step); not a long longrope
        sequence's, whose tokens all take the long table (Req.long_rope; the graph derives
        rope indices from positions alone)."""
        return (batch.phase is Phase.PREFILL and batch.first_decode == 1 and all(batch.sample)
                and batch.extend_lens[0] <= self.max_tokens
                and batch.num_decode + joining <= self.max_decode_rows
                and not batch.reqs[0].long_rope)

    def fill(self, batch: Batch) -> Key:
        """Write a batch `can_run` accepts into the static block of its graph; that graph's
        key (the buckets of its prompt tokens and decode rows)."""
        req, prefix, ext = batch.reqs[0], batch.prefix_lens[0], batch.extend_lens[0]
        key = (next(s for s in self.sizes if s >= ext),
               next(s for s in [0, *self.decode_sizes] if s >= batch.num_decode))
        copy_from_host(self.blocks[key], self._values(
            key, req.token_ids[prefix:prefix + ext], [r.table_row for r in batch.reqs], prefix,
            batch.prefix_lens[1:]))
        return key

    def token_rows(self, batch: Batch) -> List[int]:
        """Where a replay of `batch` computes its tokens, in the batch's order: the prompt's
        from row 0, its decode rows after the prompt's bucket (its hidden states' rows)."""
        n = next(s for s in self.sizes if s >= batch.extend_lens[0])
        return [*range(batch.extend_lens[0]), *range(n, n + batch.num_decode)]

    def replay(self, batch: Batch) -> PrefillReplayed:
        n, d = key = self.fill(batch)
        self.graphs[key].replay()
        rows = 1 + batch.num_decode
        return PrefillReplayed(self.logits[key][:rows], self.blocks[key][n:n + rows])


def capture_prefill_graphs(model: CausalLM, backend: object, max_tokens: int,
                           page_table: torch.Tensor, scratch_slot: int,
                           last_tokens: torch.Tensor, max_decode_rows: int = 0
                           ) -> Optional[PrefillGraphs]:
    """The prefill graphs (with mixed-step variants of up to `max_decode_rows` decode rows), or
    None (logged) where none apply: no bucket, a backend without the contract, or a model whose
    prefill cannot be captured."""
    if not bucket_sizes(max_tokens, page_table.shape[1]) or not hasattr(backend,
                                                                          "prefill_graph_meta"):
        return None
    try:
        return PrefillGraphs(model, backend, max_tokens,
                             page_table, scratch_slot, last_tokens, max_decode_rows)
    except RuntimeError as e:  # e.g. a host sync inside the forward: eager prefill still works
        logger.warning("prefill CUDA graphs not captured, prefill runs eagerly: %s", e)
        torch.cuda.synchronize(page_table.device)
        return None
