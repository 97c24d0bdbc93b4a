"""GPU checks (run on the H200 machine with `pytest -m gpu`; skipped without CUDA)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, LoRARequest, SamplingParams
from minisgl.core import Batch, Phase, Req
from tiny_models import build_tiny

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen3", tmp_path_factory.mktemp("gpu-qwen3"), None)


def _run(path: Path, params: SamplingParams = GREEDY, **kw: object) -> list:
    with LLM(str(path), show_progress=False, **kw) as llm:  # type: ignore[arg-type]
        return [o.token_ids for o in llm.generate(mixed_prompts(8, seed=6), params)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_float32_matches_cpu(tiny_qwen3: Path, backend: str) -> None:
    cpu = _run(tiny_qwen3, device="cpu", dtype="float32")
    assert _run(tiny_qwen3, device="cuda", dtype="float32", attention_backend=backend) == cpu


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_speculative_decoding_matches_cpu(tiny_qwen3: Path, backend: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """N-gram drafts verified on CUDA (with the Triton backend through verify graphs beside
    the decode graphs; the torch backend's verify steps run eagerly): the CPU's float32
    tokens."""
    import logging
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    cpu = _run(tiny_qwen3, device="cpu", dtype="float32")
    with caplog.at_level(logging.INFO, logger="minisgl.engine.verify_graph"):
        assert _run(tiny_qwen3, device="cuda", dtype="float32", attention_backend=backend,
                    speculative_config=spec) == cpu
    assert ("verify CUDA graphs (batch sizes 1.." in caplog.text) == (backend == "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_draft_model_matches_cpu(tiny_qwen3: Path, backend: str) -> None:
    """A draft model on CUDA (the target itself: its K/V shadowed through prefills, mixed
    steps where the backend mixes, and decode steps; its drafts proposed through its own decode
    graphs before the verify graphs): the CPU's float32 greedy tokens, nearly every draft kept;
    seeded sampling gives the tokens it gives without speculation."""
    spec = {"model": str(tiny_qwen3), "num_speculative_tokens": 3}
    cpu = _run(tiny_qwen3, device="cpu", dtype="float32")
    with LLM(str(tiny_qwen3), device="cuda", dtype="float32", attention_backend=backend,
             speculative_config=spec, show_progress=False) as llm:
        outs = llm.generate(mixed_prompts(8, seed=6), GREEDY)
        stats = llm.stats
    assert [o.token_ids for o in outs] == cpu
    assert stats.spec_accepted_tokens_total > 0.9 * stats.spec_draft_tokens_total > 0, stats
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    plain = _run(tiny_qwen3, device="cuda", dtype="float32", attention_backend=backend,
                 params=seeded)
    assert _run(tiny_qwen3, device="cuda", dtype="float32", attention_backend=backend,
                params=seeded, speculative_config=spec) == plain


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_eagle3_proposes_the_reference(tiny_model: Callable[..., Path], tmp_path: Path,
                                           backend: str, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """An EAGLE-3 head on CUDA in float32 (the target's layer inputs kept inside its decode,
    prefill and verify graphs; the head's steps through its own graphs with the Triton
    backend, engine/eagle_graph.py, eager with torch's): every proposal the CPU reference's,
    Hugging Face's greedy tokens; then the oracle head of tests/test_eagle.py keeps nearly
    every draft through the graphs."""
    from eagle_reference import record_proposals, reference_drafts, write_eagle3
    from test_eagle import _identity_target, _oracle_head
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=3, draft_vocab=1000, scale=0.2)
    seen = record_proposals(monkeypatch)
    prompts = mixed_prompts(6, seed=6)
    with LLM(str(target), device="cuda", dtype="float32", attention_backend=backend,
             show_progress=False, speculative_config={
                 "method": "eagle3", "model": str(head), "num_speculative_tokens": 3}) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(target, prompts, GREEDY.max_tokens)
    assert len(seen) > 6 and [d for _, d in seen] == reference_drafts(target, head, seen)
    oracle_target = _identity_target(tiny_model, tmp_path / "identity")
    oracle = _oracle_head(oracle_target, tmp_path / "oracle")
    with LLM(str(oracle_target), device="cuda", dtype="float32", attention_backend=backend,
             show_progress=False, speculative_config={
                 "method": "eagle3", "model": str(oracle), "num_speculative_tokens": 1}) as llm:
        llm.generate(prompts, GREEDY)
        stats = llm.stats
    # its drafts equal the target's tokens where two float32 norms of the same embedding pick
    # the same argmax: on an H100 64 of 68 (the CPU test keeps every one)
    assert stats.spec_accepted_tokens_total >= 0.9 * stats.spec_draft_tokens_total > 0, stats


def test_gpu_verify_graphs_match_eager_verify_steps(tiny_qwen3: Path) -> None:
    """Seeded sampling through verify graphs (one request and eight
    at once, drafts of every length) and through eager verify steps: the same tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5)

    def run(graphs: int) -> list:
        with LLM(str(tiny_qwen3), device="cuda", dtype="float32", speculative_config=spec,
                 cuda_graph_max_bs=graphs, show_progress=False) as llm:  # type: ignore[arg-type]
            prompts = mixed_prompts(8, seed=9)
            return [[o.token_ids for o in llm.generate(p, params)] for p in (prompts[:1], prompts)]
    assert run(32) == run(0)  # verify graphs up to 8 requests of 4 tokens


def test_gpu_verify_graphs_at_batch_one(tiny_qwen3: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """One running request (the case speculation is for): the verify graph of one request of
    five tokens is captured (the graph buffers hold its five rows where the decode graph needs
    one; a forty-fifth-session run verified eagerly at 0.09x plain decoding) and gives the
    CPU's float32 tokens."""
    import logging
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    cpu = _run(tiny_qwen3, device="cpu", dtype="float32", max_running_requests=1)
    with caplog.at_level(logging.INFO, logger="minisgl.engine.verify_graph"):
        assert _run(tiny_qwen3, device="cuda", dtype="float32", max_running_requests=1,
                    speculative_config=spec) == cpu
    assert "verify CUDA graphs (batch sizes 1..1, up to 5 tokens" in caplog.text


def test_gpu_hidden_states_match_cpu(tiny_qwen3: Path) -> None:
    """return_hidden_states on CUDA (batches holding an asking request run eagerly, the others
    through the decode graphs): the CPU's float32 states and tokens, asking or not."""
    ask = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                         return_hidden_states=True)
    prompts = mixed_prompts(4, seed=3)

    def run(device: str) -> list:
        with LLM(str(tiny_qwen3), device=device, dtype="float32",
                 show_progress=False) as llm:  # type: ignore[arg-type]
            return [o.outputs[0] for o in llm.generate(prompts, [ask, GREEDY, ask, GREEDY])]
    cpu, gpu = run("cpu"), run("cuda")
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for c, g in zip(cpu, gpu):
        assert (c.hidden_states is None) == (g.hidden_states is None)
        if c.hidden_states is not None:
            torch.testing.assert_close(g.hidden_states, c.hidden_states, rtol=1e-4, atol=1e-4)


BITS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)


