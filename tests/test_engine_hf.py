"""Greedy tokens equal Hugging Face transformers' (float32, CPU), across page sizes, chunking and
concurrency, on the default model and on random tiny models of every family."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest
import torch

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from tiny_models import FAMILIES

GREEDY32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog. Then it",
    "Write a short poem about the sea, the wind and the sky, in three stanzas:",
    " ".join(f"Item {i}: the number {i * 7} is {'even' if i % 2 == 0 else 'odd'}."
             for i in range(40)) + " Summarize the list:",
]


@pytest.fixture(scope="module")
def default_prompts(default_model_dir: Path) -> List[List[int]]:
    from minisgl.tokenizer.text import load_tokenizer
    tok = load_tokenizer(default_model_dir)
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len(prompts[-1]) > 300, len(prompts[-1])
    return prompts


@pytest.fixture(scope="module")
def default_reference(default_model_dir: Path, default_prompts: List[List[int]]
                      ) -> List[List[int]]:
    return hf_greedy(default_model_dir, default_prompts, 32)


@pytest.mark.parametrize("page_size,chunk", [(1, 8192), (16, 16), (16, 8192)])
def test_default_model_matches_hf(default_model_dir: Path, default_prompts: List[List[int]],
                                  default_reference: List[List[int]], page_size: int,
                                  chunk: int) -> None:
    with LLM(str(default_model_dir), device="cpu", page_size=page_size, max_prefill_tokens=chunk,
             max_kv_tokens=4096, show_progress=False) as llm:
        outs = llm.generate(default_prompts, GREEDY32)
    assert [o.token_ids for o in outs] == default_reference
    assert all(o.finish_reason == "length" for o in outs)


def test_speculative_decoding_matches_hf(default_model_dir: Path,
                                        default_prompts: List[List[int]],
                                        default_reference: List[List[int]]) -> None:
    """N-gram speculative decoding (scheduler/speculative.py) keeps drafts only where they are
    the tokens plain decoding gives: HF's greedy tokens, drafts kept along the way, and the
    KV accounting balanced after the rejected drafts' slots were written and dropped."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    with LLM(str(default_model_dir), device="cpu", page_size=16, max_kv_tokens=4096,
             speculative_config=spec, show_progress=False) as llm:
        outs = llm.generate(default_prompts, GREEDY32)
        stats, accounting = llm.stats, llm.check_accounting()
    assert [o.token_ids for o in outs] == default_reference
    assert stats.verify_steps_total > 0 and 0 < stats.spec_accepted_tokens_total \
        < stats.spec_draft_tokens_total, stats
    assert accounting.live_requests == accounting.reserved_pages == 0
    assert accounting.free_rows == accounting.total_rows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_families_match_hf(tiny_model: Callable[..., Path], family: str) -> None:
    path = tiny_model(family)
    prompts = mixed_prompts(4, seed=1)
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False) as llm:
        outs = llm.generate(prompts, GREEDY32)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 32)


@pytest.mark.parametrize("max_running,page_size,chunk,overlap", [
    (1, 16, 8192, False), (16, 1, 16, False), (16, 16, 8192, False), (16, 16, 16, True),
    (3, 1, 8192, True)])
def test_concurrency_does_not_change_tokens(tiny_model: Callable[..., Path], max_running: int,
                                            page_size: int, chunk: int, overlap: bool) -> None:
    """Also with overlap scheduling (on CPU the launch is synchronous, but the scheduler still
    decides one step behind: extra tokens dropped, resources freed a step late)."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(16, seed=2)
    with LLM(str(path), device="cpu", page_size=page_size, max_prefill_tokens=chunk,
             overlap=overlap, max_running_requests=max_running, max_kv_tokens=8192,
             show_progress=False) as llm:
        outs = llm.generate(prompts, GREEDY32)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 32)


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_do_not_change_tokens(tiny_model: Callable[..., Path],
                                          overlap: bool) -> None:
    """Mixed steps (SchedulerConfig.mixed_steps): with three rows for sixteen requests, each
    newcomer's prompt chunks run in the same steps as the others' decodes; tokens unchanged."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(16, seed=4)
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=16, overlap=overlap,
             mixed_steps=True, max_running_requests=3, max_kv_tokens=4096,
             show_progress=False) as llm:
        outs = llm.generate(prompts, GREEDY32)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 32)


