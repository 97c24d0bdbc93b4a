"""The FP8 kernels (kernels/fp8.py: activation quantization, the scaled GEMMs; kernels/gemv.py
with FP8 weights) against torch references on dequantized values. On CPU through Triton's
interpreter (float32); on CUDA also in bfloat16, with torch._scaled_mm's rowwise path and an
FP8 model run end to end."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from minisgl.kernels import activation, attention, gemv, rmsnorm, rotary  # noqa: E402
from minisgl.kernels import fp8 as kernels  # noqa: E402
from minisgl.kernels.types import (GELU_TANH, SILU, HeadNorms, KVStore, KVTarget,  # noqa: E402
                                   ProductScales, QKVRope)
from minisgl.layers import fp8  # noqa: E402
from minisgl.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
# FP8 tensor-core products on the GPU accumulate in fewer bits than float32 (Hopper's FP8 MMA):
# a float32 output differs from the float32 reference by about 2e-4 there.
GEMM_TOL = {**TOL, torch.float32: 1e-5 if DEV == "cpu" else 1e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal FP8 values: exactly under the interpreter (the same float32 division and rounding
    as torch); on CUDA a rare tie may round the other way after the GPU's division."""
    differ = (got.float() != want.float()).float().mean().item()
    assert differ == 0 or (DEV == "cuda" and differ < 1e-3), differ


def _fp8_weight(n: int, k: int, block: object = None):
    w = torch.randn(n, k, device=DEV) * 0.05
    return fp8.quantize_rows(w) if block is None else fp8.quantize_blocks(w, block)


@pytest.mark.parametrize("m,k", [(5, 300), (3, 5000)])
def test_quantize_tokens_dynamic_and_static(m: int, k: int) -> None:
    """Per-row amax / 448 scales (an all-zero row gets a tiny one and zeros), the row divided
    and cast; with a static scale every row takes it, saturating at +-448."""
    x = torch.randn(m, k, device=DEV) * torch.logspace(-2, 2, m, device=DEV)[:, None]
    x = torch.cat([x, torch.zeros(1, k, device=DEV)])
    m += 1
    got = kernels.quantize_tokens(x)
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=kernels.MIN_AMAX) / kernels.FP8_MAX
    assert got.values.dtype == kernels.FP8 and got.scales.shape == (m, 1)
    assert torch.allclose(got.scales, scale, rtol=1e-6, atol=0)
    want = (x / scale).clamp(-448, 448).to(kernels.FP8)
    _same_fp8(got.values, want)
    assert _rel(got.values.float() * got.scales, x) < 0.05  # the zero row adds nothing
    assert torch.all(got.values[-1].float() == 0)
    static = torch.tensor([0.01], device=DEV)
    got = kernels.quantize_tokens(x, static)
    assert torch.all(got.scales == 0.01)
    _same_fp8(got.values, (x / 0.01).clamp(-448, 448).to(kernels.FP8))


def test_quantize_groups_scales_each_group() -> None:
    x = torch.randn(3, 300, device=DEV)
    x[:, 128:256] *= 100.0
    got = kernels.quantize_groups(x, 128)
    assert got.scales.shape == (3, 3)
    for g in range(3):
        part = x[:, g * 128:(g + 1) * 128]
        assert torch.allclose(got.scales[:, g], part.abs().amax(dim=1) / 448, rtol=1e-6)
    deq = got.values.float() * got.scales.repeat_interleave(128, 1)[:, :300]
    assert _rel(deq, x) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 64, False), (19, 200, 320, True)] + (
    [(70, 128, 256, False), (300, 4096, 1024, True)] if DEV == "cuda" else []))