def _wide_qwen3(out: Path) -> Path:
    """Wide enough projections that the batch-1 GEMV and cuBLAS round apart (at the tiny
    models' 64 features they happened to agree: the deterministic tests' control)."""
    return build_tiny("qwen3", out, None, hidden_size=1024, intermediate_size=4096,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128)


def _bits(model: Path, prompts: list, invariant: bool = True, params: object = BITS,
          **kw: object) -> list:
    """Each prompt's bf16 tokens and top-3 log-probabilities on CUDA (`params`: BITS, or one
    per prompt)."""
    with LLM(str(model), device="cuda", dtype="bfloat16", show_progress=False,
             enable_deterministic_inference=invariant, **kw) as llm:  # type: ignore[arg-type]
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]  # type: ignore[arg-type]
    return [(o.token_ids, [sorted((t, p.logprob) for t, p in d.items()) for d in o.logprobs])
            for o in outs]


def test_gpu_deterministic_inference_in_bf16(tmp_path: Path) -> None:
    """enable_deterministic_inference on CUDA in bfloat16 (the invariant GEMM, every token
    through the extend kernel, decode and verify graphs): a request's tokens and
    log-probabilities are the same bits alone, beside five others with its prompt in chunks,
    and through n-gram verification; without the setting they are not (the control)."""
    model = _wide_qwen3(tmp_path / "wide")
    # long enough that its whole prefill takes the GEMM's large tiles on sm_90 (invariant_mm
    # LARGE_TILE_ROWS), where its 16-token chunks and its decode steps take the small ones
    target = mixed_prompts(1, seed=31, lengths=(300,))[0]
    others = mixed_prompts(5, seed=32, lengths=(5, 60))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    batch = [*others[:2], target, *others[2:]]
    alone = _bits(model, [target])[0]
    assert _bits(model, batch, max_prefill_tokens=16)[2] == alone
    assert _bits(model, batch, speculative_config=spec)[2] == alone
    control = _bits(model, batch, False, max_prefill_tokens=16)[2]
    assert control[1] != _bits(model, [target], False)[0][1]


