"""Packed integer weights (AWQ, GPTQ, compressed-tensors W4A16 / W8A16 kept packed on the GPU:
layers/packed.py, kernels/int_mm.py, models/int_plan.py).

The kernel equals the dequantized product through Triton's interpreter (4 and 8 bits, groups in
order and permuted, inputs not a whole number of words or tiles). Every projection of a tiny
Llama in each format, packed as each rank of tp=2 packs its share, gives the product of the
dense layer the CPU dequantizes from the same checkpoint; so do a tiny Qwen3-MoE's packed
experts through the fused grouped GEMMs. The plan keeps fused layers whose
act-order permutations differ dense. On a GPU: Hugging Face's greedy tokens in float32, and the
weights' memory a quarter of the 16-bit model's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

from hf_reference import hf_greedy, mixed_prompts  # noqa: E402
from test_int_weights import _write  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.distributed import Communicator, DistributedInfo, Shard  # noqa: E402
from minisgl.layers import packed  # noqa: E402
from minisgl.layers.fp8 import Fp8Spec  # noqa: E402
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from minisgl.layers.weight_format import WeightFormat  # noqa: E402
from minisgl.models import ModelConfig, model_class  # noqa: E402
from minisgl.models.int_plan import int_plan  # noqa: E402
from minisgl.models.int_weights import dense_int_weights  # noqa: E402
from minisgl.models.weights import init_dummy, iter_checkpoint  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# (block_m, block_k, split_k, swap): the tensor-core path (also with its operands swapped) and
# the one-row path (block_m 1), each whole and with K split over programs (partials summed by
# the second kernel)
_TILES = [(16, 32, 1, False), (16, 32, 3, False), (16, 32, 2, True), (1, 32, 1, False),
          (1, 16, 4, False)]


@pytest.mark.parametrize("tiles", _TILES, ids=lambda t: "m{}k{}s{}{}".format(*t[:3],
                                                                            "t" * t[3]))
@pytest.mark.parametrize("bits,k,groups,act_order", [(4, 100, 7, True), (8, 64, 4, False),
                                                     (4, 37, 1, False), (4, 128, 4, False)])
def test_int_mm_equals_the_dequantized_product(bits: int, k: int, groups: int,
                                               act_order: bool,
                                               tiles: Tuple[int, int, int, bool]) -> None:
    """K not a whole number of words (37 = 4.6 words of 8) nor of tiles; a bias; groups in
    runs (told to the kernel by group_run: one row of scales a tile where a run holds whole
    tiles) and permuted (read per input)."""
    from minisgl.kernels.int_mm import IntTiles, int_mm
    g = torch.Generator().manual_seed(bits + k)
    n, m = 40, 5
    values = torch.randint(0, 1 << bits, (k, n), generator=g)
    group = torch.arange(k) * groups // k
    if act_order:
        group = group[torch.randperm(k, generator=g)]
    scales = torch.rand(groups, n, generator=g) * 0.02
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).half()
    weight = ((values.float() - zeros.float()[group]) * scales[group]).t()
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    args = [t.to(DEV) for t in (x, packed.pack(values, bits), scales, zeros,
                                group.to(torch.int32))]
    block_m, block_k, split, swap = tiles
    out = int_mm(*args, bits, bias.to(DEV), IntTiles(block_m, 16, block_k, 4, 2, split, swap),
                 group_size=packed.group_run(group))
    torch.testing.assert_close(out.cpu(), x @ weight.t() + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bits,k,split", [(4, 512, 4), (8, 192, 3), (4, 96, 1)])
def test_int_mm_sums_its_splits_in_its_last_program(bits: int, k: int, split: int,
                                                    rows: int) -> None:
    """Groups in order (one row: the one-row kernel, values read as 1 + q / 2^bits, zero
    points out of the loop; five: the tensor-core tiles), K split: with `arrivals` the last
    program of each output tile sums the partials, in split order, so the result has the
    bits of the two-launch sum; the
    counters are zeros again after (twice, as a CUDA graph replays it); a bias; columns not
    a whole number of blocks; too few counters: the two-launch sum; the wrong dtype refused."""
    from minisgl.kernels.int_mm import IntTiles, arrival_slots, int_mm
    g = torch.Generator().manual_seed(k)
    n, groups = 72, k // 32
    values = torch.randint(0, 1 << bits, (k, n), generator=g)
    group = torch.arange(k) // 32
    scales = torch.rand(groups, n, generator=g) * 0.02
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).half()
    weight = (values.float() - zeros.float()[group]) * scales[group]
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    args = [t.to(DEV) for t in (x, packed.pack(values, bits), scales, zeros,
                                group.to(torch.int32))]
    tiles = IntTiles(1 if rows == 1 else 16, 16, 32, 1 if rows == 1 else 4, 2, split)
    arrivals = torch.zeros(arrival_slots(n), dtype=torch.int32, device=DEV)
    two_launches = int_mm(*args, bits, bias.to(DEV), tiles, group_size=32)
    for _ in range(2):
        out = int_mm(*args, bits, bias.to(DEV), tiles, group_size=32, arrivals=arrivals)
        assert torch.equal(out, two_launches)
        assert not arrivals.any()
    torch.testing.assert_close(out.cpu(), x @ weight + bias, rtol=1e-5, atol=1e-5)
    # Fewer counters than column blocks: the second launch sums, the counters untouched.
    few = torch.zeros(4, dtype=torch.int32, device=DEV)
    assert torch.equal(int_mm(*args, bits, bias.to(DEV), tiles, group_size=32, arrivals=few),
                       two_launches) and not few.any()
    with pytest.raises(ValueError, match="dense int32 counters"):
        int_mm(*args, bits, None, tiles, group_size=32, arrivals=arrivals.long())


def test_int_mm_sums_splits_in_the_kernel_only_up_to_64_row_tiles() -> None:
    """The last program sums the K splits at one row and tiles of up to 64 rows, given a
    counter for each output tile; 128-row tiles (where it was measured 25-35% slower) and too
    few counters leave the sum to a second launch, as does an unsplit K."""
    from minisgl.kernels.int_mm import IntTiles, sums_in_last_program
    for block_m, want in ((1, True), (16, True), (64, True), (128, False)):
        tiles = IntTiles(block_m, 64, 64, 4, 3, 4)
        assert sums_in_last_program(tiles, 4, 100, 100) is want, block_m
    tiles = IntTiles(64, 64, 64, 4, 3, 4)
    assert not sums_in_last_program(tiles, 4, 99, 100)
    assert not sums_in_last_program(tiles, 1, 100, 100)


@pytest.mark.parametrize("act_order", [False, True])
def test_int_mm_from_dense_rows_is_the_dequantized_product(act_order: bool) -> None:
    """From DENSE_ROWS rows: the weight dequantized into a scratch (groups in runs or
    permuted), then one dense product, with a bias."""
    from minisgl.kernels.int_mm import DENSE_ROWS, dequantized, int_mm
    g = torch.Generator().manual_seed(3)
    k, n, groups, m = 192, 136, 3, DENSE_ROWS + 3
    values = torch.randint(0, 16, (k, n), generator=g)
    group = torch.arange(k) // 64
    if act_order:
        group = group[torch.randperm(k, generator=g)]
    scales = torch.rand(groups, n, generator=g) * 0.02
    zeros = torch.randint(0, 16, (groups, n), generator=g).half()
    weight = (values.float() - zeros.float()[group]) * scales[group]
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    args = [t.to(DEV) for t in (packed.pack(values, 4), scales, zeros, group.to(torch.int32))]
    run = packed.group_run(group)
    assert run == (0 if act_order else 64)
    torch.testing.assert_close(dequantized(torch.float32, *args, 4, run).cpu(), weight)
    out = int_mm(x.to(DEV), *args, 4, bias.to(DEV), group_size=run)
    torch.testing.assert_close(out.cpu(), x @ weight + bias, rtol=1e-5, atol=1e-5)


def test_group_run_finds_groups_in_order() -> None:
    """Runs of a power of two (one group: the next power of two of K); anything else 0."""
    assert packed.group_run(torch.arange(256) // 128) == 128
    assert packed.group_run(torch.zeros(100, dtype=torch.int64)) == 128
    assert packed.group_run(torch.arange(128) * 4 // 128) == 32
    assert packed.group_run(torch.arange(100) * 7 // 100) == 0  # runs of 14 / 15
    assert packed.group_run((torch.arange(256) + 64) // 128) == 0  # a shard inside a group
    assert packed.group_run(torch.arange(256).flip(0) // 128) == 0  # act-order


@pytest.mark.parametrize("m", [1, 70])
def test_int_mm_default_tiles(m: int) -> None:
    """The tiles the GPU runs (int_tiles: the one-row path at one token, K split to fill the
    machine; 128 rows at prefill) over a weight of whole and partial tiles, groups of 64 in
    order."""
    from minisgl.kernels.int_mm import int_mm, int_tiles
    g = torch.Generator().manual_seed(m)
    k, n, groups = 320, 192, 5
    values = torch.randint(0, 16, (k, n), generator=g)
    group = torch.arange(k) // 64
    scales, zeros = torch.rand(groups, n, generator=g) * 0.02, torch.full((groups, n), 8.0)
    x = torch.randn(m, k, generator=g)
    assert int_tiles(m, n, k, 64).block_k == 64
    out = int_mm(*(t.to(DEV) for t in (x, packed.pack(values, 4), scales, zeros.half(),
                                       group.to(torch.int32))), 4, group_size=64)
    weight = (values.float() - 8.0) * scales[group]
    torch.testing.assert_close(out.cpu(), x @ weight, rtol=1e-5, atol=1e-5)


def test_pack_places_each_input_in_its_word() -> None:
    values = torch.arange(16).view(16, 1) % 16
    words = packed.pack(values, 4)
    assert words.shape == (2, 1) and words.dtype == torch.int32
    assert int(words[0, 0]) == 0x76543210
    assert int(words[1, 0]) == (0xFEDCBA98 - (1 << 32))  # the sign bit set: a negative int32


def test_a_weight_format_is_fp8_or_packed_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        WeightFormat(Fp8Spec(), packed.PackedSpec(4, 128))


def _models(path: Path, rank: int, tp: int, expert_parallel: bool = False
            ) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """(packed, dense) models of one rank loaded from the integer checkpoint at `path`."""
    cfg = ModelConfig.from_dir(path)
    info = DistributedInfo(rank, tp)
    assert cfg.int_quant is not None
    plan = int_plan(cfg.int_quant, path)
    out = []
    for ints in (plan, None):
        model = model_class(cfg.architecture)(cfg, info, Communicator(info), ints=ints,
                                              expert_parallel=expert_parallel)
        model.load_weights(dense_int_weights(iter_checkpoint(path, False), cfg.int_quant))
        out.append(model.to(DEV))  # packed layers run the kernel (on a CPU: the interpreter)
    return out[0], out[1]


def _projections(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@pytest.mark.parametrize("family,method,bits,act_order,v2", [
    ("llama", "awq", 4, False, False), ("llama", "gptq", 4, True, False),
    ("llama", "gptq", 8, False, True), ("llama", "ct", 4, True, False),
    ("phi3", "awq", 4, False, False), ("granite", "gptq", 4, False, False)])
def test_packed_projections_equal_the_dequantized_ones(
        tiny_model: Callable[..., Path], tmp_path: Path, family: str, method: str, bits: int,
        act_order: bool, v2: bool) -> None:
    """Each rank of tp=2 packs its share of every projection (QKV's and gate/up's parts side
    by side, o's and down's inputs with the groups they use; Phi-3's checkpoint fuses them,
    and each part's rows come out of the one packed tensor; Granite's residual multiplier
    folds into o's and down's scales): its product equals the dense layer's of the same
    rank."""
    path = tmp_path / "int"
    _write(tiny_model(family), path, tmp_path / "dense", method, bits, act_order, v2,
           shared_order=True)
    g = torch.Generator().manual_seed(0)
    for rank in range(2):
        packed_model, dense_model = _models(path, rank, 2)
        layers = _projections(packed_model)
        assert len(layers) == 4 * 2 and all(m.packed is not None for _, m in layers)
        dense = dict(_projections(dense_model))
        for name, layer in layers:
            assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int32
            assert layer.group_run == (0 if act_order else 16), name  # packed.group_run
            x = torch.randn(3, layer.g_idx.shape[0], generator=g).to(DEV)
            args = (x, False) if isinstance(layer, RowParallelLinear) else (x,)
            torch.testing.assert_close(layer(*args), dense[name](*args), rtol=1e-5,
                                       atol=1e-5, msg=f"{family} {method} {rank} {name}")


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_packed_moe_experts_equal_the_dequantized_ones(
        tiny_model: Callable[..., Path], tmp_path: Path, method: str, act_order: bool) -> None:
    """A tiny Qwen3-MoE whose experts are quantized too: each rank of tp=2 packs its slice of
    every expert (gate/up columns side by side, down's inputs with their groups); the fused
    grouped GEMMs over the packed experts equal the dense experts' torch path, and the
    layer's own torch path (each expert dequantized) does too."""
    from minisgl.kernels import moe
    from minisgl.kernels.types import GemmTiles, MoETiles
    from minisgl.layers.moe import experts_torch, route
    path = tmp_path / "int"
    _write(tiny_model("qwen3_moe"), path, tmp_path / "dense", method, 4, act_order,
           shared_order=True)
    g = torch.Generator().manual_seed(1)
    tiles = MoETiles(16, GemmTiles(16, 32, 4, 2), GemmTiles(32, 16, 4, 2, group_m=2))
    for rank in range(2):
        packed_model, dense_model = _models(path, rank, 2)
        layer, dense = packed_model.model.layers[0].mlp, dense_model.model.layers[0].mlp
        gemms = layer.experts.packed_gemms()
        assert gemms is not None and not hasattr(layer.experts, "w13")
        # groups in order: one row of scales a K tile where the tile fits in a group
        assert [w.group_run for w in gemms] == [0 if act_order else 16] * 2
        x = torch.randn(9, 64, generator=g).to(DEV)
        topk = route(torch.randn(9, 8, generator=g).to(DEV), 2, True)
        want = experts_torch(x, topk, dense.experts.w13, dense.experts.w2)
        for chosen in (tiles, None):  # small tiles, and the GPU's (moe_tiles)
            got = moe.fused_packed_experts(x, moe.routing_of(*topk, 8), *gemms, chosen)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.partial(x), dense.partial(x), rtol=1e-5, atol=1e-5)


