"""FP8 mixture-of-experts models: FP8 experts (routed and shared) from checkpoints in each
format, and quantized online.

On the CPU (weight-only: dequantized at load) a tiny Qwen3-MoE in Hugging Face's block-wise
format (Qwen3-30B-A3B-FP8's), a Qwen2-MoE with its shared expert in compressed-tensors per
channel and a Mixtral (its w1/w2/w3 names) with per-tensor static scales give Hugging Face's
greedy tokens on their dequantized twins, at tp=1 and tp=2. Kept FP8 (the GPU's layout), the
experts hold exactly the checkpoint's slice and scales; the fused W8A8 kernels equal a torch
reference through the Triton interpreter (on a GPU in bfloat16 too).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

from fp8_checkpoints import Fp8Format, Group, Written, cached_writer  # noqa: E402
from hf_reference import hf_greedy, mixed_prompts  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.distributed import Communicator, DistributedInfo  # noqa: E402
from minisgl.kernels.types import FP8, FP8_MAX, ExpertScales  # noqa: E402
from minisgl.layers import fp8  # noqa: E402
from minisgl.layers.experts import Experts, ExpertsShape  # noqa: E402
from minisgl.layers.moe import TopK, experts_torch, route  # noqa: E402
from minisgl.layers.weight_format import WeightFormat  # noqa: E402
from minisgl.models import ModelConfig, model_class  # noqa: E402
from minisgl.models.quantization import QuantPlan, quant_plan  # noqa: E402
from minisgl.models.weights import init_dummy, iter_checkpoint  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# 128 x 128 blocks: every expert's gate/up rows and down columns whole blocks at tp=2
BLOCK_MOE = dict(hidden_size=256, moe_intermediate_size=256, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, intermediate_size=512)

CASES: Dict[str, Tuple[str, dict, Fp8Format]] = {
    # Qwen3-30B-A3B-FP8's layout: Hugging Face's fp8, 128 x 128 blocks, every projection
    "qwen3_moe-block": ("qwen3_moe", BLOCK_MOE, Fp8Format(
        "fp8", (Group("Linear", "block", False),), (), ("lm_head",))),
    # compressed-tensors per channel with dynamic activations, the shared expert too; layer
    # 0's attention left dense by a regular expression
    "qwen2_moe-channel": ("qwen2_moe", {}, Fp8Format(
        "compressed-tensors", (Group("Linear", "channel", False),),
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
         "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj"),
        ("lm_head", r"re:.*layers\.0\.self_attn\..*"))),
    # the same with experts of 128 features: tp=2 would cut each block (expert parallelism)
    "qwen3_moe-block-ep": ("qwen3_moe", {**BLOCK_MOE, "moe_intermediate_size": 128}, Fp8Format(
        "fp8", (Group("Linear", "block", False),), (), ("lm_head",))),
    # AutoFP8's per-tensor static scales on Mixtral's own expert names
    "mixtral-tensor-static": ("mixtral", {}, Fp8Format(
        "fp8", (Group("Linear", "tensor", True),), (), ())),
}


@pytest.fixture(scope="module")
def written(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Callable[[str], Written]:
    def source(name: str) -> Tuple[Path, Fp8Format]:
        family, shape, fmt = CASES[name]
        return tiny_model(family, **shape), fmt

    return cached_writer(source, tmp_path_factory.mktemp)


def _generate(path: Path, tp: int, prompts: List[List[int]], expert_parallel: bool = False
              ) -> List[List[int]]:
    with LLM(str(path), tp=tp, page_size=4, max_kv_tokens=1024, show_progress=False,
             check_lockstep=tp > 1, device="cpu", dtype="float32",
             enable_expert_parallel=expert_parallel) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("name,tps", [("qwen3_moe-block", (2,)), ("qwen2_moe-channel", (2,)),
                                      ("mixtral-tensor-static", (1,)),
                                      ("qwen3_moe-block-ep", (2,))])
def test_fp8_moe_checkpoints_match_hf_on_their_dequantized_weights(
        written: Callable[[str], Written], name: str, tps: Tuple[int, ...]) -> None:
    """Experts' FP8 weights and scales (per block, channel, tensor) sliced per rank and
    dequantized (or, "-ep", whole experts per rank: blocks tp=2 would cut, expert
    parallelism keeps whole): HF's greedy tokens on the dequantized twin."""
    ckpt = written(name)
    prompts = mixed_prompts(3, seed=11, lengths=(2, 9, 33))
    ref = hf_greedy(ckpt.dequantized, prompts, GREEDY.max_tokens)
    for tp in tps:
        assert _generate(ckpt.fp8, tp, prompts, name.endswith("-ep")) == ref, tp