def test_gpu_deterministic_inference_with_experts(tmp_path: Path) -> None:
    """enable_deterministic_inference on a mixture of experts on CUDA in bf16 (the experts in
    the torch path, every expert on every token through the invariant GEMM, added in expert
    order; the fused experts' tiles would follow the token count): a request's bits alone and
    in a chunked batch."""
    model = build_tiny("qwen3_moe", tmp_path / "moe", None)
    target = mixed_prompts(1, seed=33, lengths=(300,))[0]
    others = mixed_prompts(3, seed=34, lengths=(5, 60))
    batched = _bits(model, [others[0], target, *others[1:]], max_prefill_tokens=16)
    assert batched[1] == _bits(model, [target])[0]


def test_gpu_deterministic_inference_with_lora(tmp_path: Path) -> None:
    """enable_deterministic_inference with LoRA on CUDA in bf16 (each delta's products through
    the invariant GEMM over every slot, in the LoRA decode graphs too): a request's bits under
    its adapter alone and in a chunked batch beside a base request and another adapter's."""
    from tiny_models import write_lora
    path = build_tiny("llama", tmp_path / "llama", None)
    a1, a2 = (str(write_lora(path, tmp_path / f"a{i}", i)) for i in (1, 2))
    target, plain, other = mixed_prompts(3, seed=39, lengths=(300,))
    params = [dataclasses.replace(BITS, lora_name=name) for name in (None, "a1", "a2")]
    modules = f"a1={a1},a2={a2}"
    batched = _bits(path, [plain, target, other], params=params, lora_modules=modules,
                    max_prefill_tokens=16)
    assert batched[1] == _bits(path, [target], params=[params[1]], lora_modules=modules)[0]


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_gpu_deterministic_inference_at_tp2(tmp_path: Path) -> None:
    """enable_deterministic_inference at tp=2 on two GPUs (the ordered all-reduce over NCCL's
    all-gather, in CUDA graphs too): a request's bf16 tokens and log-probabilities alone and
    in a chunked batch."""
    model = _wide_qwen3(tmp_path / "wide")
    target = mixed_prompts(1, seed=31, lengths=(300,))[0]
    others = mixed_prompts(3, seed=32, lengths=(5, 60))
    batched = _bits(model, [others[0], target, *others[1:]], tp=2, max_prefill_tokens=16)
    assert batched[1] == _bits(model, [target], tp=2)[0]


@pytest.mark.parametrize("family", ["qwen2_yarn", "llama_linear"])
def test_gpu_scaled_rope_matches_cpu(family: str, tmp_path: Path) -> None:
    """YaRN's and linear scaling's tables (YaRN's attention factor in cos and sin) reach the
    fused rotary kernel on CUDA as the CPU's torch rotation reads them."""
    path = build_tiny(family, tmp_path / family, None)
    assert _run(path, device="cuda", dtype="float32") == _run(path, device="cpu",
                                                                dtype="float32")


@pytest.mark.parametrize("family,window", [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ("gemma3", dict()), ("gemma2", dict())])
def test_gpu_sliding_window_matches_cpu(family: str, window: dict, tmp_path: Path) -> None:
    """A 16-token window (every layer; Qwen2's second only), and Gemma 3's tiny model (8
    tokens in its first and last layers, sandwich norms, GELU, two rotary tables) on CUDA
    (Triton kernels, decode graphs with splits, chunked prefill) give the CPU's float32
    tokens."""
    path = build_tiny(family, tmp_path / family, None, **window)
    assert _run(path, device="cuda", dtype="float32", max_prefill_tokens=48) == _run(
        path, device="cpu", dtype="float32", max_prefill_tokens=48)


@pytest.mark.parametrize("family", ["phi3_longrope", "phi4_mini", "smollm3", "granite",
                                    "glm4"])
def test_gpu_rope_variants_and_multipliers_match_cpu(family: str, tmp_path: Path) -> None:
    """Longrope on CUDA: rope indices through the fused rotary kernels (phi3_longrope: whole
    heads of 16) or torch's partial rotation (phi4_mini), decode graphs deriving them from
    positions, prefill graphs for short prompts only, sequences prefilled again past 32
    tokens; SmolLM3's NoPE layer (attention stores its K/V); Granite's multipliers (folded
    into o_proj and down_proj, through the batch-1 GEMVs); GLM-4's interleaved half-head
    rotation and sandwich norms: the CPU's float32 tokens."""
    path = build_tiny(family, tmp_path / family, None)
    assert _run(path, device="cuda", dtype="float32") == _run(path, device="cpu",
                                                              dtype="float32")


