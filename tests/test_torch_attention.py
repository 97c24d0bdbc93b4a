"""The torch attention backend (the CPU path): exact against a plain softmax-attention reference,
and a long prompt's attention does not materialise a score matrix per head.

The second test is the guard against the CPU long-prompt regression: SDPA's math fallback
(which 3-D inputs or a boolean mask re-converted in every layer select) builds [heads, new,
seq] float32 scores, quadratic in the prompt and times the heads, where the fused kernel works
block by block. Instead of timing a long prompt (which flakes on a shared CI machine), it records
the size of every tensor the backend's ops create (a TorchDispatchMode sees each aten op, also
inside SDPA's decomposition) and bounds it: no float tensor of one head's scores ([new, seq]) in
a layer's forward, and only the one additive mask of that size per batch where a cached prefix
precedes a multi-token extend.
"""

from __future__ import annotations

import random
from typing import Any, List, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minisgl.attention import TorchBackend
from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.kvcache import KVPool

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16  # the default model's attention shape


class FloatSizes(TorchDispatchMode):
    """Records the element count of every floating-point tensor an aten op returns (an
    in-place op returns its input again: the same storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: List[Tuple[str, int, int]] = []  # (op, elements, storage address)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.sizes.append((str(func), t.numel(), t.untyped_storage().data_ptr()))
        return out


def _setup(prefix_lens: List[int], extend_lens: List[int], seed: int = 0
           ) -> Tuple[TorchBackend, Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-layer pool with random K/V, requests on shuffled pages, and the new tokens' q/k/v."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seqs = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_pages = sum(-(-s // PAGE) for s in seqs) + 1
    pool = KVPool(1, num_pages, PAGE, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    pool.k.normal_()
    pool.v.normal_()
    table = torch.zeros((len(seqs), max(seqs)), dtype=torch.int32)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    reqs, out_slots = [], []
    for row, (prefix, seq) in enumerate(zip(prefix_lens, seqs)):
        own = [pages.pop() for _ in range(-(-seq // PAGE))]
        slots = [own[p // PAGE] * PAGE + p % PAGE for p in range(seq)]
        table[row, :seq] = torch.tensor(slots, dtype=torch.int32)
        out_slots += slots[prefix:]
        reqs.append(Req(row, list(range(seq)), seq, SamplingParams(), (), table_row=row))
    phase = Phase.DECODE if all(e == 1 for e in extend_lens) else Phase.PREFILL
    batch = Batch(phase, reqs, prefix_lens, extend_lens, [True] * len(reqs))
    batch.out_slots = torch.tensor(out_slots, dtype=torch.int64)
    backend = TorchBackend(pool, table, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    new = sum(extend_lens)
    q = torch.randn(new, HEADS, HEAD_DIM)
    k, v = torch.randn(new, KV_HEADS, HEAD_DIM), torch.randn(new, KV_HEADS, HEAD_DIM)
    return backend, batch, q, k, v


def _reference(backend: TorchBackend, batch: Batch, q: torch.Tensor, last: int = 0
               ) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v per request, KV heads repeated for their groups,
    from the pool after the backend stored the new tokens; `last` > 0: only each request's last
    `last` queries."""
    outs, start = [], 0
    group = HEADS // KV_HEADS
    for req, prefix, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        slots = backend.page_table[req.table_row, :prefix + ext].long()
        k = backend.pool.k[0][slots].repeat_interleave(group, dim=1).transpose(0, 1)
        v = backend.pool.v[0][slots].repeat_interleave(group, dim=1).transpose(0, 1)
        first = ext - last if last else 0
        qi = q[start + first:start + ext].transpose(0, 1)
        scores = qi @ k.transpose(1, 2) * backend.scale
        positions = torch.arange(prefix + first, prefix + ext)[:, None]
        later = torch.arange(prefix + ext)[None, :] > positions
        probs = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
        outs.append((probs @ v).transpose(0, 1).reshape(ext - first, -1))
        start += ext
    return torch.cat(outs)


def test_matches_plain_attention() -> None:
    """A fresh prompt (causal), extends after a cached prefix longer (masked) and shorter
    (causal, padded) than they are, a one-token extend and a decode-like row, in one batch
    over scattered pages."""
    backend, batch, q, k, v = _setup([0, 21, 5, 0, 40], [13, 9, 17, 1, 1])
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch)
    assert out.shape == (q.shape[0], HEADS * HEAD_DIM)
    torch.testing.assert_close(out, _reference(backend, batch, q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix,ext", [(0, 1024), (200, 1024), (512, 512)])
def test_long_prompt_makes_no_score_matrix_per_head(prefix: int, ext: int) -> None:
    backend, batch, q, k, v = _setup([prefix], [ext])
    one_head = ext * (prefix + ext)  # one head's [new, seq] scores
    with FloatSizes() as made:
        backend.prepare(batch)
    masks = {ptr for _, n, ptr in made.sizes if n >= one_head}
    assert len(masks) == (1 if prefix >= ext else 0)
    assert max((n for _, n, _ in made.sizes), default=0) <= one_head
    with FloatSizes() as made:
        out = backend.forward(q, k, v, 0, batch)
    big = [(name, n) for name, n, _ in made.sizes if n >= one_head]
    assert not big, f"a layer's attention made {big} (one head's scores: {one_head} elements)"
    torch.testing.assert_close(out[-4:], _reference(backend, batch, q, last=4), rtol=1e-4,
                               atol=1e-5)