def test_packed_experts_split_by_expert_parallelism_sum_to_all(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """With expert parallelism each rank of tp=2 packs 4 of the 8 experts whole; the fused
    grouped GEMMs over a rank's packed experts (owned_topk) and its layer's torch path,
    summed over the ranks, equal the dense experts of all."""
    from minisgl.kernels import moe
    from minisgl.layers.moe import experts_torch, owned_topk, route
    path = tmp_path / "int"
    _write(tiny_model("qwen3_moe"), path, tmp_path / "dense", "gptq", 4, True,
           shared_order=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=g).to(DEV)
    topk = route(torch.randn(9, 8, generator=g).to(DEV), 2, True)
    fused, torch_path = [], []
    for rank in range(2):
        packed_model, dense_model = _models(path, rank, 2, expert_parallel=True)
        layer = packed_model.model.layers[0].mlp
        gemms = layer.experts.packed_gemms()
        assert gemms is not None and gemms[0].qweight.shape[0] == 4
        owned = moe.routing_of(*owned_topk(topk, Shard(4 * rank, 4)), 5, owned=4)
        fused.append(moe.fused_packed_experts(x, owned, *gemms))
        torch_path.append(layer.partial(x))
    dense = _models(path, 0, 1)[1].model.layers[0].mlp
    want = experts_torch(x, topk, dense.experts.w13, dense.experts.w2)
    torch.testing.assert_close(fused[0] + fused[1], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_path[0] + torch_path[1], dense.partial(x), rtol=1e-5,
                               atol=1e-5)


def test_act_order_parts_that_disagree_stay_dense(tiny_model: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    """q, k, v (and gate, up) each with its own permutation cannot share one packed layer's
    groups: the plan leaves them dense; o and down, unfused, stay packed."""
    path = tmp_path / "int"
    _write(tiny_model("llama"), path, tmp_path / "dense", "gptq", 4, act_order=True)
    packed_model, _ = _models(path, 0, 1)
    kinds = {name.rsplit(".", 1)[-1]: m.packed is not None
             for name, m in _projections(packed_model)}
    assert kinds == {"qkv_proj": False, "o_proj": True, "gate_up_proj": False,
                     "down_proj": True}


def test_dummy_packed_weights(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Dummy weights in a packed layout: random integers whose dequantized values spread as
    the dense dummy weights do."""
    path = tmp_path / "int"
    _write(tiny_model("llama"), path, tmp_path / "dense", "awq")
    cfg = ModelConfig.from_dir(path)
    assert cfg.int_quant is not None
    info = DistributedInfo(0, 1)
    model = model_class(cfg.architecture)(cfg, info, Communicator(info),
                                          ints=int_plan(cfg.int_quant, None))
    init_dummy(model, seed=0)
    layer = model.model.layers[0].mlp.down_proj.to(DEV)  # the kernel (on a CPU: interpreted)
    x = torch.eye(layer.g_idx.shape[0], device=DEV)
    w = layer(x, False)  # the dequantized weight, transposed
    assert 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 0.005


@pytest.mark.gpu
@pytest.mark.parametrize("family,method,bits,act_order", [
    ("llama", "awq", 4, False), ("llama", "gptq", 4, True), ("llama", "ct", 8, False),
    ("qwen3_moe", "gptq", 4, True)])
def test_packed_checkpoints_match_hf_on_gpu(tiny_model: Callable[..., Path], tmp_path: Path,
                                            family: str, method: str, bits: int,
                                            act_order: bool) -> None:
    """float32 on CUDA with the packed kernels (experts too) and decode graphs: Hugging
    Face's tokens on the dequantized twin, at tp=1 (and tp=2 where two GPUs are)."""
    quantized, dense = tmp_path / "int", tmp_path / "dense"
    _write(tiny_model(family), quantized, dense, method, bits, act_order, shared_order=True)
    prompts = mixed_prompts(3, seed=12, lengths=(5, 17, 30))
    want = hf_greedy(dense, prompts, 12)
    for tp in (1, 2)[:torch.cuda.device_count()]:
        with LLM(str(quantized), dtype="float32", tp=tp, max_kv_tokens=2048,
                 show_progress=False) as llm:
            got = [o.token_ids for o in llm.generate(prompts, SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True))]
        assert got == want, tp


@pytest.mark.gpu
def test_lora_over_packed_weights_on_gpu_matches_the_cpu(tiny_model: Callable[..., Path],
                                                        tmp_path: Path) -> None:
    """float32: a GPTQ checkpoint kept packed on CUDA serving a LoRA adapter (the deltas added
    to the int_mm products) beside the base model gives the CPU's tokens (there dequantized at
    load: tests/test_lora.py checks those against PEFT)."""
    from tiny_models import write_lora
    quantized, dense = tmp_path / "int", tmp_path / "dense"
    _write(tiny_model("llama"), quantized, dense, "gptq", 4, True, shared_order=True)
    adapter = write_lora(dense, tmp_path / "adapter", 2)
    prompts = mixed_prompts(4, seed=14, lengths=(5, 17))
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             lora_name="x" if i % 2 == 0 else None) for i in range(4)]

    def run(device: str) -> List[List[int]]:
        with LLM(str(quantized), device=device, dtype="float32", max_kv_tokens=2048,
                 lora_modules=f"x={adapter}", show_progress=False) as llm:
            return [o.token_ids for o in llm.generate(prompts, params)]
    assert run("cuda") == run("cpu")


@pytest.mark.gpu
def test_dummy_awq_llama_8b_holds_a_quarter_of_the_bytes() -> None:
    """Llama-3.1-8B's shape with dummy AWQ weights (configs/models/llama-3.1-8b-awq): the
    projections' packed bytes about a quarter of their bf16 bytes (plus scales), and it
    generates."""
    config = Path(__file__).resolve().parent.parent / "configs" / "models" / "llama-3.1-8b-awq"
    with LLM(str(config), load_format="dummy", max_kv_tokens=8192, show_progress=False) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))
        layers = _projections(llm._backend.engine.model)  # type: ignore[attr-defined]
        held = sum(b.numel() * b.element_size() for _, m in layers for b in m.buffers())
        dense = sum(m.qweight.numel() * 8 * 2 for _, m in layers)
    assert len(out[0].token_ids) == 8
    assert 0.25 < held / dense < 0.30, held / dense
