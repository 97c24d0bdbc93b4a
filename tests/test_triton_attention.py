"""TritonBackend against TorchBackend on random pools and page tables.

On a machine without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1) on
small shapes; the `gpu` tests run the same comparison on large shapes and skip without CUDA.
The reference is TorchBackend in float32 on upcast copies of the same inputs, so the tolerance
measures the Triton backend's own rounding in each dtype. With an FP8 pool the reference holds
the same FP8-rounded K/V, dequantized to float32 (and the new tokens' K/V rounded as the store
rounds them), so the tolerance again measures only the attention's own rounding.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before the kernels are decorated (first import of minisgl.kernels.attention).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if TYPE_CHECKING:
    from minisgl.engine import Engine

from minisgl.attention import TorchBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonBackend  # noqa: E402
from minisgl.core import Batch, Phase, Req, SamplingParams  # noqa: E402
from minisgl.kernels.policy import KernelPolicy  # noqa: E402
from minisgl.kernels.types import DecodeTiles  # noqa: E402
from minisgl.kvcache import KVPool  # noqa: E402
from minisgl.kvcache.pool import FP8_KV_DTYPE, KVScales, dequantize, quantize  # noqa: E402

# ||out - ref|| / ||ref|| bounds: float32 with IEEE dots is exact up to summation order; half
# types round p and the output to 8 (bf16) or 11 (fp16) mantissa bits.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NUM_LAYERS = 2
# Per-layer scales of the FP8 cases: K/V of about N(0, 1) stored as about 30-200x that, so
# the largest V values saturate at 448.
FP8_SCALES = KVScales((0.03, 0.02), (0.01, 0.005))


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
              seed: int, kv_dtype: Optional[torch.dtype] = None, num_decode: int = 0) -> Case:
    """Build a random batch; every request's pages are scattered over a shuffled pool.
    `kv_dtype`: the pool's (FP8: with FP8_SCALES), else `dtype`. `num_decode`: the last
    requests decode alongside the prefill (a mixed step)."""
    rng = random.Random(seed)
    gen = torch.Generator(device).manual_seed(seed)  # on the device: GPU pools are large
    seqs = [p + e for p, e in zip(prefix_lens, extend_lens)]
    need = [-(-s // page_size) for s in seqs]
    num_pages = sum(need) + 3  # a few pages nobody owns: their junk must never be read
    page_ids = list(range(num_pages))
    rng.shuffle(page_ids)
    n = len(seqs)
    num_rows = n + 3
    row_ids = rng.sample(range(num_rows), n)
    max_ctx = max(seqs) + 5
    fp8 = kv_dtype == FP8_KV_DTYPE
    pool = KVPool(NUM_LAYERS, num_pages, page_size, kv_heads, head_dim, kv_dtype or dtype,
                  torch.device(device), FP8_SCALES if fp8 else None)
    if fp8:
        pool.fill_normal_(gen)
    else:
        pool.k.normal_(generator=gen)
        pool.v.normal_(generator=gen)
    table = torch.zeros((num_rows, max_ctx), dtype=torch.int32)
    reqs, out_slots, used = [], [], 0
    for i, (row, seq, prefix) in enumerate(zip(row_ids, seqs, prefix_lens)):
        pages, used = page_ids[used:used + need[i]], used + need[i]
        slots = _slots_for(pages, seq, page_size)
        table[row, :seq] = torch.tensor(slots, dtype=torch.int32)
        out_slots.extend(slots[prefix:])
        reqs.append(Req(i, [0] * seq, seq, SamplingParams(), (), table_row=row))
    batch = Batch(phase, reqs, list(prefix_lens), list(extend_lens), [True] * n,
                  num_decode=num_decode)
    batch.out_slots = torch.tensor(out_slots, dtype=torch.int64, device=device)
    t = sum(extend_lens)
    q, k, v = (torch.randn((t, h, head_dim), generator=gen, device=device).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    return Case(pool, table.to(device), batch, q, k, v)


def _as_float32(pool: KVPool, cache: torch.Tensor, scales: Tuple[float, ...]) -> torch.Tensor:
    """A pool's K or V cache as the float32 values it stands for."""
    if not pool.quantized:
        return cache.float()
    return torch.stack([dequantize(cache[i], scales[i], torch.float32)
                        for i in range(cache.shape[0])])


def reference(case: Case, heads: int, kv_heads: int, head_dim: int, layer: int,
              windows: Tuple[int, ...] = (), softcap: float = 0.0
              ) -> Tuple[torch.Tensor, KVPool]:
    """TorchBackend in float32 on copies of the case's pool and inputs (an FP8 pool's values
    dequantized, the new K/V rounded as an FP8 store rounds them); `windows`: the layers'
    sliding windows; `softcap`: the scores' cap."""
    src = case.pool
    pool = KVPool(NUM_LAYERS, src.num_pages, src.page_size, kv_heads, head_dim, torch.float32,
                  src.k.device)
    pool.k.copy_(_as_float32(src, src.k, src.scales.k))
    pool.v.copy_(_as_float32(src, src.v, src.scales.v))
    k, v = case.k.float(), case.v.float()
    if src.quantized:
        k = dequantize(quantize(k, src.scales.k[layer]), src.scales.k[layer], torch.float32)
        v = dequantize(quantize(v, src.scales.v[layer]), src.scales.v[layer], torch.float32)
    backend = TorchBackend(pool, case.page_table, heads, kv_heads, head_dim, head_dim ** -0.5,
                           windows, softcap)
    batch = Batch(case.batch.phase, case.batch.reqs, case.batch.prefix_lens,
                  case.batch.extend_lens, case.batch.sample)
    batch.out_slots = case.batch.out_slots
    backend.prepare(batch)
    out = backend.forward(case.q.float(), k, v, layer, batch)
    return out, pool