def test_scaled_mm_rowwise_equals_dequantized_product(dtype: torch.dtype, m: int, n: int,
                                                      k: int, bias: bool) -> None:
    w, ws = _fp8_weight(n, k)
    a = kernels.quantize_tokens(torch.randn(m, k, device=DEV))
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    want = F.linear(a.values.float() * a.scales, w.float() * ws[:, None],
                    None if b is None else b.float())
    got = kernels.scaled_mm(a, w, ws, b, dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    assert _rel(got, want) < GEMM_TOL[dtype]
    tiles = kernels.rowwise_plan(m, n).tiles
    if tiles is not None:  # the Hopper-tuned tiles compute the same product
        assert _rel(kernels.scaled_mm(a, w, ws, b, dtype, tiles=tiles), want) < GEMM_TOL[dtype]
    if DEV == "cuda" and kernels.rowwise_mm_applies(k, n, dtype):
        assert _rel(kernels.rowwise_mm(a, w, ws, b), want) < GEMM_TOL[dtype]
        # "auto" (Hopper's choice per shape) and its unscaled product rescaled after
        auto = fp8.Fp8Weight(w, ws, None, fp8.Fp8Spec(gemm="auto"),
                             torch.ones(1, device=DEV))
        assert _rel(fp8.rowwise_product(a, auto, b, dtype), want) < GEMM_TOL[dtype]
        if dtype == torch.bfloat16:
            raw = kernels.unscaled_mm(a.values, w, auto.unit)
            assert _rel(kernels.rescale(raw, a.scales, ws, b, dtype), want) < TOL[dtype]


def test_rowwise_plan_by_rows() -> None:
    """Few rows: Triton tiles (narrower weight tiles for narrower weights); a decode batch's
    rows: the unscaled tensorwise product; a prefill's: cuBLASLt rowwise."""
    small, wide = kernels.rowwise_plan(64, 4096), kernels.rowwise_plan(16, 28672)
    assert small.kind == "triton" and small.tiles.block_n == 32 and small.tiles.block_m == 64
    assert wide.kind == "triton" and wide.tiles.block_n == 128 and wide.tiles.block_m == 16
    assert kernels.rowwise_plan(137, 6144).kind == "tensorwise"
    assert kernels.rowwise_plan(kernels.TENSORWISE_MAX_ROWS + 1, 4096).kind == "cublaslt"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rescale_applies_row_and_column_scales(dtype: torch.dtype, bias: bool) -> None:
    x = (torch.randn(7, 300, device=DEV) * 100).to(dtype)
    rs, cs = torch.rand(7, 1, device=DEV) + 0.1, torch.rand(300, device=DEV) + 0.1
    b = torch.randn(300, device=DEV).to(dtype) if bias else None
    want = x.float() * rs * cs + (b.float() if b is not None else 0.0)
    got = kernels.rescale(x, rs, cs, b, dtype)
    assert got.dtype == dtype and _rel(got, want) < TOL[dtype]
    if DEV == "cpu":  # the GPU may fuse the bias add into a multiply-add: one rounding fewer
        assert torch.equal(got, want.to(dtype))
    with pytest.raises(ValueError, match="row scales"):
        kernels.rescale(x, rs[:3], cs, None, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True], ids=["row", "split"])
def test_act_and_mul_quantized_scales_an_unscaled_product(dtype: torch.dtype,
                                                          split: bool) -> None:
    """With the product's scales, the activation kernel equals rescaling first, then the plain
    quantized activation (one program a row, or each row over several)."""
    raw = (torch.randn(4, 2 * 4500, device=DEV) * 50).to(dtype)
    rs, cs = torch.rand(4, 1, device=DEV) * 0.1, torch.rand(9000, device=DEV) * 0.1
    got = activation.act_and_mul_quantized(raw, row_scale=rs, col_scale=cs, split=split)
    want = activation.act_and_mul_quantized(kernels.rescale(raw, rs, cs, None, dtype),
                                            split=not split)
    _same_quantized(got, want)
    with pytest.raises(ValueError, match="both scales or neither"):
        activation.act_and_mul_quantized(raw, row_scale=rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 256, 384), (21, 320, 200)] + (
    [(100, 1024, 512)] if DEV == "cuda" else []))
