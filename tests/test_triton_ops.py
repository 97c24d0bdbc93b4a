"""The Triton decode-path kernels (RMSNorm with residual, SiLU-and-mul, rotary, argmax; the
one-token GEMVs of kernels/gemv.py, also with the norm, rotary, SiLU fused in) against the torch
layers they replace. On CPU through Triton's interpreter (float32); on CUDA also in bfloat16."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
pytest.importorskip("triton")

from minisgl.kernels import activation, argmax, gemv, rmsnorm, rotary  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minisgl.kernels.policy import KernelPolicy  # noqa: E402
from minisgl.kernels.types import HeadNorms, KVStore, KVTarget, QKVRope  # noqa: E402
from minisgl.kernels.types import GELU_TANH, SILU  # noqa: E402
from minisgl.layers import blas  # noqa: E402
from minisgl.layers.activation import act_and_mul  # noqa: E402
from minisgl.distributed import DistributedInfo  # noqa: E402
from minisgl.layers.linear import ColumnParallelLinear, ResidualStream, project  # noqa: E402
from minisgl.layers.norm import RMSNorm  # noqa: E402
from minisgl.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
GEMV = KernelPolicy(fused=True, pdl=True)  # the policy under which projections take the GEMV


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    err = (a.float() - b.float()).norm() / b.float().norm()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 576), (3, 100)])
def test_rmsnorm_with_and_without_residual(dtype: torch.dtype, rows: int, dim: int) -> None:
    norm = RMSNorm(dim, 1e-5).to(DEV)
    norm.weight.data = torch.randn(dim, device=DEV).to(dtype)
    x = torch.randn(rows, dim, device=DEV).to(dtype)
    res = torch.randn(rows, dim, device=DEV).to(dtype)
    got, _ = rmsnorm.rmsnorm(x, norm.weight, 1e-5)
    _close(got, norm(x), dtype)
    got, got_res = rmsnorm.rmsnorm(x, norm.weight, 1e-5, res)
    want, want_res = norm(x, res)
    _close(got, want, dtype)
    assert got_res is not None and torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 128), (4, 1536), (2, 1500)])
@pytest.mark.parametrize("act", [SILU, GELU_TANH], ids=["silu", "gelu"])
def test_act_and_mul(dtype: torch.dtype, rows: int, d: int, act: int) -> None:
    """The kernel against torch's F.silu / F.gelu(approximate="tanh") (inputs up to +-30:
    GELU's tanh saturates at both ends)."""
    x = (torch.randn(rows, 2 * d, device=DEV) * 6).clamp(-30, 30).to(dtype)
    _close(activation.act_and_mul(x, act), act_and_mul(x, act), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (9, 3, 64), (8, 8, 128), (2, 1, 32),
                                                (1, 1, 64)])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, heads: int, kv_heads: int,
                                      dim: int) -> None:
    rope = RotaryEmbedding(dim, 256, 10000.0, None).to(DEV)
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEV).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    pos = torch.randint(0, 256, (tokens,), device=DEV)
    want_q, want_k = rope(pos, q.clone(), k.clone())
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    rotary.rotary_qk_(q, k, pos, rope.cos, rope.sin)
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # V untouched



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 1, 64), (8, 8, 128)])
def test_rotary_stores_k_and_v_into_the_cache(dtype: torch.dtype, heads: int, kv_heads: int,
                                              dim: int) -> None:
    """The rotary kernel with the K/V store fused in: q rotated in place exactly as without the
    store, the rotated k and a copy of v in their (scattered) cache slots, k and v in the QKV
    output untouched, every other slot untouched."""
    rope = RotaryEmbedding(dim, 256, 10000.0, None).to(DEV)
    tokens, num_slots = 5, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEV).to(dtype)
    q, k, v = (x.view(tokens, -1, dim) for x in
               qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    pos = torch.randint(0, 256, (tokens,), device=DEV)
    slots = torch.randperm(num_slots, device=DEV)[:tokens].to(torch.int32)
    want_q, want_k = rotary.rotary_qk_(q.clone(), k.clone(), pos, rope.cos, rope.sin)
    qkv_before = qkv.clone()
    k_cache = torch.randn(num_slots, kv_heads, dim, device=DEV).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, device=DEV).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    rotary.rotary_qk_(q, k, pos, rope.cos, rope.sin,
                          store=KVStore(v, KVTarget(k_cache, v_cache, slots)))
    assert torch.equal(q, want_q)
    assert torch.equal(qkv[:, heads * dim:], qkv_before[:, heads * dim:])
    assert torch.equal(k_cache[slots.long()], want_k) and torch.equal(v_cache[slots.long()], v)
    rest = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    rest[slots.long()] = False
    assert torch.equal(k_cache[rest], k_before[rest]) and torch.equal(v_cache[rest], v_before[rest])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 1, 64), (8, 8, 128)])