def run_and_compare(dtype: torch.dtype, device: str, page_size: int, heads: int, kv_heads: int,
                    head_dim: int, prefix_lens: List[int], extend_lens: List[int], phase: Phase,
                    seed: int = 0, min_split_tokens: int = 16, num_sms: int = 64,
                    kv_dtype: Optional[torch.dtype] = None, backend_name: str = "triton",
                    num_decode: int = 0, window: int = 0, softcap: float = 0.0) -> None:
    """`backend_name`: the backend under test ("torch": the CPU path, on an FP8 pool).
    `num_decode`: see make_case (the reference runs the batch as a plain prefill). `window`:
    the sliding window of the layer compared (layer 1; layer 0 has none). `softcap`: the
    scores' cap (Gemma 2's)."""
    case = make_case(dtype, device, page_size, heads, kv_heads, head_dim, prefix_lens,
                     extend_lens, phase, seed, kv_dtype, num_decode)
    layer = 1
    windows = (0, window) if window else ()
    ref, ref_pool = reference(case, heads, kv_heads, head_dim, layer, windows, softcap)
    if backend_name == "torch":
        backend = TorchBackend(case.pool, case.page_table, heads, kv_heads, head_dim,
                               head_dim ** -0.5, windows, softcap)
    else:
        backend = TritonBackend(case.pool, case.page_table, heads, kv_heads, head_dim,
                                head_dim ** -0.5, windows=windows, softcap=softcap)
        if not HAS_CUDA:  # exercise flash-decoding splits on the interpreter's short sequences
            backend.num_sms = num_sms
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
    # The new K/V landed in their slots (rounded as FP8 stores round), nothing else changed.
    pool = case.pool
    torch.testing.assert_close(_as_float32(pool, pool.k, pool.scales.k), ref_pool.k, atol=0,
                               rtol=0)
    torch.testing.assert_close(_as_float32(pool, pool.v, pool.scales.v), ref_pool.v, atol=0,
                               rtol=0)


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


@pytest.mark.parametrize("dtype,page_size,kv_dtype", [
    (torch.float32, 1, None), (torch.bfloat16, 16, None), (torch.float16, 16, None),
    (torch.bfloat16, 16, FP8_KV_DTYPE)], ids=["f32-p1", "bf16-p16", "f16-p16", "bf16-fp8kv"])
def test_mixed_step_small(dtype: torch.dtype, page_size: int,
                          kv_dtype: Optional[torch.dtype]) -> None:
    """A mixed step: prompts (a fresh one, a chunk after a prefix, a one-token chunk) then four
    requests decoding one token each, whose attention runs the decode kernel (with splits):
    the same as the whole batch through the extend path of the reference."""
    run_and_compare(dtype, "cuda" if HAS_CUDA else "cpu", page_size, 8, 2, 32,
                    [0, 21, 48, 5, 17, 90], [9, 13, 1, 1, 1, 1], Phase.PREFILL,
                    seed=page_size + 11, kv_dtype=kv_dtype, num_decode=4)


