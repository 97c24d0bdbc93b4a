"""layers/blas.py: the per-projection choice between cuBLAS and cuBLASLt (EngineConfig.tune_gemms).
The timing itself needs a GPU (tests/test_gpu.py); here a fake timer drives `tune`, and the
tables are checked to reach the GEMMs without changing a CPU model's output."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from minisgl.distributed import Communicator, DistributedInfo
from minisgl.engine.config import EngineConfig
from minisgl.layers import blas
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import ColumnParallelLinear, project
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.server.args import parse_args


def test_pick_needs_cublaslt_faster_by_the_margin() -> None:
    assert blas.pick({"cublas": 100.0, "cublaslt": 90.0}) == "cublaslt"
    assert blas.pick({"cublas": 100.0, "cublaslt": 98.0}) == "cublas"  # a near-tie: default
    assert blas.pick({"cublas": 90.0, "cublaslt": 100.0}) == "cublas"


def _layer(out: int, inp: int) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(inp, [out], bias=False, info=DistributedInfo(0, 1))
    layer.weight.data.normal_()
    return layer


def test_tune_times_each_shape_once_and_stores_only_cublaslt_wins() -> None:
    a1, a2, b = _layer(8, 4), _layer(8, 4), _layer(16, 4)  # a1, a2 share a shape
    b.blas_by_rows[2] = "cublaslt"  # a stale choice that the new timing overturns
    calls: List[Tuple[Tuple[int, int], int, str]] = []

    def timer(x: torch.Tensor, w: torch.Tensor, library: str) -> float:
        calls.append((tuple(w.shape), x.shape[0], library))  # type: ignore[arg-type]
        assert x.shape[1] == w.shape[1] and x.dtype == w.dtype
        lt_wins = w.shape[0] == 8 and x.shape[0] == 2
        return 50.0 if (library == "cublaslt") == lt_wins else 100.0

    tuned = blas.tune([a1, a2, b], [1, 2], timer)
    assert len(calls) == 2 * 2 * 2  # 2 shapes x 2 row counts x 2 libraries
    assert tuned == blas.Tuned(shapes=2, pairs=4)
    assert a1.blas_by_rows == a2.blas_by_rows == {2: "cublaslt"}
    assert b.blas_by_rows == {}


def test_tunable_layers_are_the_projections_and_the_lm_head() -> None:
    cfg = ModelConfig(architecture="test", vocab_size=50, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      eos_token_ids=(2,), torch_dtype=None)
    info = DistributedInfo(0, 1)
    model = LlamaForCausalLM(cfg, info, Communicator(info))
    layers = blas.tunable_layers(model)
    assert len(layers) == 4 * cfg.num_layers + 1  # QKV, O, gate_up, down per layer; LM head
    assert isinstance(layers[-1], ParallelLMHead)
    assert blas.describe(model) == "none"
    for layer in layers[:2]:  # layer 0's QKV and O
        layer.blas_by_rows[8] = "cublaslt"
    assert blas.describe(model) == "64x64@8, 128x64@8"  # O [64, 64]; QKV [(4 + 2 * 2) * 16, 64]


def test_a_table_off_cuda_changes_nothing() -> None:
    layer = _layer(8, 4)
    x = torch.randn(3, 4)
    want = project(x, layer.weight)
    layer.blas_by_rows[3] = "cublaslt"  # a CPU build of torch would refuse to prefer it
    assert torch.equal(layer(x), want)
    assert torch.equal(project(x, layer.weight, None, blas_by_rows={3: "cublaslt"}), want)


def test_preferred_library_is_restored_after_an_error() -> None:
    before = torch.backends.cuda.preferred_blas_library()
    with pytest.raises(RuntimeError, match="boom"):
        with blas.preferred_library("cublas"):
            raise RuntimeError("boom")
    assert torch.backends.cuda.preferred_blas_library() == before


def test_tune_gemms_needs_cuda_graphs() -> None:
    info = DistributedInfo(0, 1)
    with pytest.raises(ValueError, match="tune_gemms .* device 'cpu'"):
        EngineConfig("m", info, device="cpu", tune_gemms=True)
    with pytest.raises(ValueError, match="cuda_graph_max_bs 0"):
        EngineConfig("m", info, device="cuda", cuda_graph_max_bs=0, tune_gemms=True)
    with pytest.raises(ValueError, match="attention backend 'torch'"):  # no graphs with torch
        EngineConfig("m", info, device="cuda", attention_backend="torch", tune_gemms=True)
    assert EngineConfig("m", info, device="cuda", tune_gemms=True).tune_gemms


def test_serve_flag() -> None:
    assert parse_args([]).engine.tune_gemms is False
    assert parse_args(["--tune-gemms"]).engine.tune_gemms is True
    with pytest.raises(ValueError, match="tune_gemms"):  # a known device: at parse time
        parse_args(["--tune-gemms", "--device", "cpu"])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, blas.CPU_SPLIT_MAX_ROWS + 1])
def test_cpu_products_split_over_threads_give_f_linear(rows: int, bias: bool,
                                                       threads: int) -> None:
    """On CPU up to CPU_SPLIT_MAX_ROWS rows run as one batched GEMM, a slice of the weight's
    rows per torch thread (48 rows: 3 threads split them; 2 too): the product is F.linear's
    (to float rounding; most row counts to the bit), in x's leading shape, written into `out`
    where given, for a weight whose rows the threads cannot share (47) and one that is not
    contiguous as well."""
    g = torch.Generator().manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for w in (torch.randn(48, 24, generator=g), torch.randn(47, 24, generator=g),
                  torch.randn(24, 96, generator=g).t()[:48]):
            b = torch.randn(w.shape[0], generator=g) if bias else None
            x = torch.randn(1, rows, 24, generator=g)
            want = torch.nn.functional.linear(x, w, b)
            got = blas.linear(x, w, b, None)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            out = torch.full_like(want, float("nan"))
            assert blas.linear(x, w, b, None, out=out) is out
            assert torch.equal(out, got)
        half = (x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16())
        assert torch.equal(blas.linear(*half, None), torch.nn.functional.linear(*half))
    finally:
        torch.set_num_threads(before)