def test_scaled_mm_blockwise_equals_dequantized_product(dtype: torch.dtype, m: int, n: int,
                                                        k: int) -> None:
    """128 x 128 weight blocks (a ragged last block in N and in K), 1 x 128 activation groups."""
    w, ws = _fp8_weight(n, k, (128, 128))
    a = kernels.quantize_groups(torch.randn(m, k, device=DEV), 128)
    want = F.linear(a.values.float() * a.scales.repeat_interleave(128, 1)[:, :k],
                    fp8.dequantize(w, ws, (128, 128), torch.float32))
    got = kernels.scaled_mm(a, w, ws, None, dtype, (128, 128))
    assert _rel(got, want) < GEMM_TOL[dtype]
    with pytest.raises(ValueError, match="weight scales"):
        kernels.scaled_mm(a, w, ws[:, :1], None, dtype, (128, 128))


@pytest.mark.parametrize("spec", [fp8.Fp8Spec(), fp8.Fp8Spec(gemm="triton"),
                                  fp8.Fp8Spec(static_input=True), fp8.Fp8Spec(block=(128, 128))])
def test_fp8_linear_is_close_to_the_dequantized_layer(spec: fp8.Fp8Spec) -> None:
    """The W8A8 projection (activations quantized too) against F.linear on the dequantized
    weight: within FP8's activation rounding."""
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    w, ws = _fp8_weight(192, 256, spec.block)
    x = torch.randn(2, 3, 256, device=DEV).to(dtype)
    static = torch.tensor([x.abs().max().item() / 448], device=DEV) if spec.static_input else None
    got = fp8.linear(x, fp8.Fp8Weight(w, ws, static, spec), None)
    want = F.linear(x.float(), fp8.dequantize(w, ws, spec.block, torch.float32))
    assert got.shape == (2, 3, 192) and got.dtype == dtype
    assert _rel(got, want) < 0.05