def _kept_fp8(cfg: ModelConfig, quantization: Optional[str] = None) -> QuantPlan:
    """The GPU's plan on the CPU: layers stay FP8 after loading (not weight-only)."""
    plan = quant_plan(cfg.quantization, quantization, torch.device("cpu"), torch.float32)
    assert plan is not None
    return dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime,
                                                                 weight_only=False))


def _load(path: Path, rank: int, tp: int, plan: QuantPlan) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(path)
    info = DistributedInfo(rank, tp)
    model = model_class(cfg.architecture)(cfg, info, Communicator(info), quant=plan)
    model.load_weights(iter_checkpoint(path, False))
    return model


def _ckpt(path: Path) -> Dict[str, torch.Tensor]:
    return {n: s.read() for n, s in iter_checkpoint(path, False)}


@pytest.mark.parametrize("name", ["qwen3_moe-block", "mixtral-tensor-static"])
def test_fp8_experts_hold_the_checkpoints_slices_and_scales(
        written: Callable[[str], Written], name: str) -> None:
    """Kept FP8 at tp=2: rank r's w13 holds rows [r I/2, (r+1) I/2) of each expert's gate and
    up FP8 tensors and w2 those columns of down, bit for bit; block scales their block rows
    (columns for down), per-tensor scales written to every row of their tensor; the static
    activation scales the largest over the experts."""
    ckpt = written(name)
    full = _ckpt(ckpt.fp8)
    cfg = ModelConfig.from_dir(ckpt.fp8)
    half = cfg.moe_intermediate_size // 2
    mixtral = name.startswith("mixtral")
    names = ("block_sparse_moe", "w1", "w3", "w2") if mixtral else ("mlp", "gate_proj",
                                                                     "up_proj", "down_proj")
    scale_name = "weight_scale" if mixtral else "weight_scale_inv"
    for rank in range(2):
        model = _load(ckpt.fp8, rank, 2, _kept_fp8(cfg))
        experts = model.model.layers[0].mlp.experts
        assert experts.fp8 is not None and experts.w13.dtype == FP8 == experts.w2.dtype
        rows = slice(rank * half, (rank + 1) * half)
        for e in (0, cfg.num_experts - 1):
            pre = f"model.layers.0.{names[0]}.experts.{e}."
            gate, up, down = (pre + p for p in names[1:])
            got13 = experts.w13[e].view(torch.uint8)
            want13 = torch.cat([full[gate + ".weight"][rows], full[up + ".weight"][rows]])
            assert torch.equal(got13, want13.view(torch.uint8))
            assert torch.equal(experts.w2[e].view(torch.uint8),
                               full[down + ".weight"][:, rows].contiguous().view(torch.uint8))
            s13, s2 = experts.w13_weight_scale[e], experts.w2_weight_scale[e]
            if mixtral:  # per tensor: one value on every row
                assert torch.all(s13[0] == full[gate + ".weight_scale"].item())
                assert torch.all(s13[1] == full[up + ".weight_scale"].item())
                assert torch.all(s2 == full[down + ".weight_scale"].item())
            else:  # 128 x 128 blocks: this rank's block rows of gate/up, block columns of down
                b = slice(rank * half // 128, (rank + 1) * half // 128)
                assert torch.equal(s13[0], full[gate + f".{scale_name}"][b])
                assert torch.equal(s13[1], full[up + f".{scale_name}"][b])
                assert torch.equal(s2, full[down + f".{scale_name}"][:, b])
        if mixtral:
            ins = [full[f"model.layers.0.block_sparse_moe.experts.{e}.{p}.input_scale"].item()
                   for e in range(cfg.num_experts) for p in ("w1", "w3")]
            assert experts.w13_input_scale.item() == pytest.approx(max(ins))


def test_online_fp8_quantizes_each_ranks_expert_slices(tiny_model: Callable[..., Path]) -> None:
    """`quantization="fp8"` of a dense MoE checkpoint: every expert's slice quantized per row
    on the rank that holds it (down's rows over the rank's columns), the shared expert's
    projections too; weight-only on the CPU, each ends up an FP8 grid times its row scale."""
    path = tiny_model("qwen2_moe")
    cfg = ModelConfig.from_dir(path)
    full = _ckpt(path)
    half = cfg.moe_intermediate_size // 2
    for rank in range(2):
        kept = _load(path, rank, 2, _kept_fp8(cfg, "fp8"))
        moe = kept.model.layers[1].mlp  # decoder_sparse_step 2: layers 1 and 3 are sparse
        assert moe.experts.w13.dtype == FP8 and moe.shared_expert.gate_up_proj.fp8 is not None
        plan = quant_plan(None, "fp8", torch.device("cpu"), torch.float32)
        assert plan is not None
        dense = _load(path, rank, 2, plan).model.layers[1].mlp.experts
        assert dense.fp8 is None and dense.w13.dtype == torch.float32
        e = 3
        pre = f"model.layers.1.mlp.experts.{e}."
        down = full[pre + "down_proj.weight"][:, rank * half:(rank + 1) * half]
        q, scale = fp8.quantize_rows(down)
        assert torch.equal(moe.experts.w2[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(moe.experts.w2_weight_scale[e], scale)
        assert torch.equal(dense.w2[e], q.float() * scale[:, None])
        up = full[pre + "up_proj.weight"][rank * half:(rank + 1) * half]
        q, scale = fp8.quantize_rows(up)
        assert torch.equal(dense.w13[e, half:], q.float() * scale[:, None])


def _shape(cfg: ModelConfig) -> ExpertsShape:
    return ExpertsShape(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def test_dummy_fp8_experts(tiny_model: Callable[..., Path]) -> None:
    """Dummy weights in an FP8 MoE layout: random FP8 experts with their scales, kept (the GPU
    benchmark's) or dequantized (weight-only)."""
    cfg = ModelConfig.from_dir(tiny_model("qwen3_moe", **BLOCK_MOE))
    block = fp8.Fp8Spec(block=(128, 128), dtype=torch.float32)
    info = DistributedInfo(0, 1)
    for weight_only in (False, True):
        experts = Experts(_shape(cfg), info,
                          WeightFormat(dataclasses.replace(block, weight_only=weight_only)))
        holder = torch.nn.ModuleDict({"experts": experts})
        init_dummy(holder, seed=0)
        w13 = experts.dense(0)[0] if not weight_only else experts.w13[0]
        assert w13.dtype == torch.float32 and 0.01 < float(w13.std()) < 0.03
        assert (experts.fp8 is None) == weight_only


def test_fp8_expert_blocks_cut_by_tp_are_refused(tiny_model: Callable[..., Path]) -> None:
    cfg = ModelConfig.from_dir(tiny_model("qwen3_moe", **{**BLOCK_MOE,
                                                          "moe_intermediate_size": 384}))
    block = WeightFormat(fp8.Fp8Spec(block=(128, 128)))
    Experts(_shape(cfg), DistributedInfo(0, 3), block)  # 128 each: whole blocks
    with pytest.raises(ValueError, match=r"rows \[192, 384\) of 384 at tp=2.*128-row.*"
                                         r"--enable-expert-parallel"):
        Experts(_shape(cfg), DistributedInfo(1, 2), block)
    held = Experts(_shape(cfg), DistributedInfo(1, 2), block, expert_parallel=True)
    assert held.w13.shape == (4, 2 * 384, 256) and held.w13_weight_scale.shape == (4, 2, 3, 2)


# --- the fused W8A8 kernels ---------------------------------------------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# FP8 tensor-core products accumulate in fewer bits than float32 on the GPU (Hopper's FP8 MMA:
# about 2e-4 off a float32 reference); the interpreter multiplies exactly
FP8_TOL = 1e-5 if DEV == "cpu" else 1e-3


def _quantized(x: torch.Tensor, group: Optional[int], static: Optional[torch.Tensor]
               ) -> torch.Tensor:
    """x as the kernels quantize it (per row, per 1 x group, or by the static scale),
    dequantized, float32."""
    x = x.float()
    if static is not None:
        return (x / static).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * static
    k = x.shape[1]
    g = group or k
    out = torch.empty_like(x)
    for start in range(0, k, g):
        part = x[:, start:start + g]
        s = part.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        out[:, start:start + g] = (part / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
    return out


def _reference(x: torch.Tensor, topk: TopK, experts: Experts, scales: ExpertScales
               ) -> torch.Tensor:
    """W8A8 in float32 by torch: each GEMM's input quantized as the kernels quantize it, times
    the dequantized weights, in float64 (so that no rounding of the reference moves the
    intermediate activations' FP8 values)."""
    group = scales.block[1] if scales.block else None
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xq = _quantized(x, group, scales.w13_input).double()
    for t in range(x.shape[0]):
        for j in range(topk.ids.shape[1]):
            w13, w2 = (w.double() for w in experts.dense(int(topk.ids[t, j])))
            gate, up = (xq[t:t + 1] @ w13.T).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            act = _quantized(act.float(), group, scales.w2_input).double()
            out[t] += float(topk.weights[t, j]) * (act @ w2.T)[0]
    return out.float()


def _fp8_experts(experts: int, hidden: int, inter: int, spec: fp8.Fp8Spec,
                 seed: int) -> Experts:
    layer = Experts(ExpertsShape(experts, hidden, inter), DistributedInfo(0, 1),
                    WeightFormat(spec))
    gen = torch.Generator(device=DEV).manual_seed(seed)
    layer.to(DEV)
    layer.fill_quantized_random(gen, 0.1)  # static input scales: values up to 8
    return layer


@pytest.mark.parametrize("spec", [
    fp8.Fp8Spec(dtype=torch.float32),
    fp8.Fp8Spec(static_input=True, dtype=torch.float32),
    fp8.Fp8Spec(block=(32, 32), dtype=torch.float32)], ids=["rowwise", "static", "block"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [(1, 64, 32, 8, 2),
                                                               (9, 80, 48, 6, 3)])
def test_fused_fp8_experts_match_torch(spec: fp8.Fp8Spec, tokens: int, hidden: int,
                                       inter: int, experts: int, top_k: int) -> None:
    """K and N not multiples of the tiles or the blocks (80 = 2.5 blocks of 32, 48 = 1.5),
    most experts idle in the small case; scales per row (the gate's and up's own), per block,
    static per tensor."""
    from minisgl.kernels import moe
    from minisgl.kernels.types import GemmTiles, MoETiles
    layer = _fp8_experts(experts, hidden, inter, spec, seed=tokens)
    scales = layer.scales()
    assert scales is not None
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g, device=DEV)
    topk = route(torch.randn(tokens, experts, generator=g, device=DEV), top_k, True)
    tiles = MoETiles(16, GemmTiles(16, 32, 4, 2), GemmTiles(32, 16, 4, 2, group_m=2))
    got = moe.fused_experts(x, moe.routing_of(*topk, experts), layer.w13, layer.w2, tiles,
                            scales)
    want = _reference(x, topk, layer, scales)
    err = float((got - want).norm() / want.norm())
    assert err < FP8_TOL, err
    dense13 = torch.stack([layer.dense(e)[0] for e in range(experts)])
    dense2 = torch.stack([layer.dense(e)[1] for e in range(experts)])
    unquantized = experts_torch(x, topk, dense13, dense2)  # W8A16: the inputs' rounding only
    assert float((got - unquantized).norm() / unquantized.norm()) < 0.1


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fused_fp8_experts_default_tiles(block: Optional[Tuple[int, int]]) -> None:
    """The tiles the GPU runs (moe_tiles; with blocks the K tile is the block's width) over
    experts of whole and partial blocks (320 = 2.5 blocks of 128)."""
    from minisgl.kernels import moe
    layer = _fp8_experts(4, 320, 128, fp8.Fp8Spec(block=block, dtype=torch.float32), seed=2)
    scales = layer.scales()
    assert scales is not None
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(5, 320, generator=g, device=DEV)
    topk = route(torch.randn(5, 4, generator=g, device=DEV), 2, True)
    got = moe.fused_experts(x, moe.routing_of(*topk, 4), layer.w13, layer.w2, scales=scales)
    want = _reference(x, topk, layer, scales)
    assert float((got - want).norm() / want.norm()) < FP8_TOL


def test_grouped_gemm_refuses_mismatched_fp8_operands() -> None:
    from minisgl.kernels import moe
    layer = _fp8_experts(4, 32, 16, fp8.Fp8Spec(dtype=torch.float32), seed=0)
    topk = route(torch.randn(2, 4, device=DEV), 2, True)
    routing = moe.routing_of(*topk, 4)
    bad = ExpertScales(layer.w13_weight_scale[:, :, :8].contiguous(), layer.w2_weight_scale)
    with pytest.raises(ValueError, match=r"want dense scales \(4, 2, 16\), got \(4, 2, 8\)"):
        moe.fused_experts(torch.randn(2, 32, device=DEV), routing, layer.w13, layer.w2,
                          scales=bad)
    with pytest.raises(ValueError, match="FP8 weights .* or neither"):
        moe.fused_experts(torch.randn(2, 32, device=DEV), routing, layer.w13, layer.w2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_fp8_moe_on_gpu(block: Optional[Tuple[int, int]], tokens: int) -> None:
    """A Qwen3-30B-A3B layer (128 experts, top 8, 2048 x 768) in FP8, bfloat16 activations:
    the fused W8A8 path against the dequantized weights (W8A16 by torch) within the inputs'
    FP8 rounding, the same bits twice and inside a CUDA graph."""
    from minisgl.kernels import moe
    spec = fp8.Fp8Spec(block=block, dtype=torch.bfloat16)
    layer = _fp8_experts(128, 2048, 768, spec, seed=0)
    scales = layer.scales()
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(tokens, 2048, generator=g, device=DEV).bfloat16()
    logits = torch.randn(tokens, 128, generator=g, device=DEV).bfloat16()
    topk = route(logits, 8, True)
    want = experts_torch(x, topk, *(torch.stack(w) for w in zip(
        *(layer.dense(e) for e in range(128)))))
    got = moe.fused_moe(x, logits, layer.w13, layer.w2, 8, True, scales=scales)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 0.06, err
    assert torch.equal(got, moe.fused_moe(x, logits, layer.w13, layer.w2, 8, True,
                                          scales=scales))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.fused_moe(x, logits, layer.w13, layer.w2, 8, True, scales=scales)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@pytest.mark.parametrize("config,quantization", [("qwen3-30b-a3b", "fp8"),
                                                 ("qwen3-30b-a3b-fp8", None)])
def test_dummy_qwen3_30b_a3b_fp8_runs(config: str, quantization: Optional[str]) -> None:
    """The FP8 benchmark shape on one GPU: dummy FP8 experts quantized per row (online) or in
    128 x 128 blocks (the official Qwen3-30B-A3B-FP8 layout), fused kernels, decode graphs."""
    path = Path(__file__).resolve().parent.parent / "configs" / "models" / config
    with LLM(str(path), load_format="dummy", max_kv_tokens=8192, show_progress=False,
             quantization=quantization) as llm:
        outs = llm.generate([[1, 2, 3], list(range(10, 300))],
                            SamplingParams(max_tokens=8, ignore_eos=True))
        engine = llm._backend.engine  # type: ignore[attr-defined]
        assert engine.model.model.layers[0].mlp.experts.w13.dtype == FP8
    assert [len(o.token_ids) for o in outs] == [8, 8]
