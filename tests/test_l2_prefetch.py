"""The L2 prefetch of the next projections' weights from a small batch's decode attention
(kernels/prefetch.py): the host plan, the device arithmetic of each prefetch's span (in the
interpreter), the decode kernel compiled for Hopper with its inline assembly (no GPU needed:
Triton's own ptxas), the backend's choice of batches, and on a GPU the bit-identical result."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import List, Tuple

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from minisgl.core import Phase  # noqa: E402
from minisgl.kernels.policy import KernelPolicy  # noqa: E402
from minisgl.kernels.prefetch import (MAX_RANGES, plan_l2_prefetch, prefetch_ranges,  # noqa: E402
                                      prefetch_span)

HAS_CUDA = torch.cuda.is_available()


def test_ranges_first_tensor_then_an_even_share() -> None:
    o, gate, up = torch.empty(64, 64), torch.empty(32, 64), torch.empty(32, 64)  # 16 / 8 / 8 KiB
    ranges = prefetch_ranges([o, gate, up], 16384 + 4096)
    assert ranges == ((o.data_ptr(), 16384), (gate.data_ptr(), 2048), (up.data_ptr(), 2048))
    # A budget below the first tensor's size takes its head only; the others get nothing.
    assert prefetch_ranges([o, gate, up], 1000) == ((o.data_ptr(), 992),)  # 16-byte multiple
    assert prefetch_ranges([o], 0) == ()
    assert prefetch_ranges([o, gate], 1 << 30) == ((o.data_ptr(), 16384), (gate.data_ptr(), 8192))


def test_ranges_refuse_strided_or_too_many() -> None:
    w = torch.empty(8, 8)
    with pytest.raises(ValueError, match="dense"):
        prefetch_ranges([w.t()], 1 << 20)
    with pytest.raises(ValueError, match=f"at most {MAX_RANGES}"):
        prefetch_ranges([w] * (MAX_RANGES + 1), 1 << 20)


@triton.jit
def _store_span(off_ptr, size_ptr, e, n, f, chunk, PER_PROGRAM: tl.constexpr):
    off, size = prefetch_span(e, n, f, chunk)
    tl.store(off_ptr + e, off)
    tl.store(size_ptr + e, size)


@triton.jit
def _spans_kernel(off_ptr, size_ptr, n0, f0, n1, f1, n2, f2, chunk, PER_PROGRAM: tl.constexpr):
    """Range i's (offset, size) of element e at [i * elements + e]."""
    e = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    slots = tl.num_programs(0) * PER_PROGRAM
    _store_span(off_ptr, size_ptr, e, n0, f0, chunk, PER_PROGRAM)
    _store_span(off_ptr + slots, size_ptr + slots, e, n1, f1, chunk, PER_PROGRAM)
    _store_span(off_ptr + 2 * slots, size_ptr + 2 * slots, e, n2, f2, chunk, PER_PROGRAM)


@pytest.mark.parametrize("sizes,programs,per_program", [
    ([16 << 20, 4 << 20, 4 << 20], 256, 256),  # Llama-8B FP8: o_proj, then gate/up's heads
    ([48, 4096, 1 << 20], 3, 32),  # ragged ranges; few programs: larger chunks
    ([1 << 20], 1, 32),
])
def test_spans_cover_each_range_once(sizes: List[int], programs: int, per_program: int) -> None:
    """The device arithmetic of every (element, range): the nonzero spans tile each range
    exactly, in 16-byte multiples, within the launch's elements."""
    ranges = [(i << 40, n) for i, n in enumerate(sizes)]
    plan = plan_l2_prefetch(ranges, programs, per_program)
    assert plan.chunk % 1024 == 0
    slots = programs * per_program
    dev = "cuda" if HAS_CUDA else "cpu"
    off = torch.zeros(MAX_RANGES * slots, dtype=torch.int64, device=dev)
    size = torch.zeros(MAX_RANGES * slots, dtype=torch.int32, device=dev)
    _spans_kernel[(programs,)](off, size, *(x for i in range(MAX_RANGES)
                                            for x in (plan.nbytes[i], plan.firsts[i])),
                               plan.chunk, PER_PROGRAM=per_program)
    off, size = off.cpu(), size.cpu()
    for i in range(MAX_RANGES):
        spans: List[Tuple[int, int]] = sorted(
            (int(o), int(s)) for o, s in zip(off[i * slots:(i + 1) * slots],
                                             size[i * slots:(i + 1) * slots]) if s > 0)
        want = sizes[i] if i < len(sizes) else 0
        assert sum(s for _, s in spans) == want
        pos = 0
        for o, s in spans:  # contiguous, no overlap, aligned
            assert o == pos and s % 16 == 0 and s <= plan.chunk
            pos += s
        assert pos == want