def _same_quantized(got: kernels.Quantized, want: kernels.Quantized) -> None:
    assert got.values.dtype == kernels.FP8 and got.scales.shape == want.scales.shape
    assert torch.equal(got.scales, want.scales)
    _same_fp8(got.values, want.values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_quantized_equals_quantizing_the_norm(dtype: torch.dtype, residual: bool
                                                      ) -> None:
    """The norm kernel's FP8 output is quantize_tokens of its plain output, exactly (scales
    bit-equal), and its new residual is the plain kernel's; rows of very different sizes."""
    x = (torch.randn(6, 300, device=DEV) * torch.logspace(-3, 3, 6, device=DEV)[:, None]
         ).to(dtype)
    res = torch.randn(6, 300, device=DEV).to(dtype) if residual else None
    w = (torch.rand(300, device=DEV) + 0.5).to(dtype)
    plain, plain_res = rmsnorm.rmsnorm(x, w, 1e-6, res)
    got, got_res = rmsnorm.rmsnorm_quantized(x, w, 1e-6, res)
    _same_quantized(got, kernels.quantize_tokens(plain))
    assert (got_res is None) == (not residual)
    if residual:
        assert torch.equal(got_res, plain_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_norms_scale_an_unscaled_product(dtype: torch.dtype, residual: bool) -> None:
    """With an unscaled product's scales (o_proj / down_proj taken unscaled at tp=1), both
    norm kernels equal rescaling first, then the plain kernel: output and new residual."""
    raw = (torch.randn(5, 300, device=DEV) * 80).to(dtype)
    scales = ProductScales(torch.rand(5, 1, device=DEV) * 0.1, torch.rand(300, device=DEV))
    res = torch.randn(5, 300, device=DEV).to(dtype) if residual else None
    w = (torch.rand(300, device=DEV) + 0.5).to(dtype)
    scaled = kernels.rescale(raw, scales.row, scales.col, None, dtype)
    plain, plain_res = rmsnorm.rmsnorm(scaled, w, 1e-6, res)
    got, got_res = rmsnorm.rmsnorm(raw, w, 1e-6, res, scales=scales)
    # In float32 on the GPU the scaling and the residual add may contract into one multiply-add
    # (one rounding fewer); a half dtype rounds in between, so the bits are the same there.
    same = torch.equal if dtype != torch.float32 or DEV == "cpu" else (
        lambda a, b: _rel(a, b) < 1e-6)
    assert same(got, plain)
    assert (got_res is None) == (not residual) and (not residual or same(got_res, plain_res))
    got_q, got_res = rmsnorm.rmsnorm_quantized(raw, w, 1e-6, res, scales=scales)
    want_q = rmsnorm.rmsnorm_quantized(scaled, w, 1e-6, res)[0]
    if same is torch.equal:
        _same_quantized(got_q, want_q)
    else:  # an input a rounding apart may land on the next FP8 value
        deq = lambda q: q.values.float() * q.scales  # noqa: E731
        assert _rel(deq(got_q), deq(want_q)) < 1e-2
    assert not residual or same(got_res, plain_res)
    with pytest.raises(ValueError, match="row scales"):
        rmsnorm.rmsnorm(raw, w, 1e-6, res, scales=ProductScales(scales.row[:2], scales.col))


@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("with_norms", [False, True])
def test_rotary_store_scales_an_unscaled_qkv_product(fp8_cache: bool, with_norms: bool) -> None:
    """The rotary K/V store given an unscaled QKV product and its scales (QKV taken unscaled):
    q (scaled and rotated) and the cache contents equal rescaling the product first; with
    Qwen3's q/k norms too (applied after the scales)."""
    dtype = DTYPES[-1]
    heads, kv_heads, dim, tokens = 4, 2, 32, 3
    width = (heads + 2 * kv_heads) * dim
    rope = RotaryEmbedding(dim, 64, 10000.0, None).to(DEV)
    pos = torch.tensor([5, 9, 63], device=DEV)
    slots = torch.tensor([6, 0, 3], dtype=torch.int32, device=DEV)
    raw = (torch.randn(tokens, width, device=DEV) * 40).to(dtype)
    scales = ProductScales(torch.rand(tokens, 1, device=DEV) * 0.1,
                           torch.rand(width, device=DEV))

    def split(t: torch.Tensor) -> list:
        return [x.view(t.shape[0], -1, dim) for x in
                t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)]
    caches = (_fp8_caches(8, kv_heads, dim) if fp8_cache else
              [torch.zeros(8, kv_heads, dim, device=DEV, dtype=dtype) for _ in range(4)])
    norms = (HeadNorms(torch.rand(dim, device=DEV).add(0.5).to(dtype),
                       torch.rand(dim, device=DEV).add(0.5).to(dtype), 1e-6)
             if with_norms else None)
    q, kk, v = split(raw.clone())
    rotary.rotary_qk_(q, kk, pos, rope.cos, rope.sin,
                      store=KVStore(v, KVTarget(caches[0], caches[1], slots, 0.5, 2.0)),
                      scales=scales, norms=norms)
    q2, k2, v2 = split(kernels.rescale(raw, scales.row, scales.col, None, dtype))
    rotary.rotary_qk_(q2, k2, pos, rope.cos, rope.sin,
                      store=KVStore(v2, KVTarget(caches[2], caches[3], slots, 0.5, 2.0)),
                      norms=norms)
    assert torch.equal(q, q2)
    assert torch.equal(caches[0].float(), caches[2].float())
    assert torch.equal(caches[1].float(), caches[3].float())
    with pytest.raises(ValueError, match="K/V store"):
        rotary.rotary_qk_(q, kk, pos, rope.cos, rope.sin, scales=scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [700, 5000])  # one pass (part) of columns; several, the last ragged
@pytest.mark.parametrize("split,act", [(False, SILU), (True, SILU), (True, GELU_TANH)],
                         ids=["row", "split", "split-gelu"])
def test_act_and_mul_quantized_equals_quantizing_the_activation(dtype: torch.dtype, d: int,
                                                                 split: bool, act: int) -> None:
    """Each path (one program a row; a row split over programs of 2,048 columns, whose parts'
    amax make the scale) equals quantizing the activation, bit for bit, SiLU or GELU."""
    x = (torch.randn(5, 2 * d, device=DEV) * 3).to(dtype)
    x[2] = 0.0  # an all-zero row: the smallest scale, zeros
    x[3, d - 1] = 500.0  # the row's largest value in its last, ragged part
    got = activation.act_and_mul_quantized(x, act, split=split)
    _same_quantized(got, kernels.quantize_tokens(activation.act_and_mul(x, act)))
    assert torch.all(got.values[2].float() == 0)


def test_act_and_mul_quantized_splits_decode_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to SPLIT_MAX_ROWS rows take the split path by default, more one program a row."""
    calls = []
    real = activation._split_act_quant
    monkeypatch.setattr(activation, "_split_act_quant",
                        lambda *a: calls.append(a) or real(*a))
    for rows in (3, activation.SPLIT_MAX_ROWS + 1):
        activation.act_and_mul_quantized(torch.zeros(rows, 64, device=DEV))
    assert [a[0].shape[0] for a in calls] == [3]


@pytest.mark.parametrize("n,k,bias", [(10, 64, False), (7, 300, True), (9, 4096, True),
                                    (13, 8292, True)])  # down's tiles: 8 rows a program
def test_fp8_gemv_equals_gemv_on_the_dequantized_weight(n: int, k: int, bias: bool) -> None:
    dtype = DTYPES[-1]
    w, ws = _fp8_weight(n, k)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    x = torch.randn(1, k, device=DEV).to(dtype)
    got = gemv.gemv(x, w, b, weight_scale=ws)
    want = F.linear(x.float(), w.float() * ws[:, None], None if b is None else b.float())
    assert got.dtype == dtype and _rel(got, want) < TOL[dtype]
    with pytest.raises(ValueError, match="weight_scale"):
        gemv.gemv(x, w, b)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv.gemv(x, w.float(), b, weight_scale=ws)


@pytest.mark.parametrize("rows,pairs", [(4, None), (16, 8)])
def test_fp8_norm_gemvs_equal_their_dense_kernels_on_dequantized_weights(
        rows: int, pairs: Optional[int]) -> None:
    """norm_gemv, norm_gate_up_act and norm_qkv_rope with FP8 weights and row scales equal the
    same kernels on the dequantized float32 weights (up to where the scale multiplies), at the
    default tiling (FP8's: gemv.default_pairs) and at wider programs (the gate/up rows then
    not a multiple of a program's)."""
    dtype = DTYPES[-1]
    k = 96
    nw = torch.rand(k, device=DEV).to(dtype) + 0.5
    x = torch.randn(1, k, device=DEV).to(dtype)
    res = torch.randn(1, k, device=DEV).to(dtype)
    w, ws = _fp8_weight(40, k)
    dense = fp8.dequantize(w, ws, None, dtype)
    tol = TOL[dtype]
    got = gemv.norm_gemv(x, res, nw, 1e-6, w, None, weight_scale=ws, rows=rows)
    assert _rel(got.out, gemv.norm_gemv(x, res, nw, 1e-6, dense, None).out) < tol
    got = gemv.norm_gate_up_act(x, res, nw, 1e-6, w, None, weight_scale=ws, pairs=pairs)
    want = activation.act_and_mul(gemv.norm_gemv(x, res, nw, 1e-6, dense, None).out)
    assert _rel(got.out, want) < tol
    heads, kv_heads, dim = 2, 1, 32
    w, ws = _fp8_weight((heads + 2 * kv_heads) * dim, k)
    dense = fp8.dequantize(w, ws, None, dtype)
    rope = RotaryEmbedding(dim, 64, 10000.0, None).to(DEV)
    pos = torch.tensor([7], device=DEV)
    slot = torch.tensor([2], dtype=torch.int32, device=DEV)
    caches = [torch.zeros(4, kv_heads, dim, device=DEV).to(dtype) for _ in range(4)]
    got = gemv.norm_qkv_rope(x, res, nw, 1e-6, w, None, QKVRope(
        pos, rope.cos, rope.sin, heads, kv_heads, KVTarget(caches[0], caches[1], slot)),
        weight_scale=ws, pairs=pairs)
    want = gemv.norm_gemv(x, res, nw, 1e-6, dense, None)
    q, kk, v = want.out.view(1, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    rotary.rotary_qk_(q, kk, pos, rope.cos, rope.sin,
                      store=KVStore(v, KVTarget(caches[2], caches[3], slot)))
    for a, e in [(got.out, want.out), (caches[0], caches[2]), (caches[1], caches[3])]:
        assert _rel(a, e) < tol


def _fp8_caches(slots: int, kv_heads: int, dim: int) -> list:
    return [torch.zeros(slots, kv_heads, dim, device=DEV, dtype=kernels.FP8) for _ in range(4)]


def test_fused_kv_writers_quantize_into_an_fp8_cache_as_store_kv_does() -> None:
    """The rotary kernel's K/V store and the QKV GEMV's, into FP8 caches with per-layer scales:
    the same bits as rotating in place and then store_kv (which quantizes)."""
    dtype = DTYPES[-1]
    heads, kv_heads, dim, tokens, k = 4, 2, 32, 3, 96
    rope = RotaryEmbedding(dim, 64, 10000.0, None).to(DEV)
    pos = torch.tensor([5, 9, 63], device=DEV)
    slots = torch.tensor([6, 0, 3], dtype=torch.int32, device=DEV)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEV) * 3).to(dtype)

    def split(t: torch.Tensor) -> list:
        return [x.view(t.shape[0], -1, dim) for x in
                t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)]
    caches = _fp8_caches(8, kv_heads, dim)
    q, kk, v = split(qkv.clone())
    rotary.rotary_qk_(q, kk, pos, rope.cos, rope.sin,
                      store=KVStore(v, KVTarget(caches[0], caches[1], slots, 0.5, 2.0)))
    q2, k2, v2 = split(qkv.clone())
    rotary.rotary_qk_(q2, k2, pos, rope.cos, rope.sin)
    attention.store_kv(k2, v2, slots, caches[2], caches[3], k_scale=0.5, v_scale=2.0)
    assert torch.equal(q, q2)
    assert torch.equal(caches[0].float(), caches[2].float())
    assert torch.equal(caches[1].float(), caches[3].float())
    # the QKV GEMV at one token, its weights FP8 too
    nw = torch.rand(k, device=DEV).to(dtype) + 0.5
    x, res = (torch.randn(1, k, device=DEV).to(dtype) for _ in range(2))
    w, ws = _fp8_weight((heads + 2 * kv_heads) * dim, k)
    caches = _fp8_caches(8, kv_heads, dim)
    one = slots[:1]
    got = gemv.norm_qkv_rope(x, res, nw, 1e-6, w, None, QKVRope(
        pos[:1], rope.cos, rope.sin, heads, kv_heads,
        KVTarget(caches[0], caches[1], one, 0.25, 0.75)), weight_scale=ws)
    want = gemv.norm_gemv(x, res, nw, 1e-6, w, None, weight_scale=ws)
    q, kk, v = split(want.out.clone())
    rotary.rotary_qk_(q, kk, pos[:1], rope.cos, rope.sin)
    attention.store_kv(kk, v, one, caches[2], caches[3], k_scale=0.25, v_scale=0.75)
    assert torch.equal(caches[0].float(), caches[2].float())
    assert torch.equal(caches[1].float(), caches[3].float())
    assert _rel(got.out.view(1, -1, dim)[:, :heads], q) < TOL[dtype]


