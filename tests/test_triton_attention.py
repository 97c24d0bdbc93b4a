"""TritonBackend against TorchBackend on random pools and page tables.

On a machine without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1) on
small shapes; the `gpu` tests run the same comparison on large shapes and skip without CUDA.
The reference is TorchBackend in float32 on upcast copies of the same inputs, so the tolerance
measures the Triton backend's own rounding in each dtype.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import List, Tuple

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before the kernels are decorated (first import of triton_kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from minisgl.attention import TorchBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonBackend  # noqa: E402
from minisgl.core import Batch, Phase, Req, SamplingParams  # noqa: E402
from minisgl.kvcache import KVPool  # noqa: E402

# ||out - ref|| / ||ref|| bounds: float32 with IEEE dots is exact up to summation order; half
# types round p and the output to 8 (bf16) or 11 (fp16) mantissa bits.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NUM_LAYERS = 2


@dataclass
class Case:
    """A pool with random K/V everywhere, a batch whose requests own random pages, and q/k/v."""

    pool: KVPool
    page_table: torch.Tensor
    batch: Batch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _slots_for(pages: List[int], length: int, page_size: int) -> List[int]:
    return [pages[p // page_size] * page_size + p % page_size for p in range(length)]


def make_case(dtype: torch.dtype, device: str, page_size: int, heads: int, kv_heads: int,
              head_dim: int, prefix_lens: List[int], extend_lens: List[int], phase: Phase,
              seed: int) -> Case:
    """Build a random batch; every request's pages are scattered over a shuffled pool."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = [p + e for p, e in zip(prefix_lens, extend_lens)]
    need = [-(-s // page_size) for s in seqs]
    num_pages = sum(need) + 3  # a few pages nobody owns: their junk must never be read
    page_ids = list(range(num_pages))
    rng.shuffle(page_ids)
    n = len(seqs)
    num_rows = n + 3
    row_ids = rng.sample(range(num_rows), n)
    max_ctx = max(seqs) + 5
    pool = KVPool(NUM_LAYERS, num_pages, page_size, kv_heads, head_dim, dtype,
                  torch.device(device))
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    table = torch.zeros((num_rows, max_ctx), dtype=torch.int32)
    reqs, out_slots, used = [], [], 0
    for i, (row, seq, prefix) in enumerate(zip(row_ids, seqs, prefix_lens)):
        pages, used = page_ids[used:used + need[i]], used + need[i]
        slots = _slots_for(pages, seq, page_size)
        table[row, :seq] = torch.tensor(slots, dtype=torch.int32)
        out_slots.extend(slots[prefix:])
        reqs.append(Req(i, [0] * seq, seq, SamplingParams(), (), table_row=row))
    batch = Batch(phase, reqs, list(prefix_lens), list(extend_lens), [True] * n)
    batch.out_slots = torch.tensor(out_slots, dtype=torch.int64, device=device)
    t = sum(extend_lens)
    q = torch.randn((t, heads, head_dim), generator=gen).to(device, dtype)
    k = torch.randn((t, kv_heads, head_dim), generator=gen).to(device, dtype)
    v = torch.randn((t, kv_heads, head_dim), generator=gen).to(device, dtype)
    return Case(pool, table.to(device), batch, q, k, v)


def reference(case: Case, heads: int, kv_heads: int, head_dim: int, layer: int
              ) -> Tuple[torch.Tensor, KVPool]:
    """TorchBackend in float32 on copies of the case's pool and inputs."""
    src = case.pool
    pool = KVPool(NUM_LAYERS, src.num_pages, src.page_size, kv_heads, head_dim, torch.float32,
                  src.k.device)
    pool.k.copy_(src.k.float())
    pool.v.copy_(src.v.float())
    backend = TorchBackend(pool, case.page_table, heads, kv_heads, head_dim, head_dim ** -0.5)
    batch = Batch(case.batch.phase, case.batch.reqs, case.batch.prefix_lens,
                  case.batch.extend_lens, case.batch.sample)
    batch.out_slots = case.batch.out_slots
    backend.prepare(batch)
    out = backend.forward(case.q.float(), case.k.float(), case.v.float(), layer, batch)
    return out, pool


def run_and_compare(dtype: torch.dtype, device: str, page_size: int, heads: int, kv_heads: int,
                    head_dim: int, prefix_lens: List[int], extend_lens: List[int], phase: Phase,
                    seed: int = 0, min_split_tokens: int = 16) -> None:
    case = make_case(dtype, device, page_size, heads, kv_heads, head_dim, prefix_lens,
                     extend_lens, phase, seed)
    layer = 1
    ref, ref_pool = reference(case, heads, kv_heads, head_dim, layer)
    backend = TritonBackend(case.pool, case.page_table, heads, kv_heads, head_dim,
                            head_dim ** -0.5)
    if not HAS_CUDA:  # exercise flash-decoding splits on the interpreter's short sequences
        backend.num_sms = 64
    backend.min_split_tokens = min_split_tokens
    backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, layer, case.batch)
    if os.environ.get("MINISGL_TEST_VERBOSE"):
        o_part = case.batch.attn_meta.o_part
        print(f"{dtype} splits={None if o_part is None else o_part.shape[2]} "
              f"rel={((out.float() - ref).norm() / ref.norm()).item():.2e}")
    assert out.shape == (sum(extend_lens), heads * head_dim)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    out32 = out.float()
    rel = ((out32 - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[dtype], f"relative error {rel:.3g} >= {REL_TOL[dtype]}"
    torch.testing.assert_close(out32, ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    # The new K/V landed in their slots, and nothing else in the pool changed.
    torch.testing.assert_close(case.pool.k.float(), ref_pool.k, atol=0, rtol=0)
    torch.testing.assert_close(case.pool.v.float(), ref_pool.v, atol=0, rtol=0)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(4, 4), (4, 2), (8, 2)]  # (heads, kv_heads): group sizes 1, 2, 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_small(dtype: torch.dtype, page_size: int, heads: int, kv_heads: int) -> None:
    prefix = [0, 5, 17, 40, 63, 90]  # prefix 0: a request whose only token is the new one
    run_and_compare(dtype, "cuda" if HAS_CUDA else "cpu", page_size, heads, kv_heads, 32,
                    prefix, [1] * len(prefix), Phase.DECODE, seed=page_size + heads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_extend_small(dtype: torch.dtype, page_size: int, heads: int, kv_heads: int) -> None:
    # Mixed: fresh prompts, chunks after a prefix, a one-token chunk, a chunk over two tiles.
    prefix = [0, 21, 0, 48, 7]
    extend = [9, 13, 40, 1, 70]
    run_and_compare(dtype, "cuda" if HAS_CUDA else "cpu", page_size, heads, kv_heads, 32,
                    prefix, extend, Phase.PREFILL, seed=page_size * heads)


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_head_dim_not_power_of_two(phase: Phase) -> None:
    prefix = [3, 30]
    extend = [1, 1] if phase is Phase.DECODE else [5, 20]
    run_and_compare(torch.float32, "cuda" if HAS_CUDA else "cpu", 16, 4, 2, 48, prefix, extend,
                    phase)


def test_split_count_policy() -> None:
    case = make_case(torch.float32, "cpu", 16, 8, 2, 32, [10], [1], Phase.DECODE, 0)
    backend = TritonBackend(case.pool, case.page_table, 8, 2, 32, 1.0)
    assert backend.num_splits(1, 100) == 1  # shorter than one split
    assert backend.num_splits(1, 10_000) > 1  # long context, small batch: split
    assert backend.num_splits(256, 10_000) == 1  # the batch alone fills the device
    assert backend.num_splits(1, 10 ** 7) <= backend.max_splits


# --- large shapes on the GPU ---------------------------------------------------------------------
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (64, 8)])
@pytest.mark.parametrize("batch_size", [1, 64])
def test_decode_gpu(dtype: torch.dtype, page_size: int, heads: int, kv_heads: int,
                    batch_size: int) -> None:
    rng = random.Random(batch_size)
    prefix = [rng.randint(0, 4000) for _ in range(batch_size)]
    run_and_compare(dtype, "cuda", page_size, heads, kv_heads, 128, prefix, [1] * batch_size,
                    Phase.DECODE, seed=batch_size, min_split_tokens=256)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (64, 8)])