def test_gpu_lora_matches_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on CUDA (float32): requests of two adapters and of none, decoding side by side
    (batches with adapter tokens replay the LoRA family of decode graphs, the base model's
    alone the other), give the CPU's tokens; the second adapter loads at run time, after the
    capture, into a slot a former one used."""
    from minisgl.engine.cuda_graph import DecodeGraphs
    from tiny_models import write_lora
    replays: List[bool] = []
    real = DecodeGraphs.replay

    def counting(self: DecodeGraphs, batch: Batch, lora: bool = False) -> object:
        replays.append(lora)
        return real(self, batch, lora)
    monkeypatch.setattr(DecodeGraphs, "replay", counting)
    path = build_tiny("llama", tmp_path / "llama", None)
    a1, a2, a3 = (str(write_lora(path, tmp_path / f"a{i}", i)) for i in (1, 2, 3))
    prompts = mixed_prompts(6, seed=6)
    params = [SamplingParams(max_tokens=24 - 2 * i, temperature=0.0, ignore_eos=True,
                             lora_name=[None, "a1", "a2"][i % 3]) for i in range(6)]

    def run(device: str) -> List[List[int]]:
        with LLM(str(path), device=device, dtype="float32", lora_modules=f"a1={a1}",
                 max_loras=2, show_progress=False) as llm:
            llm.add_lora(LoRARequest("a3", 3, a3))
            llm.generate(prompts[:2], GREEDY, lora_request=LoRARequest("a3"))
            llm.remove_lora("a3")
            llm.add_lora(LoRARequest("a2", 2, a2))  # into a3's slot
            # lengths 24, 22, ..., 14: the base model's request decodes alone at the end
            return [o.token_ids for o in llm.generate(prompts, params)]

    assert run("cuda") == run("cpu")
    assert True in replays and False in replays


def test_gpu_lora_over_fp8_weights_and_experts(tmp_path: Path) -> None:
    """LoRA over online FP8 weights on CUDA (bfloat16: the W8A8 products, the deltas added to
    them; adapter batches in the LoRA decode graphs): the adapter's sequences
    start mostly as over the bfloat16 weights, and not as the base model's. Over Qwen2-MoE's
    fused experts (float32), an adapter of attention gives the CPU's tokens."""
    from tiny_models import write_lora
    path = build_tiny("llama", tmp_path / "llama", None)
    adapter = str(write_lora(path, tmp_path / "a", 4))
    prompts = mixed_prompts(6, seed=9)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                             lora_name=name) for name in ("x", None)]

    def run(model: Path, **kw: object) -> List[List[List[int]]]:
        with LLM(str(model), lora_modules=f"x={adapter}", show_progress=False,
                 **kw) as llm:  # type: ignore[arg-type]
            return [[o.token_ids for o in llm.generate(prompts, p)] for p in params]
    fp8, fp8_base = run(path, device="cuda", dtype="bfloat16", quantization="fp8")
    dense, _ = run(path, device="cuda", dtype="bfloat16")
    assert sum(a[0] == b[0] for a, b in zip(fp8, dense)) >= 4
    assert sum(a[0] != b[0] for a, b in zip(fp8, fp8_base)) >= 3
    moe = build_tiny("qwen2_moe", tmp_path / "moe", None)
    adapter = str(write_lora(moe, tmp_path / "m", 5, targets=("q_proj", "v_proj", "o_proj")))
    assert (run(moe, device="cuda", dtype="float32")
            == run(moe, device="cpu", dtype="float32"))


def test_gpu_weights_reload_matches_cpu(tmp_path: Path) -> None:
    """Weights reloaded in place on CUDA (float32, decode graphs captured before: they keep
    reading the same tensors) give the CPU's tokens of the new checkpoint, and of the first
    again after a reload that failed half way (a missing tensor)."""
    from safetensors.torch import load_file, save_file
    first = build_tiny("llama", tmp_path / "a", None)
    second = build_tiny("llama", tmp_path / "b", None, seed=5)
    partial = build_tiny("llama", tmp_path / "p", None, seed=6)
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"))
    prompts = mixed_prompts(4, seed=8)

    def run(device: str) -> List[List[List[int]]]:
        with LLM(str(first), device=device, dtype="float32", show_progress=False) as llm:
            llm.update_weights_from_disk(str(second))
            out = [[o.token_ids for o in llm.generate(prompts, GREEDY)]]
            with pytest.raises(ValueError, match="missing 1 weights"):
                llm.update_weights_from_disk(str(partial))
            out.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
            return out

    got = run("cuda")
    assert got == run("cpu") and got[0] == got[1]


