"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) and the
fused MoE kernels.

Greedy tokens of random tiny MoE models equal Hugging Face transformers' (float32, CPU) under
chunked prefill, page sizes 1 and 16 and both prefix caches, and tp=2 equals tp=1. The fused
Triton kernels (routing, the sort by expert, the grouped GEMMs) equal the torch path through
the Triton interpreter on CPU, and on a GPU in bfloat16 and float32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

from hf_reference import hf_greedy, mixed_prompts  # noqa: E402
from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.distributed import Communicator, DistributedInfo, Shard  # noqa: E402
from minisgl.layers.experts import expert_param  # noqa: E402
from minisgl.layers.moe import experts_torch, owned_topk, route  # noqa: E402
from minisgl.models import ModelConfig, model_class  # noqa: E402
from minisgl.models.weights import iter_checkpoint  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# (family, overrides): a dense layer among sparse ones in every Qwen model (mlp_only_layers,
# decoder_sparse_step), top-k weights renormalized or not, a shared expert (Qwen2-MoE).
MODELS = {"qwen3_moe": ("qwen3_moe", {}),
          "qwen3_moe_raw_topk": ("qwen3_moe", {"norm_topk_prob": False}),
          "qwen2_moe": ("qwen2_moe", {}),
          "mixtral": ("mixtral", {}),
          # GLM-4.5: sigmoid routing with a score correction, over groups; an ungated shared
          # expert; a dense first layer
          "glm4_moe": ("glm4_moe", {}),
          # dots.llm1: the same routing under Qwen3's attention, weights not renormalized
          "dots1": ("dots1", {})}


def _prompts() -> List[List[int]]:
    """8 prompts of mixed lengths, the last sharing the second's first 40 tokens (the radix
    cache may reuse them)."""
    prompts = mixed_prompts(7, seed=21, lengths=(2, 9, 40, 75))
    return prompts + [prompts[2][:40] + [11, 12, 13]]


@pytest.fixture(scope="module")
def moe_model(tiny_model: Callable[..., Path]) -> Callable[[str], Path]:
    return lambda name: tiny_model(MODELS[name][0], **MODELS[name][1])


@pytest.fixture(scope="module")
def reference(moe_model: Callable[[str], Path]) -> Callable[[str], List[List[int]]]:
    cache: Dict[str, List[List[int]]] = {}

    def tokens(name: str) -> List[List[int]]:
        if name not in cache:
            cache[name] = hf_greedy(moe_model(name), _prompts(), GREEDY.max_tokens)
        return cache[name]
    return tokens


def _generate(path: Path, **settings: object) -> List[List[int]]:
    """Greedy tokens of the prompts, on the CPU in float32 (the exact comparison with Hugging
    Face) unless `settings` name a device and dtype."""
    settings = {"device": "cpu", "dtype": "float32", **settings}
    with LLM(str(path), max_kv_tokens=4096, show_progress=False, **settings) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("page_size,chunk,cache", [(1, 16, "radix"), (16, 40, "naive")])
def test_moe_models_match_hf(moe_model: Callable[[str], Path],
                             reference: Callable[[str], List[List[int]]], name: str,
                             page_size: int, chunk: int, cache: str) -> None:
    got = _generate(moe_model(name), page_size=page_size, max_prefill_tokens=chunk,
                    cache=cache)
    assert got == reference(name)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_moe_tp2_equals_tp1(moe_model: Callable[[str], Path],
                            reference: Callable[[str], List[List[int]]], name: str) -> None:
    """Each rank holds half of every expert's (and the shared expert's) intermediate features;
    one all-reduce per MoE layer completes the sum."""
    got = _generate(moe_model(name), tp=2, page_size=16, max_prefill_tokens=40,
                    check_lockstep=True)
    assert got == reference(name)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "glm4_moe"])
def test_expert_parallel_tp2_matches_hf(moe_model: Callable[[str], Path],
                                        reference: Callable[[str], List[List[int]]],
                                        name: str) -> None:
    """enable_expert_parallel at tp=2: each rank holds 4 of the 8 experts whole and runs the
    tokens routed to them (attention and the shared expert still split by tensor
    parallelism), one all-reduce per layer sums the ranks' experts: HF's tokens."""
    got = _generate(moe_model(name), tp=2, page_size=16, max_prefill_tokens=40,
                    check_lockstep=True, enable_expert_parallel=True)
    assert got == reference(name)


