"""Start-up runs of the eager forward paths, so that their kernels compile before serving.

The CUDA graphs (decode, and prefills of one request up to `prefill_graph_tokens`) compile the
Triton kernels they hold when they are captured. A step that runs eagerly can pick variants no
capture compiled: Triton specializes a kernel on its tile constants (the extend kernel's large
tiles for chunks whose longest prompt has 1,024 new tokens or more) and on whether integer
arguments are multiples of 16 (token counts of eager steps rarely are). On a machine with an
empty Triton cache each such variant compiled at its first use, inside a request's time to first
token (a 519-token prompt waited 199 ms: benchmarks/RESULTS.md, fourteenth session).

`warmup_batches` builds a few batches of junk tokens that take those paths: every request sits
in the page table's spare row (zeros: its reads hit slot 0, junk at start) and every new token's
K/V goes to the pool's scratch slot, so no live request's cache is touched (none exists yet). The
engine runs them once through its own `forward`, on every rank in the same order (the forward's
collectives keep tp ranks in lockstep).
"""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Tuple

import torch

from minisgl.core import Batch, Phase, Req, SamplingParams

# Past the large-tile threshold of kernels/attention.extend_tiles, and not a multiple of 16.
_LONG = 1031
_SHORT = 37


class WarmupShape(NamedTuple):
    """One warm-up batch: the prompts' new-token counts, then the decode rows' context lengths
    (a mixed step's; none in a plain prefill)."""

    prompts: Tuple[int, ...]
    decodes: Tuple[int, ...] = ()

    @property
    def longest(self) -> int:
        return max((*self.prompts, *(n + 1 for n in self.decodes)))


def warmup_shapes(graph_tokens: int, max_context: int) -> List[WarmupShape]:
    """The eager steps to run once: one prompt just past the prefill graphs, one long prompt
    alone (the dense path) and beside a short one (the large extend tiles), a prompt with two
    decode rows riding along (a mixed step). Shapes longer than `max_context` are left out."""
    past_graphs = graph_tokens + 9 if graph_tokens else _SHORT
    shapes = [WarmupShape((past_graphs,)), WarmupShape((_LONG,)), WarmupShape((_LONG, _SHORT)),
              WarmupShape((_SHORT,), (past_graphs, _SHORT))]
    return [s for s in shapes if s.longest <= max_context]


def warmup_batches(shapes: List[WarmupShape], spare_row: int, scratch_slot: int,
                   device: torch.device) -> Iterator[Batch]:
    """A ready batch per shape (see the module's doc): greedy requests of token 0 in
    `spare_row`, every new token's K/V written to `scratch_slot`."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    for shape in shapes:
        reqs, prefix, ext = [], [], []
        for n in shape.prompts:
            reqs.append(Req(-1, [0] * n, n, greedy, (), table_row=spare_row))
            prefix.append(0)
            ext.append(n)
        for n in shape.decodes:
            reqs.append(Req(-1, [0] * (n + 1), n, greedy, (), table_row=spare_row))
            prefix.append(n)
            ext.append(1)
        batch = Batch(Phase.PREFILL, reqs, prefix, ext, [True] * len(reqs),
                      num_decode=len(shape.decodes))
        batch.out_slots = torch.full((sum(ext),), scratch_slot, dtype=torch.int32,
                                     device=device)
        yield batch