def test_gpu_embeddings_match_cpu(tiny_qwen3: Path) -> None:
    """Embeddings on CUDA (float32, prefill graphs on: an embedding request runs eager) equal
    the CPU's, beside requests for text: by the last token, and by the mean over chunks of 16
    (--pooler-config; engine/pooling.py's sums on the device)."""
    prompts = mixed_prompts(6, seed=7)

    def run(device: str, **kw: object) -> torch.Tensor:
        with LLM(str(tiny_qwen3), device=device, dtype="float32", show_progress=False,
                 **kw) as llm:  # type: ignore[arg-type]
            llm.generate(prompts[:2], GREEDY)
            return torch.tensor([o.outputs.embedding for o in llm.embed(prompts)])

    torch.testing.assert_close(run("cuda"), run("cpu"), atol=1e-4, rtol=1e-3)
    mean = dict(pooler_config='{"pooling_type": "MEAN"}', max_prefill_tokens=16)
    torch.testing.assert_close(run("cuda", **mean), run("cpu", **mean), atol=1e-4, rtol=1e-3)


def test_enforce_eager_captures_no_graph_and_keeps_the_tokens(tiny_qwen3: Path) -> None:
    with LLM(str(tiny_qwen3), device="cuda", dtype="float32", enforce_eager=True,
             show_progress=False) as llm:
        engine = llm._backend.engine  # type: ignore[union-attr]
        assert engine.graphs is None and engine.prefill_graphs is None
        eager = [o.token_ids for o in llm.generate(mixed_prompts(8, seed=6), GREEDY)]
    assert eager == _run(tiny_qwen3, device="cuda", dtype="float32")


def test_gpu_logprobs_match_cpu(tiny_qwen3: Path) -> None:
    """Log-probabilities on CUDA (decode graphs replayed, fused ops, float32) equal the CPU's:
    the graphs' logits feed them as the eager path's do."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=4)

    def run(**kw: object) -> list:
        with LLM(str(tiny_qwen3), show_progress=False, dtype="float32",  # type: ignore[arg-type]
                 **kw) as llm:
            return llm.generate(mixed_prompts(8, seed=6), params)
    gpu, cpu = run(device="cuda"), run(device="cpu")
    for g, c in zip(gpu, cpu):
        assert g.token_ids == c.token_ids
        assert [lp.top_ids for lp in g.logprobs] == [lp.top_ids for lp in c.logprobs]
        assert [lp.logprob for lp in g.logprobs] == pytest.approx(
            [lp.logprob for lp in c.logprobs], abs=1e-3)


def test_gpu_penalties_match_cpu(tiny_qwen3: Path) -> None:
    """Penalties on CUDA (counts on the device, decode graphs replayed, overlap) give the CPU's
    float32 tokens, penalized and plain requests mixed."""
    pen = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                         repetition_penalty=1.2, frequency_penalty=0.6, presence_penalty=0.3)
    params = [pen, GREEDY] * 4

    def run(**kw: object) -> list:
        with LLM(str(tiny_qwen3), show_progress=False, dtype="float32",  # type: ignore[arg-type]
                 **kw) as llm:
            return [o.token_ids for o in llm.generate(mixed_prompts(8, seed=6), params)]
    assert run(device="cuda") == run(device="cpu")


@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_tp2_matches_tp1(tiny_qwen3: Path, backend: str) -> None:
    kw = dict(device="cuda", dtype="float32", attention_backend=backend)
    assert _run(tiny_qwen3, tp=2, **kw) == _run(tiny_qwen3, tp=1, **kw)


@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_dummy_llama8b_bf16_tp2_runs() -> None:
    with LLM(str(CONFIGS / "llama-3.1-8b"), tp=2, device="cuda", dtype="bfloat16",
             load_format="dummy", show_progress=False) as llm:
        outs = llm.generate(mixed_prompts(4, seed=7), SamplingParams(max_tokens=16,
                                                                      ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)


@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_retraction_keeps_tokens(tiny_qwen3: Path, overlap: bool) -> None:
    """Optimistic admission on the GPU (overlap on: retraction first finishes the in-flight
    batch): a small pool forces retractions, and the float32 tokens equal the CPU's."""
    kw = dict(dtype="float32", page_size=4, max_kv_tokens=400, max_running_requests=12)
    cpu = _run(tiny_qwen3, device="cpu", **kw)
    with LLM(str(tiny_qwen3), device="cuda", overlap=overlap, decode_reserve_tokens=4,
             show_progress=False, **kw) as llm:  # type: ignore[arg-type]
        got = [o.token_ids for o in llm.generate(mixed_prompts(8, seed=6), GREEDY)]
        assert llm.check_accounting().retracted_requests > 0
    assert got == cpu