@pytest.mark.parametrize("store", [True, False])
def test_rotary_applies_per_head_norms(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                       store: bool) -> None:
    """Qwen3's q/k norms in the rotary kernel (`norms`): q normed and rotated in place, k's
    norm rotated into the cache (store) or in place, as the RMSNorm layer then the rotary
    layer give them; v and the other slots untouched; weights of another size refused."""
    rope = RotaryEmbedding(dim, 256, 10000.0, None).to(DEV)
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(DEV), RMSNorm(dim, 1e-6).to(DEV)
    q_norm.weight.data = torch.rand(dim, device=DEV).add(0.5).to(dtype)
    k_norm.weight.data = torch.rand(dim, device=DEV).add(0.5).to(dtype)
    tokens, num_slots = 5, 16
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEV) * 3).to(dtype)
    q, k, v = (x.view(tokens, -1, dim) for x in
               qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    pos = torch.randint(0, 256, (tokens,), device=DEV)
    want_q, want_k = rope(pos, q_norm(q.contiguous()), k_norm(k.contiguous()))
    norms = HeadNorms(q_norm.weight, k_norm.weight, 1e-6)
    v_before, k_before = v.clone(), k.clone()
    slots = torch.randperm(num_slots, device=DEV)[:tokens].to(torch.int32)
    k_cache = torch.zeros(num_slots, kv_heads, dim, device=DEV, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv = KVStore(v, KVTarget(k_cache, v_cache, slots)) if store else None
    rotary.rotary_qk_(q, k, pos, rope.cos, rope.sin, store=kv, norms=norms)
    _close(q, want_q, dtype)
    if store:
        _close(k_cache[slots.long()], want_k, dtype)
        assert torch.equal(v_cache[slots.long()], v) and torch.equal(k, k_before)
        rest = torch.ones(num_slots, dtype=torch.bool, device=DEV)
        rest[slots.long()] = False
        assert not k_cache[rest].any() and not v_cache[rest].any()
    else:
        _close(k, want_k, dtype)
    assert torch.equal(v, v_before)
    with pytest.raises(ValueError, match=f"head norms take \\[{dim}\\] weights"):
        rotary.rotary_qk_(q, k, pos, rope.cos, rope.sin,
                          norms=HeadNorms(norms.q_weight[:-1], norms.k_weight, 1e-6))


def test_rotate_into_cache_declines_where_the_kernel_does_not_apply() -> None:
    """The layer's fused-store entry does nothing and says so off CUDA (the caller then rotates
    with forward and lets attention store K/V)."""
    rope = RotaryEmbedding(16, 64, 10000.0, None, KernelPolicy(fused=True))
    q, k, v = torch.randn(3, 2, 16), torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    cache = torch.zeros(8, 1, 16)
    q0 = q.clone()
    assert rope.rotate_into_cache(torch.arange(3), q, k, v,
                                  KVTarget(cache, cache.clone(), torch.arange(3))) is False
    assert torch.equal(q, q0) and not cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_on_one_head_view_of_qkv(dtype: torch.dtype) -> None:
    """The per-head norm of Qwen3 at one KV head per rank: k is a view of the fused QKV output
    whose rows are strided (reshape keeps the view); each row must still be its own token's."""
    tokens, heads, dim = 6, 2, 32
    norm = RMSNorm(dim, 1e-6).to(DEV)
    norm.weight.data = torch.randn(dim, device=DEV).to(dtype)
    qkv = torch.randn(tokens, (heads + 2) * dim, device=DEV).to(dtype)
    _, k, _ = qkv.split([heads * dim, dim, dim], dim=-1)
    k = k.view(tokens, 1, dim)
    assert k.reshape(-1, dim).stride(0) != dim  # the strided view the bug came from
    got, _ = rmsnorm.rmsnorm(k, norm.weight, 1e-6)
    _close(got, norm(k.contiguous()), dtype)


PDL = [False] + ([True] if DEV == "cuda" and torch.cuda.get_device_capability()[0] >= 9 else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pdl", PDL)
@pytest.mark.parametrize("n,k,bias", [(10, 64, False), (7, 300, True), (9, 4096, False),
                                      (5, 6144, True), (13, 8292, True)])  # 8292: down's tiles
def test_gemv_matches_linear(dtype: torch.dtype, pdl: bool, n: int, k: int, bias: bool) -> None:
    """Both tile paths (K a multiple of 4096, and not: a prefetched first tile plus a loop), N not
    a multiple of the row stripe, bias; with PDL (GPU) bit-identical to without."""
    w = torch.randn(n, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    x = torch.randn(1, k, device=DEV).to(dtype)
    got = gemv.gemv(x, w, b, pdl=pdl)
    assert got.shape == (1, n) and got.dtype == dtype
    _close(got, F.linear(x, w, b), dtype)
    assert torch.equal(got, gemv.gemv(x, w, b))
    with pytest.raises(ValueError, match="one row of"):
        gemv.gemv(torch.randn(2, k, device=DEV).to(dtype), w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(10, 64), (37, 300), (9, 4096), (70, 960)])
@pytest.mark.parametrize("residual,bias", [(True, False), (False, True)])
def test_norm_gemv_equals_rmsnorm_then_gemv(dtype: torch.dtype, n: int, k: int,
                                            residual: bool, bias: bool) -> None:
    """A batch-1 projection with its RMSNorm inside: the product matches the norm kernel
    followed by the GEMV (rows not a multiple of the program's 4, K not a power of two), and the
    new residual is exactly x + residual (x itself without one)."""
    w = torch.randn(n, k, device=DEV).to(dtype)
    nw = torch.rand(k, device=DEV).to(dtype) + 0.5
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    x = torch.randn(1, k, device=DEV).to(dtype)
    res = torch.randn(1, k, device=DEV).to(dtype) if residual else None
    got = gemv.norm_gemv(x, res, nw, 1e-6, w, b)
    normed, h = rmsnorm.rmsnorm(x, nw, 1e-6, res)
    assert got.out.shape == (1, n) and got.out.dtype == dtype
    _close(got.out, gemv.gemv(normed, w, b), dtype)
    assert torch.equal(got.residual, h if h is not None else x)
    if dtype == torch.float32:  # the same roundings as the two kernels, up to summation order
        assert torch.allclose(got.out, gemv.gemv(normed, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_residual", [True, False])
def test_column_layer_forward_normed(dtype: torch.dtype, has_residual: bool) -> None:
    """The decoder's entry to a projection: forward_normed(stream, norm) gives the projection
    of norm(h) and h itself, whether the norm runs on its own (pdl off, CPU, float32) or inside
    the batch-1 GEMV (pdl on, one bf16 CUDA row)."""
    layer = ColumnParallelLinear(96, [40, 24], True, DistributedInfo(0, 1)).to(DEV).to(dtype)
    layer.weight.data.normal_()
    layer.bias.data.normal_()  # type: ignore[union-attr]
    norm = RMSNorm(96, 1e-6, KernelPolicy(fused=DEV == "cuda")).to(DEV).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(1, 96, device=DEV).to(dtype)
    res = torch.randn(1, 96, device=DEV).to(dtype) if has_residual else None
    h = x + res if res is not None else x
    want = F.linear(norm._norm(h), layer.weight, layer.bias)
    for pdl in ([False, True] if DEV == "cuda" else [False]):
        layer.policy = KernelPolicy(fused=True, pdl=pdl)
        out, got_h = layer.forward_normed(ResidualStream(x, res, None), norm)
        _close(out, want, dtype)
        assert torch.equal(got_h, h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,k", [(4, 2, 64, 96), (3, 1, 16, 300), (2, 2, 128, 64)])
@pytest.mark.parametrize("residual,bias", [(True, False), (False, True)])
def test_norm_qkv_rope_equals_the_three_kernels(dtype: torch.dtype, heads: int, kv_heads: int,
                                                dim: int, k: int, residual: bool,
                                                bias: bool) -> None:
    """Norm, QKV GEMV, rotary and K/V store in one launch at batch 1: q rotated in qkv, k and v
    unrotated there, the rotated k and v in the caches' slot and no other slot touched; equal
    to norm_gemv then rotary_qk_ with its store (float32 up to summation order)."""
    n = (heads + 2 * kv_heads) * dim
    w = torch.randn(n, k, device=DEV).to(dtype)
    nw = torch.rand(k, device=DEV).to(dtype) + 0.5
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    x = torch.randn(1, k, device=DEV).to(dtype)
    res = torch.randn(1, k, device=DEV).to(dtype) if residual else None
    rope = RotaryEmbedding(dim, 512, 10000.0, None).to(DEV)
    pos = torch.tensor([301], device=DEV)
    caches = [torch.randn(9, kv_heads, dim, device=DEV).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]  # [k, v] for the fused kernel, then for the reference
    slot = torch.tensor([5], dtype=torch.int32, device=DEV)
    got = gemv.norm_qkv_rope(x, res, nw, 1e-6, w, b, QKVRope(
        pos, rope.cos, rope.sin, heads, kv_heads, KVTarget(caches[0], caches[1], slot)))
    want = gemv.norm_gemv(x, res, nw, 1e-6, w, b)
    q, kk, v = want.out.view(1, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    before = [c.clone() for c in caches[2:]]
    rotary.rotary_qk_(q, kk, pos, rope.cos, rope.sin,
                          store=KVStore(v, KVTarget(caches[2], caches[3], slot)))
    assert torch.equal(got.residual, want.residual)
    for a, e in [(got.out, want.out), (caches[0], caches[2]), (caches[1], caches[3])]:
        _close(a, e, dtype)
        if dtype == torch.float32:
            assert torch.allclose(a, e, rtol=1e-5, atol=1e-5)
    for c, c0 in zip(caches[2:], before):  # the reference wrote only slot 5
        assert torch.equal(c[:5], c0[:5]) and torch.equal(c[6:], c0[6:])
    for fused_cache, ref_cache in zip(caches[:2], caches[2:]):  # slot 5 only, in both caches
        assert torch.equal(fused_cache[:5], ref_cache[:5])
        assert torch.equal(fused_cache[6:], ref_cache[6:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,k", [(8, 64), (13, 300), (40, 96)])
@pytest.mark.parametrize("residual,bias,act", [(True, False, SILU), (False, True, SILU),
                                               (True, True, GELU_TANH)])
def test_norm_gate_up_act_equals_norm_gemv_then_the_activation(
        dtype: torch.dtype, d: int, k: int, residual: bool, bias: bool, act: int) -> None:
    """The MLP's first half at batch 1 in one launch (odd d: a program whose second gate row is
    past the gate half) against norm_gemv then act_and_mul, SiLU or GELU (float32 up to
    summation order)."""
    w = torch.randn(2 * d, k, device=DEV).to(dtype)
    nw = torch.rand(k, device=DEV).to(dtype) + 0.5
    b = torch.randn(2 * d, device=DEV).to(dtype) if bias else None
    x = torch.randn(1, k, device=DEV).to(dtype)
    res = torch.randn(1, k, device=DEV).to(dtype) if residual else None
    got = gemv.norm_gate_up_act(x, res, nw, 1e-6, w, b, act=act)
    want = gemv.norm_gemv(x, res, nw, 1e-6, w, b)
    gated = activation.act_and_mul(want.out, act)
    assert got.out.shape == (1, d) and torch.equal(got.residual, want.residual)
    _close(got.out, gated, dtype)
    if dtype == torch.float32:
        assert torch.allclose(got.out, gated, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv.norm_gate_up_act(x, res, nw, 1e-6, w[1:])


def test_norm_gemv_refuses_rows_wider_than_a_program_holds() -> None:
    k = gemv.NORM_GEMV_MAX_K + 1
    with pytest.raises(ValueError, match=f"at most {gemv.NORM_GEMV_MAX_K} features"):
        gemv.norm_gemv(torch.randn(1, k, device=DEV), None, torch.ones(k, device=DEV),
                              1e-6, torch.randn(2, k, device=DEV))
    with pytest.raises(ValueError, match="one row of"):
        gemv.norm_gemv(torch.randn(2, 8, device=DEV), None, torch.ones(8, device=DEV),
                              1e-6, torch.randn(2, 8, device=DEV))


def test_norm_qkv_rope_refuses_layouts_it_cannot_write() -> None:
    """The fused QKV kernel names the shapes it needs instead of writing K/V to wrong places: a
    weight whose rows are not the heads' rows, caches that are not contiguous [slots, kv heads,
    head_dim] of one shape, more than one token's slot."""
    rope = RotaryEmbedding(16, 64, 10000.0, None).to(DEV)
    cache = torch.zeros(4, 1, 16, device=DEV)
    one = torch.zeros(1, dtype=torch.long, device=DEV)
    x, nw = torch.randn(1, 32, device=DEV), torch.ones(32, device=DEV)
    target = KVTarget(cache, cache.clone(), one)
    good = QKVRope(one, rope.cos, rope.sin, 2, 1, target)
    with pytest.raises(ValueError, match="4 heads of a power-of-two head_dim"):
        gemv.norm_qkv_rope(x, None, nw, 1e-6, torch.randn(60, 32, device=DEV), None, good)
    strided = torch.zeros(4, 1, 32, device=DEV)[:, :, :16]  # rows 32 apart
    w = torch.randn(64, 32, device=DEV)
    with pytest.raises(ValueError, match="contiguous k / v caches of one shape"):
        gemv.norm_qkv_rope(x, None, nw, 1e-6, w, None,
                                  good._replace(target=KVTarget(strided, strided, one)))
    with pytest.raises(ValueError, match="contiguous k / v caches of one shape"):
        gemv.norm_qkv_rope(x, None, nw, 1e-6, w, None,
                                  good._replace(target=target._replace(v_cache=cache[:2])))
    with pytest.raises(ValueError, match="one position and slot"):
        gemv.norm_qkv_rope(x, None, nw, 1e-6, w, None,
                                  good._replace(target=target._replace(slots=one.repeat(2))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 7), (1, 4096), (3, 4097), (2, 128256), (4, 49152)])
def test_argmax_rows_matches_torch(dtype: torch.dtype, rows: int, n: int) -> None:
    """The sampler's Triton argmax: same index as torch.argmax, including a maximum in the last
    (partial) chunk and rows whose maximum is in different chunks."""
    x = torch.randn(rows, n, device=DEV).to(dtype)
    x[-1, -1] = 100.0
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_ties_take_the_first_index() -> None:
    """Ties inside a chunk and across chunks resolve to the first index, as torch.argmax does
    (greedy decoding must not depend on the kernel's chunking)."""
    x = torch.zeros(3, 10_000, device=DEV)
    x[0, [5000, 9000]] = 1.0  # two chunks tie: the earlier chunk wins
    x[1, [17, 18, 4095, 4096]] = 2.0  # inside one chunk and across a chunk boundary
    assert argmax.argmax_rows(x).tolist() == [5000, 17, 0] == x.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="unit column stride"):
        argmax.argmax_rows(x.t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_of_nan_rows_stay_inside_the_row(dtype: torch.dtype) -> None:
    """A row that overflowed (NaN, or +inf) still gives an index inside it, the first NaN or
    +inf, which is torch's answer where the row has no +inf before its first NaN: an index past
    the vocabulary would be fed back as the next step's token."""
    n = 10_000  # three chunks, the last one partly masked
    x = torch.randn(5, n, device=DEV).to(dtype)
    x[0] = float("nan")
    x[1, [9_999, 6_000]] = float("nan")
    x[2, 4_100] = float("inf")
    x[3, :] = float("-inf")
    got = argmax.argmax_rows(x).tolist()
    assert got[:3] == [0, 6_000, 4_100] == x.argmax(dim=-1).tolist()[:3]
    assert 0 <= got[3] < n
    assert got[4] == int(x[4].argmax())


def test_project_takes_gemv_only_with_pdl_for_one_half_precision_cuda_row() -> None:
    """The layers' dispatch: CPU, float32, multi-row inputs and pdl off stay on the BLAS (on
    CPU its rows split over torch's threads: layers/blas.py)."""
    w, x = torch.randn(6, 32, device=DEV), torch.randn(1, 32, device=DEV)
    assert torch.equal(project(x, w, policy=GEMV), blas.linear(x, w, None, None))
    if DEV == "cuda" and True in PDL:
        wh, xh = w.bfloat16(), x.bfloat16()
        assert torch.equal(project(xh, wh, policy=GEMV), gemv.gemv(xh, wh))
        assert torch.equal(project(xh, wh), F.linear(xh, wh))
        two = torch.randn(2, 32, device=DEV).bfloat16()
        assert torch.equal(project(two, wh, policy=GEMV), F.linear(two, wh))


@pytest.mark.parametrize("bias", [False, True])
def test_project_into_out_equals_a_new_tensor(bias: bool) -> None:
    """`out` (what CUDA graphs give the LM head, to share one logits buffer): the GEMV and the
    BLAS GEMM write the same bits into a row slice of a larger buffer as into a new tensor, and
    a wrong buffer is refused with its shape, dtype and layout."""
    dtypes = [(torch.float32, KernelPolicy())] + ([(torch.bfloat16, GEMV)] if DEV == "cuda"
                                                  else [])
    for dtype, policy in dtypes:
        w = torch.randn(40, 64, device=DEV).to(dtype)
        b = torch.randn(40, device=DEV).to(dtype) if bias else None
        buffer = torch.full((8, 40), float("nan"), device=DEV, dtype=dtype)
        for rows in (1, 3):
            x = torch.randn(rows, 64, device=DEV).to(dtype)
            got = project(x, w, b, policy, out=buffer[:rows])
            assert got.data_ptr() == buffer.data_ptr()
            assert torch.equal(got, project(x, w, b, policy))
        one = torch.randn(1, 64, device=DEV)
        assert torch.equal(gemv.gemv(one, w.float(), out=buffer[:1].float()),
                           gemv.gemv(one, w.float()))
    x, w = torch.randn(2, 64, device=DEV), torch.randn(40, 64, device=DEV)
    bad = {"torch.float32 [2, 40]": torch.empty(2, 41, device=DEV),
           "float16": torch.empty(2, 40, device=DEV, dtype=torch.float16),
           "not contiguous": torch.empty(40, 2, device=DEV).t()}
    for words, out in bad.items():
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            project(x, w, out=out)
    with pytest.raises(ValueError, match="float16"):
        gemv.gemv(x[:1], w, out=torch.empty(1, 40, device=DEV, dtype=torch.float16))


def test_every_pdl_kernel_waits_for_its_predecessor() -> None:
    """The PDL invariant (kernels/pdl.py): a kernel that may be launched with programmatic
    dependent launch must execute pdl_enter (gdc_wait) in every program, or its successors'
    waits stop covering the kernels before it. Checked on the source of every module of
    minisgl/kernels/: every jitted kernel with a PDL parameter calls pdl_enter(PDL) at the top
    level of its body (not under a branch)."""
    import ast

    import minisgl.kernels

    checked = []
    for path in sorted(Path(minisgl.kernels.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (not isinstance(node, ast.FunctionDef) or node.name == "pdl_enter"
                    or "PDL" not in [a.arg for a in node.args.args]):
                continue
            calls = [s.value.func.id for s in node.body if isinstance(s, ast.Expr)
                     and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)]
            assert "pdl_enter" in calls, f"{path.name}: {node.name} never calls pdl_enter"
            checked.append(node.name)
    assert {"_rmsnorm_kernel", "_gemv_kernel", "_norm_gemv_kernel", "_norm_gate_up_kernel",
            "_norm_qkv_rope_kernel", "_decode_split_kernel", "_store_kv_kernel"} <= set(checked)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,slots,cols,n", [(1, 1, 48, 96), (5, 3, 16, 70),
                                                (33, 2, 24, 130)])
def test_lora_expand_adds_each_tokens_own_adapters_delta(dtype: torch.dtype, tokens: int,
                                                         slots: int, cols: int, n: int) -> None:
    """kernels/lora.expand_add: y + (low masked to each token's adapter) B^T in one kernel, as
    torch's mask multiply and addmm give it (row and column counts off the block sizes; a
    token of the base model gets y itself); on CUDA, LoraSlots under the fused policy (which
    takes it) gives what it gives without."""
    from minisgl.core import LoraRows
    from minisgl.distributed import Shard
    from minisgl.engine.lora import adapter_mask
    from minisgl.kernels.lora import expand_add
    from minisgl.layers.lora import LoraShape, LoraSlots
    g = torch.Generator().manual_seed(tokens)
    make = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)  # noqa: E731
    low, b, y = make(tokens, slots * cols), make(n, slots * cols), make(tokens, n)
    index = torch.tensor([(t % (slots + 1)) - 1 for t in range(tokens)], device=DEV)
    mask = adapter_mask(index, slots, dtype)
    want = torch.addmm(y.float(), (low.float().view(tokens, slots, cols)
                                   * mask.float().unsqueeze(2)).flatten(1), b.float().t())
    got = expand_add(y, low, mask, b, cols)
    assert got.dtype == dtype and got.shape == y.shape
    _close(got, want, dtype)
    base = index < 0
    if base.any():
        assert torch.equal(got[base], y[base])
    with pytest.raises(ValueError, match="LoRA expand"):
        expand_add(y, low, mask, b[:, 1:], cols)
    layer = LoraSlots(LoraShape(slots, cols), 8, [Shard(0, n)], GEMV).to(DEV, dtype)
    layer.a.copy_(make(slots, cols, 8))
    layer.b.copy_(b.view(n, slots, cols))
    x = make(tokens, 8)
    fused = layer.add_delta(y, x, LoraRows(mask))
    plain = LoraSlots(LoraShape(slots, cols), 8, [Shard(0, n)]).to(DEV, dtype)
    plain.a.copy_(layer.a)
    plain.b.copy_(layer.b)
    _close(fused, plain.add_delta(y, x, LoraRows(mask)), dtype)


@pytest.mark.parametrize("k", [96, 1200])
@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_rows_do_not_depend_on_their_company(dtype: torch.dtype,
                                                              k: int) -> None:
    """kernels/invariant_mm.py (deterministic inference): the product's rows are the same bits
    whichever rows come with them and wherever they sit in a tile (N and K not multiples of
    the tiles; with a bias), at the small tiles of a few rows and, on sm_90, the large tiles
    of LARGE_TILE_ROWS or more, and with K in ranges (k 1,200: a few rows' ranges summed by
    programs of their own, many rows' by one program in turn); and they are x W^T + b. The
    interpreter's dot is numpy's,
    whose BLAS rounds a row by its place in a micro-tile: there, rows keep their place in a
    tile (the tensor cores' rows do not depend on it: the whole check runs on CUDA)."""
    from minisgl.kernels.invariant_mm import (LARGE_TILE_ROWS, invariant_linear,
                                              invariant_tiles, k_splits)
    for cap in ((8, 0), (9, 0)):  # each element's order of sums: one depth of K at any size
        assert len({invariant_tiles(dtype, rows, n, cap).block_k for rows in (1, 4096)
                    for n in (80, 28672)}) == 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 8
    splits = k_splits(80, k, invariant_tiles(dtype, 1, 80, (0, 0)).block_k, sms)
    assert (splits > 1) == (k > 96), splits
    g = torch.Generator().manual_seed(3)
    m = LARGE_TILE_ROWS + 44
    w, b = torch.randn(80, k, generator=g), torch.randn(80, generator=g)
    x = torch.randn(m, k, generator=g)
    w, b, x = (t.to(DEV, dtype) for t in (w, b, x))
    full = invariant_linear(x, w, b)
    _close(full, F.linear(x.float(), w.float(), b.float()), dtype)
    tile = 32 if dtype == torch.float32 else 64  # the small tiles' block_m
    same_place = [list(range(tile, 70)), list(range(tile)), list(range(5))]
    anywhere = [[5], [5, 6, 7], list(range(3, 70, 2)), [69, 1], [m - 1],
                list(range(LARGE_TILE_ROWS - 1, m))]
    for rows in same_place + (anywhere if DEV == "cuda" else []):
        assert torch.equal(invariant_linear(x[rows], w, b), full[rows]), rows
    out = torch.empty(3, 80, dtype=dtype, device=DEV)
    assert invariant_linear(x[:3], w, b, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, full[:3])
    with pytest.raises(ValueError, match="do not fit"):
        invariant_linear(x[:, :k - 1], w)


def test_invariant_linear_tma_loads_give_the_pointer_loads_bits() -> None:
    """kernels/invariant_mm.py: the TMA kernel (sm_90's prefill tiles) sums what the pointer
    kernel sums in its order, so at the same tiles it gives its bits: K in uneven ranges, rows
    and columns past the tiles' edges, a bias, an output whose rows are strided. Bf16 on an
    sm_90 GPU, bit for bit. Float32 on the interpreter (which reads TMA descriptors) to
    float32 rounding only: there each tl.dot is numpy's matmul, and OpenBLAS sums a tile
    product in an order that follows its operands' memory layout (the TMA path's `w.T` is a
    transposed view, the pointer path's tile a gathered array) on some processors (an AMD
    EPYC's), not on others."""
    import minisgl.kernels.invariant_mm as mm
    on_sm90 = DEV == "cuda" and torch.cuda.get_device_capability()[0] == 9
    if DEV == "cuda" and not on_sm90:
        pytest.skip("TMA needs sm_90")
    dtype, tiles = ((torch.bfloat16, (128, 256, 64, 8, 3)) if on_sm90
                    else (torch.float32, (32, 32, 32, 4, 2)))
    m, n, k = 300, 80, 1200
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*shape, generator=g).to(DEV, dtype)
               for shape in ((m, k), (n, k), (n,)))
    span = 320  # four ranges, the last of 240
    got, want = (torch.zeros(m, n + 16, dtype=dtype, device=DEV)[:, :n] for _ in range(2))
    mm._launch_tma(x, w, b, got, mm.InvariantTiles(*tiles, True), mm.Ranges(4, span))
    mm._launch(x, w, b, want, mm.InvariantTiles(*tiles, False), mm.Ranges(4, span))
    if on_sm90:
        assert torch.equal(got, want)
    else:  # a wrong tile, range or edge errs by O(1) here
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    _close(got, F.linear(x.float(), w.float(), b.float()), dtype)