def test_expert_parallel_loads_whole_experts_of_this_rank(
        moe_model: Callable[[str], Path], tiny_model: Callable[..., Path]) -> None:
    """Rank r of 2 holds experts [4r, 4r + 4) whole (the others are never read); a model whose
    experts tp does not divide is refused, naming the numbers, and a width tp does not divide
    needs no split."""
    path = moe_model("qwen3_moe")
    cfg = ModelConfig.from_dir(path)
    full = {n: s.read() for n, s in iter_checkpoint(path, False)}
    for rank in range(2):
        info = DistributedInfo(rank, 2)
        model = model_class(cfg.architecture)(cfg, info, Communicator(info),
                                              expert_parallel=True)
        model.load_weights(iter_checkpoint(path, False))
        experts = model.model.layers[0].mlp.experts  # type: ignore[union-attr]
        assert experts.w13.shape[0] == 4 and experts.owned.start == 4 * rank
        for local in range(4):
            pre = f"model.layers.0.mlp.experts.{4 * rank + local}."
            assert torch.equal(experts.w13[local], torch.cat(
                [full[pre + "gate_proj.weight"], full[pre + "up_proj.weight"]]))
            assert torch.equal(experts.w2[local], full[pre + "down_proj.weight"])
    six = ModelConfig.from_dir(tiny_model("qwen3_moe", num_experts=6))
    with pytest.raises(ValueError, match="1/4 of 6 routed experts .* tp must divide"):
        six.check_tp(4, expert_parallel=True)
    odd = ModelConfig.from_dir(tiny_model("qwen3_moe", moe_intermediate_size=30))
    with pytest.raises(ValueError, match="moe_intermediate_size 30 over tp=4"):
        odd.check_tp(4)
    odd.check_tp(4, expert_parallel=True)


def test_experts_load_only_this_ranks_slice(moe_model: Callable[[str], Path]) -> None:
    """At tp=2 rank r's w13 holds rows [r*I/2, (r+1)*I/2) of every expert's gate and up
    projections, its w2 those columns of the down projection, read as slices."""
    path = moe_model("qwen3_moe")
    cfg = ModelConfig.from_dir(path)
    full = {n: s.read() for n, s in iter_checkpoint(path, False)}
    half = cfg.moe_intermediate_size // 2
    for rank in range(2):
        info = DistributedInfo(rank, 2)
        model = model_class(cfg.architecture)(cfg, info, Communicator(info))
        model.load_weights(iter_checkpoint(path, False))
        experts = model.model.layers[0].mlp.experts  # type: ignore[union-attr]
        rows = slice(rank * half, (rank + 1) * half)
        for e in (0, cfg.num_experts - 1):
            pre = f"model.layers.0.mlp.experts.{e}."
            gate, up = full[pre + "gate_proj.weight"], full[pre + "up_proj.weight"]
            assert torch.equal(experts.w13[e], torch.cat([gate[rows], up[rows]]))
            assert torch.equal(experts.w2[e], full[pre + "down_proj.weight"][:, rows])
        assert type(model.model.layers[1].mlp).__name__ == "MLP"  # mlp_only_layers [1]


def test_config_reads_both_families_names(tmp_path: Path) -> None:
    qwen = ModelConfig.from_dir(CONFIGS / "qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size,
            qwen.norm_topk_prob) == (128, 8, 768, True)
    assert all(qwen.is_sparse(i) for i in range(qwen.num_layers))
    mixtral = ModelConfig.from_dir(CONFIGS / "mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob) == (8, 2, 14336, True)  # Mixtral always renormalizes
    base = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
    other = {k: v for k, v in base.items() if k != "num_experts"}
    cfg = ModelConfig.from_dict({**other, "num_local_experts": 16, "decoder_sparse_step": 2,
                                 "mlp_only_layers": [3], "norm_topk_prob": False})
    assert cfg.num_experts == 16 and not cfg.norm_topk_prob
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    dense = ModelConfig.from_dir(CONFIGS / "qwen3-8b")
    assert dense.num_experts == 0 and not dense.is_sparse(0)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 129})