def test_gpu_cuda_graphs_match_eager_with_padding_and_sampling(tiny_qwen3: Path) -> None:
    """Decode graphs (padded sizes, inputs derived in the graph from `last_tokens` and the page
    table) give the eager path's tokens in float32, greedy and seeded sampling mixed, while the
    batch shrinks through sizes 7, 6, ..., 1 (most padded up to 8 or 4)."""
    prompts = mixed_prompts(7, seed=9)
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(7)]

    def run(graph_bs: int) -> list:
        with LLM(str(tiny_qwen3), device="cuda", dtype="float32", cuda_graph_max_bs=graph_bs,
                 show_progress=False) as llm:  # type: ignore[arg-type]
            return [o.token_ids for o in llm.generate(prompts, params)]
    assert run(16) == run(0)


def test_decode_graphs_write_their_logits_into_one_buffer(tiny_qwen3: Path) -> None:
    """Every decode graph's logits are a view of the first rows of one [max_bs, vocab] buffer
    (engine/cuda_graph.logits_buffer), not an output of its own (those held 1.08 GB at sizes up
    to 256 and a 128K vocabulary); a replay's rows equal the eager forward's."""
    from minisgl.distributed import DistributedInfo, ProcessGroups
    from minisgl.distributed.comm import Communicator
    from minisgl.engine import Engine, EngineConfig
    info = DistributedInfo(0, 1)
    engine = Engine(EngineConfig(model_path=str(tiny_qwen3), tp_info=info, device="cuda",
                                 dtype="float32", max_kv_tokens=512, page_size=1,
                                 max_running_requests=32, cuda_graph_max_bs=32,
                                 prefill_graph_tokens=0),
                    ProcessGroups(Communicator(info), None))
    graphs = engine.graphs
    assert graphs is not None and graphs.out.shape[0] == 32
    assert {t.data_ptr() for t in graphs.logits.values()} == {graphs.out.data_ptr()}
    assert all(t.shape[0] == bs for (bs, _), t in graphs.logits.items())
    reqs = [Req(i, [5 + i], 1, GREEDY, (), table_row=i) for i in range(3)]
    for req in reqs:  # row i: slots 4i (the prompt's one token) and 4i + 1 (the decoded one)
        engine.page_table[req.table_row, :2] = torch.tensor([4 * req.table_row,
                                                             4 * req.table_row + 1])
        prefill = Batch(Phase.PREFILL, [req], [0], [1], [True])
        prefill.out_slots = engine.page_table[req.table_row, :1].long()
        engine.forward(prefill)
    decode = Batch(Phase.DECODE, reqs, [1] * 3, [1] * 3, [True] * 3)
    decode.out_slots = engine.page_table[:3, 1].long()
    replayed = engine._forward(decode, [0, 1, 2]).logits.clone()
    engine.graphs = None
    eager = engine._forward(decode, [0, 1, 2]).logits
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)