# Sliding windows shorter than the prompts: every layer (Mistral, Phi-3, Mixtral), the layers
# from max_window_layers on (Qwen2: layer 1 only), Qwen2-MoE's even layers below it (layer 0).
WINDOWED = {"mistral": dict(sliding_window=8), "phi3": dict(sliding_window=8),
            "mixtral": dict(sliding_window=8),
            "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
            # SmolLM3 slides in its NoPE layers (the fourth) where use_sliding_window says so
            "smollm3": dict(use_sliding_window=True, sliding_window=8),
            "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
            # dots.llm1 slides from layer max_window_layers on (its config's layer_types)
            "dots1": dict(sliding_window=8, max_window_layers=1)}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_windows_match_hf(tiny_model: Callable[..., Path], family: str) -> None:
    """A window of 8 tokens: prompts of 3-23 tokens and 24 new ones each, fresh and chunked (5
    tokens a chunk: each chunk after a prefix longer than the window), then the same prompts
    behind a shared 30-token prefix that the cache holds: the greedy tokens of transformers,
    whose mask keeps the window where the context is longer (none is cut: 512)."""
    path = tiny_model(family, **WINDOWED[family])
    prompts = mixed_prompts(4, seed=6, lengths=(3, 9, 17, 20))
    shared = mixed_prompts(1, seed=7, lengths=(30,))[0]
    later = [shared + p for p in prompts]
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=5, max_kv_tokens=2048,
             show_progress=False) as llm:
        assert llm.max_context == 512
        first = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                     ignore_eos=True))
        llm.generate([shared], SamplingParams(max_tokens=1))
        second = llm.generate(later, SamplingParams(max_tokens=24, temperature=0.0,
                                                    ignore_eos=True))
        assert all(o.num_cached_tokens >= 28 for o in second), [o.num_cached_tokens
                                                                 for o in second]
    assert [o.token_ids for o in first] == hf_greedy(path, prompts, 24)
    assert [o.token_ids for o in second] == hf_greedy(path, later, 24)


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_logit_transforms_match_hf_in_log_probabilities(tiny_model: Callable[..., Path],
                                                        family: str) -> None:
    """Gemma 2's tanh softcaps (scores at 2, logits at 3 on the tiny model) and Granite's
    multipliers (logits divided by 2.5): the greedy tokens (which the scores' cap and the
    other multipliers change) and the log-probabilities (which a monotonic change of the
    logits alone changes: greedy tokens cannot see it) equal transformers'."""
    from hf_reference import hf_logprobs
    path = tiny_model(family)
    prompts = mixed_prompts(3, seed=9, lengths=(4, 19, 33))
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=7, max_kv_tokens=2048,
             show_progress=False) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                    ignore_eos=True, logprobs=2))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 16)
    for prompt, out in zip(prompts, outs):
        ref = hf_logprobs(path, prompt, out.token_ids)
        chosen = ref.gather(1, torch.tensor(out.token_ids).view(-1, 1)).squeeze(1)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(chosen.tolist(), abs=1e-4)


def test_gemma3_multimodal_checkpoint_serves_its_text_decoder(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (Gemma 3 4B-27B): the language model's tensors load from
    under `language_model.model.` (the vision tower's and projector's are skipped) and text
    prompts give transformers' greedy tokens of the whole multimodal model."""
    from tiny_models import build_tiny_gemma3_multimodal
    path = build_tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    prompts = mixed_prompts(3, seed=8, lengths=(5, 19, 33))
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=16, max_kv_tokens=2048,
             show_progress=False) as llm:
        outs = llm.generate(prompts, GREEDY32)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 32)