def test_expert_checkpoint_names() -> None:
    def target(name: str) -> object:
        *path, param = name.split(".")
        return expert_param(path, param)
    assert target("model.layers.3.mlp.experts.7.gate_proj.weight") == (
        "model.layers.3.mlp.experts", "w13", 14)
    assert target("model.layers.3.mlp.experts.7.up_proj.weight") == (
        "model.layers.3.mlp.experts", "w13", 15)
    assert target("model.layers.3.mlp.experts.7.down_proj.weight") == (
        "model.layers.3.mlp.experts", "w2", 7)
    assert target("model.layers.3.mlp.experts.7.up_proj.weight_scale") == (
        "model.layers.3.mlp.experts", "w13_weight_scale", 15)
    assert target("model.layers.3.mlp.experts.7.down_proj.input_scale") == (
        "model.layers.3.mlp.experts", "w2_input_scale", 7)
    assert target("model.layers.3.mlp.experts.7.down_proj.bias") is None
    assert target("model.layers.3.mlp.gate_proj.weight") is None
    assert target("model.layers.3.mlp.shared_expert.gate_proj.weight") is None


@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "mixtral-8x7b",
                                    "glm-4.5-air"])
def test_benchmark_configs_build_scaled_down(tmp_path: Path, config: str) -> None:
    """The benchmark shapes build and generate with dummy weights (scaled down: on CPU; the
    FP8 one's 128 x 128 block experts weight-only; its q, k and v whole blocks)."""
    cfg = json.loads((CONFIGS / config / "config.json").read_text())
    cfg.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, intermediate_size=64,
               moe_intermediate_size=32)
    if "quantization_config" in cfg:
        cfg.update(num_key_value_heads=4, head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with LLM(str(tmp_path), load_format="dummy", max_kv_tokens=512, show_progress=False) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


# --- the fused kernels against the torch path --------------------------------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype,
           seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    make = lambda *shape, s=1.0: (  # noqa: E731
        torch.randn(*shape, generator=g, device=DEV) * s).to(dtype)
    return {"x": make(tokens, hidden), "w13": make(experts, 2 * inter, hidden, s=0.1),
            "w2": make(experts, hidden, inter, s=0.1), "logits": make(tokens, experts)}


def _check_aligned(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    from minisgl.kernels import moe
    routing = moe.routing_of(torch.ones(ids.shape), ids, num_experts)
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=num_experts)
    assert torch.equal(routing.counts.cpu().long(), counts)
    aligned = moe.align(routing, block_m)
    pairs = ids.numel()
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(aligned.total)
    assert total == int(padded.sum()) <= aligned.sorted_ids.numel()
    assert aligned.sorted_ids.numel() == moe.padded_capacity(pairs, num_experts, block_m)
    sorted_ids = aligned.sorted_ids.cpu().long()
    assert torch.all(sorted_ids[total:] == pairs)  # beyond the used length: padding only
    flat = ids.flatten().cpu().long()
    start = 0
    for e in range(num_experts):
        run = sorted_ids[start:start + int(padded[e])]
        real = run[run < pairs]
        assert sorted(real.tolist()) == torch.nonzero(flat == e).flatten().tolist(), e
        assert torch.all(run[len(real):] == pairs)  # each run: its pairs, then padding
        blocks = aligned.expert_ids[start // block_m:(start + int(padded[e])) // block_m]
        assert torch.all(blocks.cpu() == e)
        start += int(padded[e])


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [
    (1, 8, 2, 16), (5, 6, 2, 16), (37, 16, 4, 32), (3, 64, 8, 16), (20, 4, 1, 64)])
def test_align_sorts_pairs_by_expert_in_padded_blocks(tokens: int, experts: int, top_k: int,
                                                      block_m: int) -> None:
    """Every expert's pairs in one run padded to whole blocks, experts in order, those that
    received no pair taking no block; everything past the used length is padding."""
    g = torch.Generator().manual_seed(tokens)
    choice = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    _check_aligned(choice.to(DEV, torch.int32), experts, block_m)


def test_align_with_most_experts_idle() -> None:
    ids = torch.tensor([[5, 2], [2, 5], [5, 7]], dtype=torch.int32, device=DEV)
    _check_aligned(ids, 16, 16)


@pytest.mark.parametrize("experts,top_k,renormalize", [(8, 2, True), (60, 4, False),
                                                       (6, 1, True), (128, 8, True)])
def test_route_matches_torch(experts: int, top_k: int, renormalize: bool) -> None:
    from minisgl.kernels import moe
    logits = _layer(9, 4, 4, experts, torch.float32)["logits"]
    got = moe.route(logits, top_k, renormalize)
    want = route(logits, top_k, renormalize)
    assert torch.equal(got.ids.long(), want.ids)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.counts.long().cpu(),
                       torch.bincount(want.ids.flatten().cpu(), minlength=experts))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets NaN
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4)])
def test_route_keeps_nan_rows_in_range(experts: int, top_k: int) -> None:
    """Router logits of NaN or inf (a CUDA graph's padding rows compute junk; an activation
    can overflow) still choose k distinct experts in range, so the sort and the grouped GEMMs
    never index past their buffers (on an H200 a prefill graph's padding rows sent an expert
    id of 8 of 8 into the counts: an illegal memory access); finite rows are unaffected."""
    from minisgl.kernels import moe
    logits = _layer(6, 4, 4, experts, torch.float32)["logits"]
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    logits[3, 0] = float("inf")
    logits[4] = float("inf")
    got = moe.route(logits, top_k, False)
    ids = got.ids.long().cpu()
    assert int(ids.min()) >= 0 and int(ids.max()) < experts, ids
    assert all(len(set(row.tolist())) == top_k for row in ids), ids
    assert torch.equal(got.counts.long().cpu(), torch.bincount(ids.flatten(), minlength=experts))
    for row in (0, 5):
        assert torch.equal(ids[row], route(logits[row:row + 1], top_k, False).ids[0].cpu())


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 64, 32, 8, 2), (7, 48, 40, 5, 2), (19, 64, 24, 16, 4), (3, 32, 16, 32, 3)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_experts_match_torch(tokens: int, hidden: int, inter: int, experts: int,
                                   top_k: int, block_m: int) -> None:
    """float32: K and N not multiples of the tiles, most experts idle in the small cases."""
    from minisgl.kernels import moe
    from minisgl.kernels.types import GemmTiles, MoETiles
    t = _layer(tokens, hidden, inter, experts, torch.float32)
    topk = route(t["logits"], top_k, True)
    tiles = MoETiles(block_m, GemmTiles(16, 32, 4, 2), GemmTiles(32, 16, 4, 2, group_m=2))
    got = moe.fused_experts(t["x"], moe.routing_of(*topk, experts), t["w13"], t["w2"], tiles)
    torch.testing.assert_close(got, experts_torch(t["x"], topk, t["w13"], t["w2"]),
                               rtol=1e-5, atol=1e-5)