# --- sliding windows ------------------------------------------------------------------------------
def naive_windowed(case: Case, heads: int, kv_heads: int, head_dim: int, layer: int,
                   window: int, softcap: float = 0.0) -> torch.Tensor:
    """Float32 attention, one query at a time, of each new token at position p over the keys at
    positions p - window + 1 .. p (transformers' sliding-window mask; window 0: all before it),
    scores capped to softcap * tanh(s / softcap) where `softcap` is given, from the case's
    pool with the new K/V put in their slots: a reference that shares no code with the
    backends."""
    k_all, v_all = case.pool.k[layer].float().clone(), case.pool.v[layer].float().clone()
    k_all[case.batch.out_slots] = case.k.float()
    v_all[case.batch.out_slots] = case.v.float()
    out, t = [], 0
    for req, prefix, ext in zip(case.batch.reqs, case.batch.prefix_lens, case.batch.extend_lens):
        for p in range(prefix, prefix + ext):
            lo = max(0, p - window + 1) if window else 0
            slots = case.page_table[req.table_row, lo:p + 1].long()
            k = k_all[slots].repeat_interleave(heads // kv_heads, 1)  # [n, heads, d]
            v = v_all[slots].repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,nhd->hn", case.q[t].float(), k) * head_dim ** -0.5
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            w = torch.softmax(scores, dim=-1)
            out.append(torch.einsum("hn,nhd->hd", w, v).reshape(-1))
            t += 1
    return torch.stack(out)


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
@pytest.mark.parametrize("window", [1, 5, 24])
def test_torch_backend_window_is_the_masked_attention(phase: Phase, window: int) -> None:
    """TorchBackend with a sliding window (the reference of the Triton tests below) equals the
    one-query-at-a-time float32 attention over each token's window: requests shorter than the
    window, a decode past it, fresh prompts and chunks after a prefix longer and shorter than
    their own length."""
    prefix = [0, 5, 17, 40, 3] if phase is Phase.PREFILL else [0, 5, 17, 40, 63]
    extend = [9, 13, 40, 30, 1] if phase is Phase.PREFILL else [1] * 5
    case = make_case(torch.float32, "cpu", 4, 8, 2, 32, prefix, extend, phase, seed=window)
    want = naive_windowed(case, 8, 2, 32, 1, window)
    got, _ = reference(case, 8, 2, 32, 1, (0, window))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    full, _ = reference(case, 8, 2, 32, 1)
    assert not torch.allclose(full, want, atol=1e-3)  # the window changes the answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [5, 24, 70])
def test_decode_window(dtype: torch.dtype, window: int) -> None:
    """Split decode (16-token splits over each request's window) and unsplit decode of a
    sliding-window layer: requests shorter than the window, at it and far past it."""
    device = "cuda" if HAS_CUDA else "cpu"
    prefix = [0, 5, 23, 24, 40, 90]
    run_and_compare(dtype, device, 16, 8, 2, 32, prefix, [1] * len(prefix), Phase.DECODE,
                    seed=window, window=window)
    if not HAS_CUDA:
        run_and_compare(dtype, "cpu", 16, 8, 2, 32, prefix, [1] * len(prefix), Phase.DECODE,
                        seed=window, min_split_tokens=4096, num_sms=1, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [5, 24, 100])
def test_extend_window(dtype: torch.dtype, page_size: int, window: int) -> None:
    """The extend kernel of a sliding-window layer: windows shorter than a tile (5), between
    (24) and longer than the chunks (100); fresh prompts, chunks after prefixes, a one-token
    chunk, a chunk of several tiles after a long prefix."""
    run_and_compare(dtype, "cuda" if HAS_CUDA else "cpu", page_size, 8, 2, 32,
                    [0, 21, 0, 48, 7, 130], [9, 13, 70, 1, 40, 66], Phase.PREFILL,
                    seed=window + page_size, window=window)


def test_mixed_step_window_fp8_kv() -> None:
    """A mixed step over an FP8 pool in a sliding-window layer: the prompts' extend kernel and
    the decode rows' split kernel both keep to the window."""
    run_and_compare(torch.bfloat16, "cuda" if HAS_CUDA else "cpu", 16, 8, 2, 32,
                    [0, 21, 48, 5, 17, 90], [30, 13, 1, 1, 1, 1], Phase.PREFILL, seed=2,
                    kv_dtype=FP8_KV_DTYPE, num_decode=4, window=20)


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
@pytest.mark.parametrize("window", [0, 5])
def test_torch_backend_softcap_is_the_capped_attention(phase: Phase, window: int) -> None:
    """Gemma 2's softcapped scores in the CPU backend (with and without a window) equal the
    one-query-at-a-time reference, and differ from uncapped attention."""
    prefix = [0, 5, 17, 40, 3] if phase is Phase.PREFILL else [0, 5, 17, 40, 63]
    extend = [9, 13, 40, 30, 1] if phase is Phase.PREFILL else [1] * 5
    case = make_case(torch.float32, "cpu", 4, 8, 2, 32, prefix, extend, phase, seed=window + 1)
    case = dataclasses.replace(case, q=case.q * 8)  # scores large enough for a cap of 2 to bite
    want = naive_windowed(case, 8, 2, 32, 1, window, softcap=2.0)
    got, _ = reference(case, 8, 2, 32, 1, (0, window) if window else (), softcap=2.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain, _ = reference(case, 8, 2, 32, 1, (0, window) if window else ())
    assert not torch.allclose(plain, want, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
@pytest.mark.parametrize("window", [0, 24])
def test_softcap_kernels(dtype: torch.dtype, phase: Phase, window: int) -> None:
    """The decode (split) and extend kernels with softcapped scores, with and without a
    window, against the CPU backend; and a mixed step over an FP8 pool."""
    device = "cuda" if HAS_CUDA else "cpu"
    prefix = [0, 5, 23, 40, 90] if phase is Phase.DECODE else [0, 21, 0, 48, 130]
    extend = [1] * 5 if phase is Phase.DECODE else [9, 13, 70, 1, 66]
    run_and_compare(dtype, device, 16, 8, 2, 32, prefix, extend, phase, seed=window + 3,
                    window=window, softcap=2.0)
    if phase is Phase.PREFILL and window:
        run_and_compare(torch.bfloat16, device, 16, 8, 2, 32, [0, 21, 48, 5, 17, 90],
                        [30, 13, 1, 1, 1, 1], Phase.PREFILL, seed=4, kv_dtype=FP8_KV_DTYPE,
                        num_decode=4, window=window, softcap=2.0)


def test_window_lengths_are_checked() -> None:
    """A window list that does not cover the pool's layers, or a negative window, is refused
    with the numbers."""
    case = make_case(torch.float32, "cpu", 16, 8, 2, 32, [3], [1], Phase.DECODE, 0)
    with pytest.raises(ValueError, match=r"each of the pool's 2 layers a window >= 0, got \(8,\)"):
        TorchBackend(case.pool, case.page_table, 8, 2, 32, 1.0, (8,))
    with pytest.raises(ValueError, match=r"got \(0, -1\)"):
        TritonBackend(case.pool, case.page_table, 8, 2, 32, 1.0, windows=(0, -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_single_split_writes_output_directly(dtype: torch.dtype) -> None:
    """One split per request (the large-batch policy): no merge pass, same answer."""
    if HAS_CUDA:
        pytest.skip("the CPU interpreter path; GPU shapes are covered by test_decode_gpu")
    prefix = [0, 7, 40, 90]
    case_args = (dtype, "cpu", 16, 8, 2, 32, prefix, [1] * 4, Phase.DECODE)
    run_and_compare(*case_args, min_split_tokens=4096, num_sms=1)


def _split_backend(case: Case, heads: int, kv_heads: int, head_dim: int,
                   policy: Optional[KernelPolicy] = None) -> TritonBackend:
    """A backend over the case's pool that splits every request's KV (16-token splits)."""
    backend = TritonBackend(case.pool, case.page_table, heads, kv_heads, head_dim,
                            head_dim ** -0.5, policy or KernelPolicy())
    backend.num_sms, backend.min_split_tokens = 64, 16
    return backend


def test_split_merge_resets_its_counters() -> None:
    """The last split program of each (request, KV head) merges the splits and resets its
    counter: after a launch the counters are zero again, so a second launch over the same
    scratch (as every layer and every graph replay does) gives the same output."""
    device = "cuda" if HAS_CUDA else "cpu"
    case = make_case(torch.float32, device, 16, 8, 2, 32, [5, 40, 90], [1] * 3, Phase.DECODE, 3)
    backend = _split_backend(case, 8, 2, 32)
    backend.prepare(case.batch)
    meta = case.batch.attn_meta
    assert meta.o_part.shape[2] > 1 and meta.arrivals is not None
    first = backend.forward(case.q, case.k, case.v, 1, case.batch)
    assert torch.count_nonzero(meta.arrivals) == 0
    again = backend.forward(case.q, case.k, case.v, 1, case.batch, kv_stored=True)
    assert torch.equal(first, again)


def test_split_decode_refuses_missing_counters() -> None:
    """A split launch without its counters (or with the wrong shape) is refused with the shapes
    it needs, before anything runs."""
    from minisgl.kernels.attention import decode_attention
    case = make_case(torch.float32, "cpu", 16, 8, 2, 32, [5, 40], [1] * 2, Phase.DECODE, 4)
    backend = _split_backend(case, 8, 2, 32)
    backend.prepare(case.batch)
    meta = case.batch.attn_meta
    args = (case.q, case.pool.k[0], case.pool.v[0], case.page_table, meta.rows, meta.seq_lens,
            meta.o_part, meta.lse_part, torch.empty_like(case.q), 32 ** -0.5)
    with pytest.raises(ValueError, match=r"int32 \[2, 2\] of zeros; got None"):
        decode_attention(*args)
    with pytest.raises(ValueError, match=r"\[2, 2\] of zeros; got \(torch.int32, \(2, 4\)\)"):
        decode_attention(*args, arrivals=torch.zeros((2, 4), dtype=torch.int32))


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_head_dim_not_power_of_two(phase: Phase) -> None:
    prefix = [3, 30]
    extend = [1, 1] if phase is Phase.DECODE else [5, 20]
    run_and_compare(torch.float32, "cuda" if HAS_CUDA else "cpu", 16, 4, 2, 48, prefix, extend,
                    phase)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graph_metadata_matches_prepare(dtype: torch.dtype) -> None:
    """The CUDA-graph path (static buffers, batch padded from 5 to 8 requests, splits sized for
    the longest context) gives the same outputs as `prepare` for the real requests."""
    device = "cuda" if HAS_CUDA else "cpu"
    prefix = [0, 9, 33, 70, 120]
    case = make_case(dtype, device, 16, 8, 2, 32, prefix, [1] * 5, Phase.DECODE, 7)
    ref, _ = reference(case, 8, 2, 32, 0)
    backend = TritonBackend(case.pool, case.page_table, 8, 2, 32, 32 ** -0.5)
    backend.num_sms, backend.min_split_tokens = 64, 16
    used_rows = {r.table_row for r in case.batch.reqs}
    pad_row = next(r for r in range(case.page_table.shape[0]) if r not in used_rows)
    owned = {int(x) for r in used_rows for x in case.page_table[r, :prefix[-1] + 1]}
    scratch = next(x for x in range(case.pool.num_slots) if x not in owned)  # padding K/V
    case.page_table[pad_row, 0] = scratch
    backend.init_graph_buffers(16)
    bs, n = 8, 5
    # The static inputs as engine/cuda_graph.py fills them: padded with (pad_row, 0, 1).
    static = torch.tensor([[r.table_row for r in case.batch.reqs] + [pad_row] * (bs - n),
                           prefix + [0] * (bs - n), [p + 1 for p in prefix] + [1] * (bs - n)],
                          dtype=torch.int32, device=device)
    stub = Batch(Phase.DECODE, [], [0] * bs, [1] * bs, [True] * bs)
    stub.attn_meta = backend.graph_meta(static[0], static[1], static[2])
    assert stub.attn_meta.o_part.shape[2] > 1  # sized for long contexts: split
    stub.out_slots = case.page_table[static[0], static[1]]
    assert torch.equal(stub.out_slots[:n].long(), case.batch.out_slots.long())
    pad = lambda x: torch.cat([x, torch.randn((bs - n,) + x.shape[1:]).to(x)])  # noqa: E731
    out = backend.forward(pad(case.q), pad(case.k), pad(case.v), 0, stub)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:n].float(), ref, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_decode_tile_policy() -> None:
    """The split (small-batch) tile: 2 warps over an FP8 pool read in float16 tiles and over a
    16-bit pool; 8 warps where a head is wider than 128 (RESULTS.md, twentieth and
    twenty-second sessions)."""
    from minisgl.kernels.attention import decode_tiles
    assert decode_tiles(torch.bfloat16, 128, 8, 1, f16_tiles=True) == DecodeTiles(64, 2)
    assert decode_tiles(torch.bfloat16, 128, 8, 1) == DecodeTiles(64, 2)
    assert decode_tiles(torch.bfloat16, 256, 8, 1, f16_tiles=True) == DecodeTiles(64, 8)
    assert decode_tiles(torch.bfloat16, 128, 1, 256, f16_tiles=True) == DecodeTiles(128, 2, 2)


def test_split_count_policy() -> None:
    case = make_case(torch.float32, "cpu", 16, 8, 2, 32, [10], [1], Phase.DECODE, 0)
    backend = TritonBackend(case.pool, case.page_table, 8, 2, 32, 1.0)
    assert backend.num_splits(1, backend.min_split_tokens) == 1  # shorter than one split
    assert backend.num_splits(1, 10_000) > 1  # long context, small batch: split
    assert backend.num_splits(256, 10_000) == 1  # the batch alone fills the device
    assert backend.num_splits(1, 10 ** 7) <= backend.max_splits


def test_prefill_metadata_keeps_its_fields_apart() -> None:
    """TritonMeta's optional fields are keyword-only: when `arrivals` was added before `dense`,
    prepare's positional call put the dense flag into `arrivals` and the long-prompt path of
    torch's fused attention went silently unused (8,192-token first token 229.5 ms against
    213.6 with it on one H200; RESULTS.md, twenty-fifth session). A prefill's metadata carries
    no split counters, and on the CPU no dense flag (that path needs CUDA)."""
    from minisgl.attention.triton_backend import TritonMeta
    case = make_case(torch.float32, "cpu", 16, 8, 2, 32, [0], [1100], Phase.PREFILL, 0)
    backend = TritonBackend(case.pool, case.page_table, 8, 2, 32, 1.0)
    backend.prepare(case.batch)
    meta = case.batch.attn_meta
    assert meta.arrivals is None and meta.dense is False and meta.decode_part is None
    rows = meta.rows
    with pytest.raises(TypeError):
        TritonMeta(False, rows, rows, rows, rows, rows, 1, None, None, True)  # type: ignore[misc]
    assert TritonMeta(False, rows, rows, rows, rows, rows, 1, None, None, dense=True).dense


@pytest.mark.parametrize("n", [1, 3, 5, 6])
def test_metadata_rows_are_16_byte_aligned(n: int) -> None:
    """Triton builds a kernel variant per pointer alignment: metadata rows at unaligned offsets
    (request counts not a multiple of 4) made it build kernels again while serving."""
    case = make_case(torch.float32, "cpu", 16, 8, 2, 32, list(range(10, 10 + n)), [3] * n,
                     Phase.PREFILL, 0)
    backend = TritonBackend(case.pool, case.page_table, 8, 2, 32, 1.0)
    backend.prepare(case.batch)
    meta = case.batch.attn_meta
    for name in ("rows", "prefix_lens", "extend_lens", "seq_lens", "q_starts"):
        t = getattr(meta, name)
        assert t.data_ptr() % 16 == 0, name
    assert meta.extend_lens.tolist() == [3] * n
    assert meta.q_starts.tolist() == [3 * i for i in range(n)]


# --- FP8 KV cache --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,heads,kv_heads", [(torch.float32, 8, 2), (torch.bfloat16, 4, 4)],
                         ids=["float32-gqa4", "bfloat16-mha"])
def test_decode_fp8_kv(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    """Split (and for float32 also unsplit) decode over an FP8 pool with per-layer scales
    equals float32 attention over the same rounded K/V."""
    prefix = [0, 5, 40, 90]
    device = "cuda" if HAS_CUDA else "cpu"
    run_and_compare(dtype, device, 16, heads, kv_heads, 32, prefix, [1] * len(prefix),
                    Phase.DECODE, seed=heads, kv_dtype=FP8_KV_DTYPE)
    if not HAS_CUDA and dtype == torch.float32:
        run_and_compare(dtype, "cpu", 16, heads, kv_heads, 32, prefix, [1] * len(prefix),
                        Phase.DECODE, seed=heads, kv_dtype=FP8_KV_DTYPE,
                        min_split_tokens=4096, num_sms=1)


def test_extend_fp8_kv() -> None:
    """Causal extend (fresh prompt, chunk after a prefix, one-token chunk) over an FP8 pool,
    bf16 compute."""
    run_and_compare(torch.bfloat16, "cuda" if HAS_CUDA else "cpu", 16, 8, 2, 32, [0, 21, 48],
                    [9, 40, 1], Phase.PREFILL, seed=5, kv_dtype=FP8_KV_DTYPE)


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_torch_backend_fp8_kv(phase: Phase) -> None:
    """The CPU backend dequantizes an FP8 pool on read (scales folded into the softmax scale
    and the output): float32 attention over the same rounded K/V."""
    prefix = [0, 7, 33]
    extend = [1, 1, 1] if phase is Phase.DECODE else [5, 1, 20]
    run_and_compare(torch.float32, "cpu", 16, 8, 2, 32, prefix, extend, phase,
                    kv_dtype=FP8_KV_DTYPE, backend_name="torch")


def test_store_kv_fp8_quantizes_like_the_pool() -> None:
    """The Triton store writes the bytes `KVPool.store` writes: K / k_scale, V / v_scale,
    clamped to +-448 (values far beyond saturate instead of becoming NaN), rounded to
    nearest."""
    from minisgl.kernels.attention import store_kv
    device = "cuda" if HAS_CUDA else "cpu"
    tokens, kv_heads, dim = 6, 2, 16
    gen = torch.Generator(device).manual_seed(3)
    k = torch.randn(tokens, kv_heads, dim, generator=gen, device=device) * 3
    v = torch.randn(tokens, kv_heads, dim, generator=gen, device=device)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 447.0 * 0.02, 0.0])
    slots = torch.tensor([3, 17, 0, 39, 8, 20], dtype=torch.int32, device=device)
    scales = KVScales((0.02,), (0.007,))
    want = KVPool(1, 3, 16, kv_heads, dim, FP8_KV_DTYPE, torch.device(device), scales)
    want.store(0, slots, k, v)
    got = KVPool(1, 3, 16, kv_heads, dim, FP8_KV_DTYPE, torch.device(device), scales)
    store_kv(k, v, slots, got.k[0], got.v[0], k_scale=0.02, v_scale=0.007)
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    stored = dequantize(got.k[0, 3, 0, :4], 0.02, torch.float32)
    assert stored[0] == 448 * 0.02 and stored[1] == -448 * 0.02 and stored[3] == 0
    assert torch.isfinite(got.k.float()).all() and got.v.float().abs().max() > 0


def test_fp8_pool_refuses_scales_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="FP8 KV pool only"):
        KVPool(2, 1, 16, 1, 8, torch.float32, torch.device("cpu"), KVScales.ones(2))
    with pytest.raises(ValueError, match="3/3 layers, the model has 2"):
        KVPool(2, 1, 16, 1, 8, FP8_KV_DTYPE, torch.device("cpu"), KVScales.ones(3))


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


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("length", [1024, 3000])
def test_dense_prefill_gpu(dtype: torch.dtype, heads: int, kv_heads: int, length: int) -> None:
    """One fresh prompt long enough for torch's fused attention (TritonBackend.dense_prefill),
    over scattered pages: the same answer as the reference, and the K/V stored."""
    case = make_case(dtype, "cuda", 16, heads, kv_heads, 128, [0], [length], Phase.PREFILL, 5)
    backend = TritonBackend(case.pool, case.page_table, heads, kv_heads, 128, 128 ** -0.5)
    backend.prepare(case.batch)
    assert case.batch.attn_meta.dense
    run_and_compare(dtype, "cuda", 16, heads, kv_heads, 128, [0], [length], Phase.PREFILL, 5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (64, 8)])