def test_extend_gpu(dtype: torch.dtype, page_size: int, heads: int, kv_heads: int) -> None:
    rng = random.Random(heads)
    prefix = [0, 0] + [rng.randint(0, 3000) for _ in range(10)]
    extend = [1024, 1] + [rng.randint(1, 600) for _ in range(10)]
    run_and_compare(dtype, "cuda", page_size, heads, kv_heads, 128, prefix, extend,
                    Phase.PREFILL, seed=heads)


# --- end to end: the engine with each backend ----------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_matches_torch_backend(tiny_model, page_size: int) -> None:
    """Greedy float32 generation is identical with either backend: chunked prefill (a budget of
    24 tokens), a prompt that shares a cached prefix with an earlier one, and decode."""
    from minisgl import LLM, SamplingParams

    model = tiny_model("qwen3")
    rng = random.Random(page_size)
    shared = [rng.randrange(1000) for _ in range(20)]
    prompts = [shared + [rng.randrange(1000) for _ in range(n)] for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        with LLM(str(model), dtype="float32", page_size=page_size, max_prefill_tokens=24,
                 attention_backend=backend, show_progress=False) as llm:
            first = llm.generate(prompts[:1], params)  # puts the shared prefix in the cache
            rest = llm.generate(prompts[1:], params)
        outputs[backend] = [o.token_ids for o in first + rest]
        assert rest[0].cached_tokens > 0  # the extend kernel read a cached prefix
    assert outputs["triton"] == outputs["torch"]