def test_fused_experts_of_each_ranks_own_experts_sum_to_all() -> None:
    """Expert parallelism in the kernels: each of 3 ranks runs only the pairs of its own
    experts (owned_topk: the rest go to an expert no block runs, their rows zero), and the
    ranks' outputs sum to the fused experts of all (packed experts: test_int_packed.py)."""
    from minisgl.kernels import moe
    t = _layer(9, 64, 32, 6, torch.float32)
    topk = route(t["logits"], 2, True)
    tiles = moe.moe_tiles(9, 2, 6)
    whole = moe.fused_experts(t["x"], moe.routing_of(*topk, 6), t["w13"], t["w2"], tiles)
    parts = [moe.fused_experts(t["x"], moe.routing_of(*owned_topk(topk, Shard(2 * r, 2)), 3,
                                                      owned=2),
                               t["w13"][2 * r:2 * r + 2], t["w2"][2 * r:2 * r + 2], tiles)
             for r in range(3)]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parts[0], whole, atol=1e-3)


def test_fused_moe_default_tiles_match_torch() -> None:
    from minisgl.kernels import moe
    t = _layer(6, 64, 32, 8, torch.float32)
    got = moe.fused_moe(t["x"], t["logits"], t["w13"], t["w2"], 2, False)
    want = experts_torch(t["x"], route(t["logits"], 2, False), t["w13"], t["w2"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tiles_grow_with_rows_per_expert() -> None:
    from minisgl.kernels import moe
    sizes = [moe.moe_tiles(m, 8, 128).block_m for m in (1, 64, 256, 1024, 8192)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128
    assert moe.padded_capacity(8, 128, 16) == 128  # 8 pairs: at most 8 experts, 16 rows each


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
def test_fused_moe_on_gpu(dtype: torch.dtype, tokens: int) -> None:
    """A Qwen3-30B-A3B layer (128 experts, top 8, 2048 x 768): the fused path against the torch
    path on CUDA (bf16 within rounding, float32 tight), the same bits twice, and the same
    inside a CUDA graph."""
    from minisgl.kernels import moe
    t = _layer(tokens, 2048, 768, 128, dtype)
    topk = route(t["logits"], 8, True)
    want = experts_torch(t["x"], topk, t["w13"], t["w2"])
    got = moe.fused_moe(t["x"], t["logits"], t["w13"], t["w2"], 8, True)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1.6e-2), err
    assert torch.equal(got, moe.fused_moe(t["x"], t["logits"], t["w13"], t["w2"], 8, True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.fused_moe(t["x"], t["logits"], t["w13"], t["w2"], 8, True)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "glm4_moe", "dots1"])
def test_fused_moe_tokens_on_gpu_float32(moe_model: Callable[[str], Path],
                                         reference: Callable[[str], List[List[int]]],
                                         name: str) -> None:
    """float32 on CUDA with the fused kernels and decode CUDA graphs: Hugging Face's tokens,
    as without the fused kernels."""
    for fused in (True, False):
        got = _generate(moe_model(name), device="cuda", dtype="float32", fused_ops=fused,
                        page_size=16, max_prefill_tokens=40)
        assert got == reference(name), fused


@pytest.mark.gpu
def test_dummy_qwen3_30b_a3b_bf16_runs() -> None:
    """The benchmark shape on one GPU: dummy weights, bf16, fused kernels, decode graphs."""
    with LLM(str(CONFIGS / "qwen3-30b-a3b"), load_format="dummy", max_kv_tokens=8192,
             show_progress=False) as llm:
        outs = llm.generate([[1, 2, 3], list(range(10, 300))],
                            SamplingParams(max_tokens=8, ignore_eos=True))
        vocab = llm.vocab_size
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(0 <= t < vocab for o in outs for t in o.token_ids)


def test_glm4_moe_skips_its_mtp_layer_and_checks_its_router(
        moe_model: Callable[[str], Path], reference: Callable[[str], List[List[int]]],
        tmp_path: Path) -> None:
    """A GLM-4.5 checkpoint's multi-token-prediction layer (after the decoder's, config.json's
    num_nextn_predict_layers) is skipped: Hugging Face's tokens; a tensor past those layers
    still has no place. Groups the experts cannot be split into, or too few eligible
    experts, are refused naming the numbers."""
    import json
    import shutil

    from safetensors.torch import save_file
    src = moe_model("glm4_moe")
    model = tmp_path / "glm"
    shutil.copytree(src, model)
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    save_file({f"model.layers.{layers}.eh_proj.weight": torch.randn(64, 128),
               f"model.layers.{layers}.mlp.experts.0.up_proj.weight": torch.randn(32, 64)},
              str(model / "model-mtp.safetensors"))
    assert _generate(model, page_size=16, max_prefill_tokens=40) == reference("glm4_moe")
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=f"model.layers.{layers}.eh_proj.weight has no place"):
        _generate(model)
    for fields, named in ((dict(n_group=3), "n_group 3 must divide the 8 routed experts"),
                          (dict(topk_group=3), "topk_group 3 be in \\[1, n_group\\]"),
                          (dict(n_group=4, topk_group=1, num_experts_per_tok=3),
                           "leave fewer than num_experts_per_tok 3")):
        with pytest.raises(ValueError, match=named):
            ModelConfig.from_dict({**config, **fields})