@pytest.mark.parametrize("tied", [False, True])
def test_mistral3_multimodal_checkpoint_serves_its_text_decoder(tmp_path: Path,
                                                               tied: bool) -> None:
    """Mistral3ForConditionalGeneration (Mistral-Small-3.1 / 3.2): its Mistral text decoder
    loads from under `language_model.` (the Pixtral tower and projector skipped), with the
    fields of its `text_config` (the LM head tied where the top level says so, as
    transformers ties it); text prompts give the multimodal model's greedy tokens."""
    import transformers
    from tiny_models import build_tiny_mistral3_multimodal
    path = build_tiny_mistral3_multimodal(tmp_path / "mistral3", tied=tied)
    prompts = mixed_prompts(3, seed=8, lengths=(5, 19, 33))
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=16, max_kv_tokens=2048,
             show_progress=False) as llm:
        outs = llm.generate(prompts, GREEDY32)
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(path,
                                                                       dtype=torch.float32)
    with torch.no_grad():
        want = [hf.generate(input_ids=torch.tensor([p]), max_new_tokens=32, min_new_tokens=32,
                            do_sample=False, top_k=None, top_p=None,
                            temperature=None)[0, len(p):].tolist() for p in prompts]
    assert [o.token_ids for o in outs] == want


def test_eager_warmup_leaves_no_trace(tiny_model: Callable[..., Path]) -> None:
    """The start-up warm-up (engine/warmup.py; on CUDA at every start) runs its junk batches
    through the spare row and the scratch slot: run here on the CPU, it leaves the tokens of
    later requests and the KV accounting as they were."""
    from minisgl.engine.warmup import warmup_shapes
    path = tiny_model("qwen3", max_position_embeddings=2048)
    prompts = mixed_prompts(4, seed=5)
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=4096, mixed_steps=True,
             show_progress=False) as llm:
        engine = llm._backend.engine  # type: ignore[attr-defined]
        assert len(warmup_shapes(512, engine.max_context)) == 4, engine.max_context
        before = llm.check_accounting()
        engine._warm_up_eager()
        assert llm.check_accounting() == before
        outs = llm.generate(prompts, GREEDY32)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 32)


@pytest.mark.parametrize("tensor,match", [
    ("model.layers.0.self_attn.o_proj.bias", "has no 'bias' .*attention_bias"),
    ("model.layers.1.self_attn.q_proj.bias", "has no 'bias' .*attention_bias"),
    ("model.norm.bias", r"model.norm \(RMSNorm\) has no 'bias'; it has \['weight'\]"),
    ("model.layers.0.input_layernorm.bias", "RMSNorm.* has no 'bias'"),
    ("model.layers.7.mlp.down_proj.weight", "no module model.layers.7.mlp.down_proj .* 2 layers"),
    ("model.layers.0.mlp.act_fn.weight", "no module model.layers.0.mlp.act_fn"),
])
def test_checkpoint_tensor_the_model_lacks_is_refused_naming_it(
        tiny_model: Callable[..., Path], tmp_path: Path, tensor: str, match: str) -> None:
    """A checkpoint tensor with no place in the model the config describes (a bias a layer
    has none of, more layers, an unknown module): a start-up error naming the tensor. Before,
    an RMSNorm loaded a `bias` tensor into its weight without a word, and the others raised
    attribute errors naming no tensor."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny_model("llama")
    dst = tmp_path / "with-bias"
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = load_file(str(files[0]))
    tensors[tensor] = torch.zeros(64)
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint tensor {tensor} has no place.*{match}"):
        LLM(str(dst), device="cpu", show_progress=False, max_kv_tokens=256)


def test_hf_overrides_reach_the_model(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """`hf_overrides` (vLLM's) turn Qwen2's sliding window on in layer 1: the tokens of
    transformers loading a config.json edited alike."""
    import json
    import shutil
    path = tiny_model("qwen2")
    changes = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg.pop("layer_types", None)  # transformers 5 writes them; they would override the change
    (edited / "config.json").write_text(json.dumps({**cfg, **changes}))
    prompts = mixed_prompts(3, seed=10, lengths=(5, 21, 30))
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             hf_overrides={**changes, "layer_types": None}) as llm:
        outs = llm.generate(prompts, GREEDY32)
    want = hf_greedy(edited, prompts, 32)
    assert [o.token_ids for o in outs] == want
    assert want != hf_greedy(path, prompts, 32)  # the override changed the answer