@pytest.mark.parametrize("batch_size", [1, 64, 256])
def test_decode_gpu_fp8_kv(page_size: int, heads: int, kv_heads: int, batch_size: int) -> None:
    """bf16 compute over an FP8 pool (split at small batches, unsplit at large)."""
    rng = random.Random(batch_size)
    prefix = [rng.randint(0, 4000) for _ in range(batch_size)]
    run_and_compare(torch.bfloat16, "cuda", page_size, heads, kv_heads, 128, prefix,
                    [1] * batch_size, Phase.DECODE, seed=batch_size, min_split_tokens=256,
                    kv_dtype=FP8_KV_DTYPE)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (64, 8)])
def test_extend_gpu_fp8_kv(page_size: int, heads: int, kv_heads: int) -> None:
    rng = random.Random(heads)
    prefix = [0, 0] + [rng.randint(0, 3000) for _ in range(10)]
    extend = [1024, 1] + [rng.randint(1, 600) for _ in range(10)]
    run_and_compare(torch.bfloat16, "cuda", page_size, heads, kv_heads, 128, prefix, extend,
                    Phase.PREFILL, seed=heads, kv_dtype=FP8_KV_DTYPE)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kv_dtype", [None, FP8_KV_DTYPE], ids=["bf16", "fp8kv"])