def test_prefill_graphs_match_eager_fresh_and_after_a_cached_prefix(
        tiny_qwen3: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Prefill graphs (one request padded to its bucket, positions, slots and attention
    metadata derived in the graph) give the eager path's tokens in float32, for fresh prompts of
    several buckets and for one whose first 200 tokens come from the prefix cache."""
    import logging
    import random
    rng = random.Random(3)
    base = [rng.randrange(10, 1000) for _ in range(460)]
    prompts = [base[:5], base[:64], base[:100], base[:460], base[:200] + [7, 8, 9], base[:300]]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=4)

    def run(tokens: int) -> list:
        with LLM(str(tiny_qwen3), device="cuda", dtype="float32", prefill_graph_tokens=tokens,
                 mixed_steps=False, show_progress=False) as llm:  # type: ignore[arg-type]
            return [(llm.generate([p], GREEDY)[0].token_ids,
                     llm.generate([p[:-1]], params)[0].token_ids) for p in prompts]
    with caplog.at_level(logging.INFO, logger="minisgl.engine.prefill_graph"):
        graphs = run(512)
    assert "captured 9 prefill CUDA graphs" in caplog.text  # 64, 96, 128, 192, 256, ... 512
    assert graphs == run(0)


def _pdl_device() -> bool:
    return _gpus() > 0 and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _pdl_device(), reason="needs compute capability 9.0+")
def test_pdl_float32_tokens_equal_without_pdl(tiny_qwen3: Path) -> None:
    """Programmatic dependent launch changes only when kernels may start, never what they
    compute: in float32 (same kernels, the projections stay on cuBLAS) the tokens are equal, in
    graphs (batch 8 down to 1) and eager prefill. A missing wait would show as a race here."""
    kw = dict(device="cuda", dtype="float32")
    assert _run(tiny_qwen3, pdl="on", **kw) == _run(tiny_qwen3, pdl="off", **kw)


@pytest.mark.skipif(not _pdl_device(), reason="needs compute capability 9.0+")
def test_pdl_bf16_batch1_gemv_path_is_deterministic(tiny_qwen3: Path) -> None:
    """bf16 at batch 1 routes every projection through the prefetching GEMV with PDL, inside
    the decode graph: it generates every token, and two runs agree (a missing wait would show
    as run-to-run differences). Graph vs eager is not compared here: their attention split
    counts differ, which in bf16 can flip a near-tie token of a random model."""
    one = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run() -> list:
        with LLM(str(tiny_qwen3), device="cuda", dtype="bfloat16", pdl="on",
                 show_progress=False) as llm:
            return llm.generate(mixed_prompts(1, seed=3), one)[0].token_ids
    first = run()
    assert len(first) == 12 and run() == first


@pytest.mark.skipif(not _pdl_device(), reason="needs compute capability 9.0+")
@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3", "qwen2_yarn"])
def test_bf16_batch1_fused_projections_match_the_unfused_path(family: str,
                                                              tmp_path: Path) -> None:
    """At batch 1 in bf16 with PDL each layer's norms run inside the QKV and gate/up GEMVs and,
    without per-head q/k norms (qwen2 with its QKV bias, llama3 with its scaled rope), the
    rotary and the K/V store run in the QKV GEMV's epilogue. Against PDL off (separate norm,
    rotary, store kernels and cuBLAS) the greedy tokens agree: the tiny models' logits are far
    apart, so a last-bit difference does not flip them, while a wrong rotation, slot or
    residual would."""
    path = build_tiny(family, tmp_path / family, None)
    assert _batch1_bf16(path, pdl="on") == _batch1_bf16(path, pdl="off")


def _batch1_bf16(path: Path, **kw: object) -> List[List[int]]:
    """Greedy tokens of three prompts generated one at a time (batch 1) in bfloat16."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cuda", dtype="bfloat16", show_progress=False,
             **kw) as llm:  # type: ignore[arg-type]
        return [llm.generate([p], params)[0].token_ids for p in mixed_prompts(3, seed=4)]


@pytest.mark.skipif(_gpus() < 2 or not _pdl_device(), reason="needs two Hopper GPUs")
def test_bf16_batch1_fused_projections_tp2_match_tp1(tmp_path: Path) -> None:
    """At tp=2 the batch-1 fused kernels take the all-reduced o_proj / down_proj output (the
    stream's reduction runs first, then the norm inside the next GEMV; llama3: QKV with rotary
    and K/V store fused). Each prompt's first 4 tokens (3 decode steps through the fused path)
    equal tp=1's: a wrong rotation, slot or residual breaks the first decode step. Later tokens
    are not compared: in bf16 the two ranks' partial sums round differently from one GEMV, and
    on an H200 (seventh session) one of the 3 prompts flipped a near-tie at its 7th token
    while the other two agreed on all 16."""
    path = build_tiny("llama3", tmp_path / "llama3", None)
    tp2, tp1 = (_batch1_bf16(path, pdl="on", tp=tp) for tp in (2, 1))
    assert [t[:4] for t in tp2] == [t[:4] for t in tp1]