def _first_tokens_agree(a: list, b: list) -> bool:
    """Most sequences start with the same token: FP8 moves the logits a little, which may flip
    a near-tie (and everything after it) but not most first tokens."""
    return sum(x[0] == y[0] for x, y in zip(a, b)) >= 2 * len(a) / 3


@pytest.mark.gpu
def test_gpu_online_fp8_graphs_equal_eager_and_bf16_runs(tiny_model) -> None:  # type: ignore
    """`quantization="fp8"` on CUDA. float32: the Triton W8A8 GEMMs inside the decode CUDA
    graphs (padded batches) give the eager run's tokens. bfloat16: torch._scaled_mm for
    prefill and decode batches, the FP8 GEMVs at batch 1 (two runs agree), first tokens
    mostly the unquantized model's."""
    from minisgl import LLM, SamplingParams
    from hf_reference import mixed_prompts
    path: Path = tiny_model("qwen3")
    prompts = mixed_prompts(6, seed=5, lengths=(2, 9, 40))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(**kw: object) -> tuple:
        with LLM(str(path), device="cuda", max_kv_tokens=4096, show_progress=False,
                 **kw) as llm:  # type: ignore[arg-type]
            batch = [o.token_ids for o in llm.generate(prompts, params)]
            one = [llm.generate([p], params)[0].token_ids for p in prompts[:2]]
        return batch, one
    fp32 = dict(dtype="float32", quantization="fp8")
    assert run(cuda_graph_max_bs=16, **fp32) == run(cuda_graph_max_bs=0, **fp32)
    fp8, fp8_one = run(dtype="bfloat16", quantization="fp8")
    dense, _ = run(dtype="bfloat16")
    assert all(len(t) == 16 for t in fp8 + fp8_one)
    assert run(dtype="bfloat16", quantization="fp8")[1] == fp8_one
    assert _first_tokens_agree(fp8, dense)