@pytest.mark.parametrize("window", [1000, 4096])
def test_window_gpu(kv_dtype: Optional[torch.dtype], window: int) -> None:
    """Sliding-window decode (batch 1 split, batch 64) and extend (prefills after prefixes
    longer than the window, a fresh 2,048-token prompt) at the model's shapes, against the
    reference."""
    rng = random.Random(window)
    for batch_size in (1, 64):
        prefix = [rng.randint(0, 6000) for _ in range(batch_size)]
        run_and_compare(torch.bfloat16, "cuda", 16, 32, 8, 128, prefix, [1] * batch_size,
                        Phase.DECODE, seed=batch_size, min_split_tokens=256,
                        kv_dtype=kv_dtype, window=window)
    prefix = [0, 0] + [rng.randint(0, 6000) for _ in range(6)]
    extend = [2048, 1] + [rng.randint(1, 900) for _ in range(6)]
    run_and_compare(torch.bfloat16, "cuda", 16, 32, 8, 128, prefix, extend, Phase.PREFILL,
                    seed=window, kv_dtype=kv_dtype, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs compute capability 9.0+ (PDL)")
@pytest.mark.parametrize("kv_dtype", [None, FP8_KV_DTYPE], ids=["bf16", "fp8kv"])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_split_decode_with_pdl_in_graph_is_bit_identical(kv_dtype: Optional[torch.dtype],
                                                          batch_size: int) -> None:
    """The split kernel under PDL (rows and lengths read before the wait, the merge by the
    last program to finish) gives the bits of the plain launch, replay after replay of a
    CUDA graph (the merge's counters reset by each launch)."""
    rng = random.Random(batch_size)
    prefix = [rng.randint(0, 2000) for _ in range(batch_size)]
    case = make_case(torch.bfloat16, "cuda", 16, 32, 8, 128, prefix, [1] * batch_size,
                     Phase.DECODE, 9, kv_dtype)
    plain = _split_backend(case, 32, 8, 128)
    pdl = _split_backend(case, 32, 8, 128, KernelPolicy(fused=True, pdl=True))
    # Enough multiprocessors that batch 16 splits too (64 would give one split a request)
    plain.num_sms = pdl.num_sms = 64 * batch_size
    plain.prepare(case.batch)
    want = plain.forward(case.q, case.k, case.v, 1, case.batch)
    pdl.prepare(case.batch)
    assert case.batch.attn_meta.o_part.shape[2] > 1
    pdl.forward(case.q, case.k, case.v, 1, case.batch, kv_stored=True)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pdl.forward(case.q, case.k, case.v, 1, case.batch, kv_stored=True)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert torch.count_nonzero(case.batch.attn_meta.arrivals) == 0


# --- end to end: the engine with each backend ----------------------------------------------------
def _tiny_checkpoint(root: Path) -> Path:
    """A random tiny Qwen3 checkpoint without a tokenizer (no downloads). Weights of std 0.1,
    so greedy tokens vary (the dummy loader's 0.02 repeats one token)."""
    import transformers
    cfg = transformers.Qwen3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    from tiny_models import save_randomized
    torch.manual_seed(0)
    save_randomized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32),
                    root)
    return root


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_matches_torch_backend(tmp_path: Path, page_size: int) -> None:
    """Greedy float32 generation is identical with either backend: prompts longer than the
    prefill budget (later chunks read their earlier chunks from the pool), prompts that may hit
    the prefix cache, and decode (through CUDA graphs where the engine captures them)."""
    from minisgl import LLM, SamplingParams

    model = _tiny_checkpoint(tmp_path)
    rng = random.Random(page_size)
    shared = [rng.randrange(1000) for _ in range(20)]
    prompts = [shared + [rng.randrange(1000) for _ in range(n)] for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        with LLM(str(model), dtype="float32", page_size=page_size, max_prefill_tokens=24,
                 attention_backend=backend, show_progress=False) as llm:
            first = llm.generate(prompts[:1], params)
            rest = llm.generate(prompts[1:], params)
        outputs[backend] = [o.token_ids for o in first + rest]
    assert len({t for ids in outputs["torch"] for t in ids}) > 3  # a non-degenerate check
    assert outputs["triton"] == outputs["torch"]


def test_store_kv_from_qkv_views() -> None:
    """One launch stores K and V straight from views of the fused QKV output (V not copied)."""
    from minisgl.kernels.attention import store_kv
    device = "cuda" if HAS_CUDA else "cpu"
    tokens, kv_heads, dim = 5, 2, 16
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim, device=device)
    _, k, v = qkv.split([4 * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    k_cache = torch.zeros(40, kv_heads, dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 0, 39, 8], dtype=torch.int32, device=device)
    store_kv(k, v, slots, k_cache, v_cache)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.index_copy_(0, slots.long(), k)
    want_v.index_copy_(0, slots.long(), v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def _eager_triton_engine(model: Path, device: str, backend: str = "triton",
                         **engine_kw: object) -> Engine:
    """A float32 engine on the Triton backend (or `backend`) with no graphs, fused kernels or
    PDL (a graph's body runs eagerly beside it), four requests over 1,024 one-token pages
    (`engine_kw`: Engine's other arguments, e.g. a drafter)."""
    from minisgl.distributed import DistributedInfo, ProcessGroups
    from minisgl.distributed.comm import Communicator
    from minisgl.engine import Engine, EngineConfig
    info = DistributedInfo(0, 1)
    return Engine(EngineConfig(model_path=str(model), tp_info=info, device=device,
                               dtype="float32", attention_backend=backend, max_kv_tokens=1024,
                               page_size=1, max_running_requests=4, cuda_graph_max_bs=0,
                               prefill_graph_tokens=0, pdl="off", fused_ops=False),
                  ProcessGroups(Communicator(info), None), **engine_kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_prefill_graph_body_matches_the_eager_mixed_step(
        tiny_model: Callable[..., Path], family: str) -> None:
    """What a mixed prefill graph holds (engine/prefill_graph.PrefillGraphs.run over the block
    `fill` writes: a prompt chunk after a cached prefix, padded to its bucket, and two decode
    rows padded to eight), run eagerly here: its logits are the eager mixed step's, and its
    padding writes only the scratch slot. On CUDA the graphs themselves: tests/test_gpu.py."""
    from minisgl.engine.prefill_graph import PrefillGraphs
    device = "cuda" if HAS_CUDA else "cpu"
    engine = _eager_triton_engine(tiny_model(family), device)
    rng = random.Random(7)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    lens = {0: 70, 1: 20, 2: 33}  # row: known tokens
    reqs = {row: Req(row, [rng.randrange(3, 200) for _ in range(n)], n, greedy, (),
                     table_row=row) for row, n in lens.items()}
    for row, n in lens.items():  # slot = 128 * row + position
        engine.page_table[row, :n + 1] = torch.arange(128 * row, 128 * row + n + 1)

    def prefill(row: int, start: int, end: int, batch_reqs: Sequence[Req] = ()) -> Batch:
        batch = Batch(Phase.PREFILL, [reqs[row], *batch_reqs], [start, *(lens[r.table_row]
                                                                        for r in batch_reqs)],
                      [end - start, *[1] * len(batch_reqs)], [True] * (1 + len(batch_reqs)),
                      num_decode=len(batch_reqs))
        slots = [128 * row + p for p in range(start, end)]
        slots += [128 * r.table_row + lens[r.table_row] for r in batch_reqs]
        batch.out_slots = torch.tensor(slots, device=device)
        return batch
    # rows 1 and 2 prefilled (their last token's K/V comes with their decode row), row 0's
    # first 16 tokens cached
    for row, (start, end) in {1: (0, 20), 2: (0, 33), 0: (0, 16)}.items():
        engine.forward(prefill(row, start, end))
    for row in (1, 2):  # the decode rows' input: the token the engine sampled, on the device
        reqs[row].token_ids.append(int(engine.last_tokens[row]))
    mixed = prefill(0, 16, 70, [reqs[1], reqs[2]])
    eager = engine._forward(mixed, [0, 1, 2]).logits.clone()
    scratch = engine.pool.scratch_slot
    engine.pool.k[:, scratch].zero_()
    before = engine.pool.k.clone()
    graphs = PrefillGraphs(engine.model, engine.backend, 128,  # type: ignore[arg-type]
                           engine.page_table, scratch, engine.last_tokens, max_decode_rows=8,
                           capture=lambda keys, run, dev: ({}, {}))
    assert graphs.keys == [(n, d) for n in (64, 96, 128) for d in (0, 8)]
    assert graphs.can_run(mixed) and not graphs.can_run(mixed, joining=7)
    unsampled = copy.copy(mixed)
    unsampled.sample = [True, False, True]  # the graph samples every row: eager instead
    assert not graphs.can_run(unsampled)
    key = graphs.fill(mixed)
    assert key == (64, 8)
    body = graphs.run(key)
    assert body.shape[0] == 9
    torch.testing.assert_close(body[:3], eager, rtol=1e-5, atol=1e-5)
    written = [*range(16, 70), 128 + 20, 256 + 33]  # the step's own slots, rewritten
    untouched = torch.ones(before.shape[1], dtype=torch.bool)
    untouched[[*written, scratch]] = False
    assert torch.equal(engine.pool.k[:, untouched], before[:, untouched])
    assert bool(engine.pool.k[:, scratch].ne(0).any())  # the padding rows' K went there
    # every graph's logits in one buffer (the capture-time block of (64, 0) writes slot 0)
    assert graphs.run((64, 0)).data_ptr() == body.data_ptr()


def test_verify_graph_body_matches_the_eager_verify_step(
        tiny_model: Callable[..., Path]) -> None:
    """What a verify graph holds (engine/verify_graph.VerifyGraphs.run over the block `fill`
    writes: three requests with 0, 2 and 4 drafts after cached prefixes, padded to four
    requests of five tokens), run eagerly here: its logits are the eager verify step's, whose
    tokens attend as decode rows (TritonBackend.verify_meta), and both are the torch backend's
    (an extend), row for row, with the same page-table rows; its padding writes only the
    scratch slot. On CUDA the graphs themselves: tests/test_gpu.py."""
    from minisgl.engine.verify_graph import VerifyGraphs, graph_buffer_rows, verify_graph_bs
    device = "cuda" if HAS_CUDA else "cpu"
    lens = {0: 30, 1: 9, 2: 21}  # row: known tokens (the newest not yet in the cache)
    drafts = {0: [], 1: [5, 6], 2: [7, 8, 9, 10]}
    order = [2, 1, 0]

    def verified(backend: str) -> Tuple[Engine, Batch, torch.Tensor, torch.Tensor]:
        engine = _eager_triton_engine(tiny_model("qwen3"), device, backend)
        rng = random.Random(11)
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        reqs = {row: Req(row, [rng.randrange(3, 200) for _ in range(n)], n - 1, greedy, (),
                         table_row=row) for row, n in lens.items()}
        for row, n in lens.items():  # slot = 128 * row + position
            engine.page_table[row, :n + 4] = torch.arange(128 * row, 128 * row + n + 4)
        for row, n in lens.items():  # each request's cache: all its tokens but the newest
            batch = Batch(Phase.PREFILL, [reqs[row]], [0], [n - 1], [True])
            batch.out_slots = torch.arange(128 * row, 128 * row + n - 1, device=device)
            engine.forward(batch)
        verify = Batch(Phase.VERIFY, [reqs[r] for r in order], [lens[r] - 1 for r in order],
                       [1 + len(drafts[r]) for r in order], [True] * 3,
                       drafts=[drafts[r] for r in order])
        verify.out_slots = torch.tensor([128 * r + lens[r] - 1 + j for r in order
                                         for j in range(1 + len(drafts[r]))], device=device)
        eager = engine._forward(verify, [0, 1, 2])
        return engine, verify, eager.logits.clone(), eager.rows.clone()
    engine, verify, eager_logits, eager_rows = verified("triton")
    _, _, torch_logits, _ = verified("torch")
    torch.testing.assert_close(eager_logits, torch_logits, rtol=1e-5, atol=1e-5)
    scratch = engine.pool.scratch_slot
    engine.pool.k[:, scratch].zero_()
    before = engine.pool.k.clone()
    # requests as the decode graphs', at most 512 tokens; at batch 1 the buffers hold 5 rows
    assert verify_graph_bs(256, 5) == 102 and verify_graph_bs(16, 5) == 16
    assert verify_graph_bs(1, 5) == 1 and graph_buffer_rows(1, 5) == 5
    assert verify_graph_bs(256, 5, 8) == 8 and verify_graph_bs(2, 5, 8) == 2
    assert graph_buffer_rows(256, 5) == 510 and graph_buffer_rows(4, 0) == 4
    engine.backend.init_graph_buffers(20)  # type: ignore[attr-defined]  (the decode graphs')
    graphs = VerifyGraphs(engine.model, engine.backend, 4, 5,  # type: ignore[arg-type]
                          engine.page_table, 4, scratch, capture=lambda keys, run, dev: ({}, {}))
    assert graphs.sizes == [1, 2, 4] and graphs.can_run(verify)
    too_long = copy.copy(verify)
    too_long.extend_lens = [6, 3, 1]
    assert not graphs.can_run(too_long)
    assert not graphs.can_run(Batch(Phase.DECODE, verify.reqs, [1, 1, 1], [1, 1, 1], [True] * 3))
    bs = graphs.fill(verify)
    assert bs == 4
    body = graphs.run(bs)
    assert body.shape[0] == 20
    torch.testing.assert_close(body[:9], eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphs.blocks[bs][2 * 20:2 * 20 + 9], eager_rows)
    written = [128 * r + lens[r] - 1 + j for r in order for j in range(1 + len(drafts[r]))]
    untouched = torch.ones(before.shape[1], dtype=torch.bool)
    untouched[[*written, scratch]] = False
    assert torch.equal(engine.pool.k[:, untouched], before[:, untouched])
    assert bool(engine.pool.k[:, scratch].ne(0).any())  # the padding tokens' K went there


def test_eagle_proposal_graph_body_matches_the_eager_proposal(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """What an EAGLE-3 proposal graph holds (engine/eagle_graph.EagleGraphs.proposal over the
    block `fill_proposal` writes: three greedy requests of three drafts after cached prefixes,
    padded to four), run eagerly here: the eager proposal's drafts (engine/eagle.py's steps,
    eager metadata) and its head K/V at the verify's slots; its padding writes only the
    scratch slot. On CUDA the graphs themselves: tests/test_gpu.py."""
    from eagle_reference import write_eagle3
    from minisgl.engine.eagle_graph import EagleGraphs, Proposing
    device = "cuda" if HAS_CUDA else "cpu"
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=3, draft_vocab=1000, scale=0.2)
    engine = _eager_triton_engine(target, device, verify_tokens=4, draft_path=str(head),
                                  draft_method="eagle3")
    eagle = engine.eagle
    assert eagle is not None and eagle.graphs is None
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    lens = {0: 30, 1: 9, 2: 21}  # row: known tokens (the newest not yet in the cache)
    reqs = {row: Req(row, [rng.randrange(3, 200) for _ in range(n)], n - 1, greedy, (),
                     table_row=row) for row, n in lens.items()}
    for row, n in lens.items():  # slot = 128 * row + position
        engine.page_table[row, :n + 4] = torch.arange(128 * row, 128 * row + n + 4)
        batch = Batch(Phase.PREFILL, [reqs[row]], [0], [n - 1], [True])
        batch.out_slots = torch.arange(128 * row, 128 * row + n - 1, device=device)
        engine.forward(batch)  # the head's shadow keeps each row's state
    order = [2, 0, 1]
    verify = Batch(Phase.VERIFY, [reqs[r] for r in order], [lens[r] - 1 for r in order],
                   [4] * 3, [True] * 3)
    verify.out_slots = torch.tensor([128 * r + lens[r] - 1 + j for r in order
                                     for j in range(4)], device=device)
    eager = eagle._greedy_proposal(verify, 3).clone()
    # the two steps after the first draft write the head's K/V at the verify's first two slots
    written = [128 * r + lens[r] - 1 + j for r in order for j in range(2)]
    scratch = engine.pool.scratch_slot
    eager_k = eagle.pool.k[:, written].clone()
    eagle.pool.k[:, [*written, scratch]] = 0
    before = eagle.pool.k.clone()
    graphs = EagleGraphs(eagle.model, eagle.backend, 16,  # type: ignore[arg-type]
                         engine.page_table, 4, scratch, capture=lambda sizes, run, dev: ({}, {}))
    graphs.capture_proposals(4, Proposing(3, eagle.states, eagle.target_ids, eagle.policy))
    assert graphs.proposal_sizes == [1, 2, 4] and graphs.can_propose(3, 3)
    assert not graphs.can_propose(3, 2) and not graphs.can_propose(5, 3)
    size = graphs.fill_proposal([r.table_row for r in verify.reqs], verify.prefix_lens)
    assert size == 4
    body = graphs.proposal(size)
    assert body.shape == (4, 3) and torch.equal(body[:3], eager)
    torch.testing.assert_close(eagle.pool.k[:, written], eager_k, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(before.shape[1], dtype=torch.bool)
    untouched[[*written, scratch]] = False
    assert torch.equal(eagle.pool.k[:, untouched], before[:, untouched])
    assert bool(eagle.pool.k[:, scratch].ne(0).any())  # the padding row's K went there


def test_extend_tiles_keep_one_key_width_at_every_chunk() -> None:
    """Deterministic inference lets the extend kernel's query blocks follow the chunk on sm_90
    (TritonBackend._invariant): a token's keys must fold in tiles of one width whatever the
    chunk, or its bits would change with it."""
    from minisgl.kernels.attention import extend_tiles
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (64, 128, 256):
            widths = {extend_tiles(dtype, head_dim, n).block_n for n in (0, 1, 1023, 1024, 8192)}
            assert len(widths) == 1, (dtype, head_dim, widths)