def test_tuned_gemms_float32_tokens_equal_untuned(tiny_qwen3: Path) -> None:
    """EngineConfig.tune_gemms: timing both libraries at start-up, then capturing the graphs with
    the faster per projection, leaves float32 greedy tokens as they were."""
    kw = dict(device="cuda", dtype="float32")
    assert _run(tiny_qwen3, tune_gemms=True, **kw) == _run(tiny_qwen3, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cublaslt_linear_matches_cublas_and_restores_the_preference(dtype: torch.dtype) -> None:
    from minisgl.layers import blas
    before = torch.backends.cuda.preferred_blas_library()
    x = torch.randn(137, 512, device="cuda", dtype=dtype)
    w = torch.randn(1024, 512, device="cuda", dtype=dtype) / 512 ** 0.5
    want = torch.nn.functional.linear(x, w).float()
    got = blas.linear(x, w, None, "cublaslt").float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.backends.cuda.preferred_blas_library() == before
    timer = blas.cuda_timer(reps=3)
    assert all(timer(x, w, lib) > 0 for lib in blas.LIBRARIES)


def test_gpu_engine_warms_the_greedy_sampler_at_start(tiny_qwen3: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The argmax kernels run at start for the model's dtype and float32 (so a fresh machine
    compiles them then, not on its first request's way to its first token)."""
    from minisgl.engine import engine as engine_mod
    seen: List[torch.dtype] = []
    real = engine_mod.greedy

    def spy(logits: torch.Tensor, policy: object) -> torch.Tensor:
        seen.append(logits.dtype)
        return real(logits, policy)  # type: ignore[arg-type]
    monkeypatch.setattr(engine_mod, "greedy", spy)
    with LLM(str(tiny_qwen3), device="cuda", dtype="bfloat16", show_progress=False):
        assert seen == [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_mixed_prefill_graphs_match_separate_steps(tiny_qwen3: Path, quantization: object,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed steps on CUDA replay prefill graphs that carry the running requests' decode rows
    (three page-table rows for ten requests: each newcomer's prompt joins the two still
    decoding); float32 tokens, greedy and seeded sampling, equal those of separate steps. With
    FP8 weights a decode row's projections run in a GEMM sized for the mixed step's rows, not
    the decode step's (other FP8 kernels and tiles: layers/fp8.py, kernels/fp8.py): its
    rounding differs, the next layer's FP8 activation rounding can turn that into a step, and a
    near-tie flips (on an H200 one of ten greedy sequences parted at its 22nd token), so there
    most sequences start alike."""
    from minisgl.engine.prefill_graph import PrefillGraphs
    seen: list = []
    replay = PrefillGraphs.replay

    def counted(self: PrefillGraphs, batch: object) -> object:
        seen.append(batch.num_decode)  # type: ignore[attr-defined]
        return replay(self, batch)  # type: ignore[arg-type]
    monkeypatch.setattr(PrefillGraphs, "replay", counted)
    prompts = mixed_prompts(10, seed=11)
    params = [SamplingParams(max_tokens=5 + 4 * i, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(10)]

    def run(mixed: bool) -> list:
        with LLM(str(tiny_qwen3), device="cuda", dtype="float32", mixed_steps=mixed,
                 quantization=quantization, max_running_requests=3,
                 show_progress=False) as llm:  # type: ignore[arg-type]
            return [o.token_ids for o in llm.generate(prompts, params)]
    separate = run(False)
    assert not any(seen)
    mixed = run(True)
    assert any(seen), seen  # some prompt had decode rows riding along its graph
    if quantization is None:
        assert mixed == separate
    else:
        assert [len(t) for t in mixed] == [len(t) for t in separate]
        assert sum(a[:8] == b[:8] for a, b in zip(mixed, separate)) >= 2 * len(mixed) / 3


def test_gpu_bad_words_and_priority_match_cpu(tiny_qwen3: Path) -> None:
    """bad_words' device-side history under CUDA graphs and overlap (the newest token only on
    the device), and the priority policy, give the CPU's float32 tokens."""
    prompts = mixed_prompts(6, seed=8)
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(device: str) -> List[List[int]]:
        with LLM(str(tiny_qwen3), device=device, dtype="float32", show_progress=False,
                 scheduling_policy="priority") as llm:
            ref = llm.generate(prompts, free)
            words = [[ref[i].token_ids[3:5], ref[i].token_ids[:1]] for i in range(len(prompts))]
            params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                     bad_word_ids=tuple(tuple(w) for w in ws))
                      for ws in words]
            return [o.token_ids for o in llm.generate(prompts, params,
                                                      priority=list(range(6, 0, -1)))]

    assert run("cuda") == run("cpu")


def test_gpu_memory_utilization_caps_the_instance(tiny_qwen3: Path) -> None:
    """vLLM's gpu_memory_utilization on CUDA: everything the engine holds after start-up
    (weights, the KV pool, graphs) stays within that share of the GPU's memory, the pool is
    smaller than without it, and the engine serves; a share the weights already fill is
    refused at start-up, naming the numbers."""
    _, total = torch.cuda.mem_get_info()
    kw = dict(device="cuda", show_progress=False, cuda_graph_max_bs=8)
    with LLM(str(tiny_qwen3), **kw) as llm:  # type: ignore[arg-type]
        free_pages = llm._backend.engine.num_pages  # type: ignore[attr-defined]
    torch.cuda.empty_cache()
    share = 0.1
    with LLM(str(tiny_qwen3), gpu_memory_utilization=share, **kw) as llm:  # type: ignore[arg-type]
        pages = llm._backend.engine.num_pages  # type: ignore[attr-defined]
        assert torch.cuda.memory_reserved() <= share * total
        assert len(llm.generate(mixed_prompts(1, seed=6), GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert 0 < pages < free_pages
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match="gpu_memory_utilization 1e-06 allows this instance"):
        LLM(str(tiny_qwen3), gpu_memory_utilization=1e-6, **kw)  # type: ignore[arg-type]