@pytest.mark.gpu
def test_gpu_unscaled_fp8_products_fold_their_scales(tiny_model,  # type: ignore
                                                     monkeypatch) -> None:
    """Hopper's "auto" FP8 GEMM takes the projections of 65-512 rows unscaled, and their scales
    go to the kernels that read them (the rotary K/V store for QKV, the next norm for o_proj
    and down_proj at tp=1, SiLU-and-mul for gate/up): not one rescale launch, in eager steps
    or in the decode graphs' capture; the next-token distributions those of cuBLASLt's rowwise
    GEMMs (the prefill's 350 rows and the decode step's 70), up to bfloat16 rounding."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the per-shape FP8 GEMM is Hopper's")
    from minisgl import LLM, SamplingParams
    from minisgl.models import quantization
    path: Path = tiny_model("llama")  # no q/k norms: the rotary kernel stores K/V
    prompts = torch.randint(10, 40000, (70, 5), generator=torch.Generator().manual_seed(3))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=5)
    calls = {"rescale": 0, "unscaled_mm": 0}

    def counted(name: str) -> object:
        real = getattr(kernels, name)

        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return real(*args, **kwargs)
        return call
    for name in calls:
        monkeypatch.setattr(kernels, name, counted(name))

    def run() -> list:
        with LLM(str(path), device="cuda", dtype="bfloat16", quantization="fp8",
                 max_kv_tokens=4096, show_progress=False) as llm:
            return [o.logprobs for o in llm.generate(prompts.tolist(), params)]
    auto = run()
    assert calls["unscaled_mm"] > 0 and calls["rescale"] == 0, calls
    monkeypatch.setattr(quantization, "fp8_gemm", lambda device, dtype: "scaled_mm")
    rowwise = run()
    close = compared = 0
    for steps_a, steps_b in zip(auto, rowwise):
        for a, b in zip(steps_a, steps_b):  # each step while the two sequences agree
            pa, pb = dict(zip(a.top_ids, a.top_logprobs)), dict(zip(b.top_ids, b.top_logprobs))
            shared = set(pa) & set(pb)
            compared += 1
            close += len(shared) >= 3 and max(abs(pa[t] - pb[t]) for t in shared) < 0.25
            if a.top_ids[0] != b.top_ids[0]:
                break
    assert close >= 0.9 * compared, (close, compared)


@pytest.mark.gpu
def test_gpu_fp8_block_checkpoint_runs(tiny_model, tmp_path: Path) -> None:  # type: ignore
    """A block-wise fp8 checkpoint on CUDA (the Triton block-scaled GEMM, also at batch 1)
    starts its sequences mostly as the CPU's weight-only run of it."""
    from minisgl import LLM, SamplingParams
    from fp8_checkpoints import Fp8Format, Group, write_fp8
    from hf_reference import mixed_prompts
    dense = tiny_model("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=128)
    ckpt = write_fp8(dense, tmp_path, Fp8Format("fp8", (Group("Linear", "block", False),),
                                                (), ()))
    prompts = mixed_prompts(6, seed=6, lengths=(2, 9, 40))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = {}
    for device in ("cuda", "cpu"):
        with LLM(str(ckpt.fp8), device=device, max_kv_tokens=2048, show_progress=False) as llm:
            out[device] = [o.token_ids for o in llm.generate(prompts, params)]
            if device == "cuda":
                assert len(llm.generate([prompts[0]], params)[0].token_ids) == 8  # batch 1
    assert _first_tokens_agree(out["cuda"], out["cpu"])