def test_plan_fits_the_launch() -> None:
    plan = plan_l2_prefetch([(0, 1 << 20), (1 << 30, 4096)], programs=2, per_program=32)
    used = sum(-(-n // plan.chunk) for n in plan.nbytes)
    assert used <= 2 * 32 and plan.firsts[:2] == (0, -(-(1 << 20) // plan.chunk))
    assert plan.total == (1 << 20) + 4096


_COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from minisgl.kernels.attention import _decode_split_kernel as k
    ptr = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "page_table_ptr": "*i32",
           "rows_ptr": "*i32", "seq_lens_ptr": "*i32", "o_part_ptr": "*fp32",
           "lse_part_ptr": "*fp32", "out_ptr": "*bf16"}
    const = dict(GROUP=4, BLOCK_H=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, F32_DOT=False,
                 DIRECT=False, F16_TILES=True, PDL=True, PREFETCH=True, PF_PER_PROGRAM=256)
    sig = {}
    for name in k.arg_names:
        sig[name] = (ptr.get(name) or ("constexpr" if name in const else
                     "fp32" if name in ("scale_log2", "v_scale") else
                     "i64" if name.startswith("pf_a") else "i32"))
    src = ASTSource(k, signature=sig, constexprs=const)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert "cubin" in c.asm, sorted(c.asm)
    print(c.asm["ptx"].count("cp.async.bulk.prefetch.L2.global"))
""")


def test_decode_kernel_compiles_for_hopper_with_the_prefetch() -> None:
    """ptxas accepts the inline assembly (sm_90), one predicated prefetch a range; a fresh
    interpreter, since this module's runs Triton in the interpreter on CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= MAX_RANGES


def _backend(budget: int):  # type: ignore[no-untyped-def]
    from minisgl.attention.triton_backend import TritonBackend
    from tests.test_triton_attention import make_case
    case = make_case(torch.float32, "cpu", 16, 8, 2, 16, [300], [1], Phase.DECODE, 0)
    policy = KernelPolicy(fused=True, pdl=True, l2_prefetch=budget)
    return case, TritonBackend(case.pool, case.page_table, 8, 2, 16, 0.25, policy)


def test_backend_prefetches_split_batches_only() -> None:
    case, backend = _backend(1 << 20)
    w = torch.empty(64, 64)
    backend.prepare(case.batch)
    meta = case.batch.attn_meta
    assert meta.o_part.shape[2] > 1  # batch 1 over 300 tokens: split
    assert backend._prefetch(meta, [w]) == ((w.data_ptr(), w.numel() * 4),)
    assert backend._prefetch(meta, []) == ()
    unsplit = backend._decode_meta(meta.rows, meta.seq_lens, 300, splits=1)
    assert backend._prefetch(unsplit, [w]) == ()
    _, off = _backend(0)
    assert off._prefetch(meta, [w]) == ()


def test_policy_refuses_prefetch_without_pdl() -> None:
    with pytest.raises(ValueError, match="l2_prefetch"):
        KernelPolicy(fused=True, pdl=False, l2_prefetch=1 << 20)
    with pytest.raises(ValueError, match="l2_prefetch"):
        KernelPolicy(fused=True, pdl=True, l2_prefetch=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_decode_with_prefetch_is_bit_identical(kv_fp8: bool, batch_size: int) -> None:
    """The prefetch changes no bit of the attention output (PDL on, as in the decode graphs),
    and the prefetched weights are untouched."""
    from minisgl.attention.triton_backend import TritonBackend
    from minisgl.kvcache.pool import FP8_KV_DTYPE
    from tests.test_triton_attention import make_case
    case = make_case(torch.bfloat16, "cuda", 16, 32, 8, 128, [700 + 37 * i for i in
                     range(batch_size)], [1] * batch_size, Phase.DECODE, batch_size,
                     kv_dtype=FP8_KV_DTYPE if kv_fp8 else None)
    weights = [torch.randn(n, 4096, device="cuda").to(torch.float8_e4m3fn)
               for n in (4096, 14336, 14336)]
    before = [w.clone() for w in weights]
    outs = []
    for budget in (0, 24 << 20):
        policy = KernelPolicy(fused=True, pdl=True, l2_prefetch=budget)
        backend = TritonBackend(case.pool, case.page_table, 32, 8, 128, 128 ** -0.5, policy)
        backend.prepare(case.batch)
        assert case.batch.attn_meta.o_part.shape[2] > 1
        outs.append(backend.forward(case.q, case.k, case.v, 1, case.batch, prefetch=weights))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(weights, before))
