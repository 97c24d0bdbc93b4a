"""Speculative decoding with a draft model (engine/draft.py; vLLM's speculative_config
{"model": ...}, SGLang's STANDALONE): the tokens are plain decoding's whatever the draft
proposes, and the draft's K/V follow the target's through chunked prefills, the prefix cache
and retraction (a draft that is the target itself keeps nearly every draft only if its K/V are
there wherever the target's are)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, List

import pytest

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.speculative import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _spec(draft: Path, k: int = 3) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k}


def _kept_share(llm: LLM) -> float:
    stats = llm.stats
    assert stats.verify_steps_total > 0 and stats.spec_draft_tokens_total > 0, stats
    return stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_draft_model_gives_hf_greedy_tokens(tiny_model: Callable[..., Path], draft: str) -> None:
    """A tiny Llama drafted for by itself (nearly every draft kept) and by a Qwen3 of a
    smaller vocabulary (random weights: few kept; prompt tokens past its vocabulary read as its
    last): Hugging Face's greedy tokens either way, the pool balanced after the rejected
    drafts' slots were written and dropped."""
    path = tiny_model("llama")
    prompts = mixed_prompts(4, seed=1)  # token ids up to 40,000
    other = tiny_model("qwen3", vocab_size=20000)
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             speculative_config=_spec(path if draft == "itself" else other)) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        kept = _kept_share(llm)
        accounting = llm.check_accounting()
    assert tokens == hf_greedy(path, prompts, 24)
    assert kept > 0.9 if draft == "itself" else kept < 0.5, kept
    assert accounting.live_requests == accounting.reserved_pages == 0
    assert accounting.free_rows == accounting.total_rows


def test_draft_kv_follows_chunks_the_prefix_cache_and_retraction(
        tiny_model: Callable[..., Path]) -> None:
    """Prompts prefilled in 16-token chunks, then again with variants sharing their prefixes
    (prefix cache hits), in a pool small enough that requests are retracted and come back:
    plain decoding's greedy tokens, and a self-draft still keeps nearly every draft (its K/V
    were there for the cached prefixes, the chunks and the requests prefilled again)."""
    path = tiny_model("llama")
    rng = random.Random(3)
    base = mixed_prompts(8, seed=7, lengths=(20, 50))
    again = base + [p[:rng.randint(10, len(p))] + p[:5] for p in base]
    params = [SamplingParams(max_tokens=rng.randint(30, 40), temperature=0.0, ignore_eos=True)
              for _ in again]
    runs: List[List[List[int]]] = []
    for spec in (None, _spec(path, 4)):
        with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=320,
                 max_running_requests=16, decode_reserve_tokens=4, max_prefill_tokens=16,
                 speculative_config=spec, show_progress=False) as llm:
            runs.append([o.token_ids for o in llm.generate(base, params[:8])]
                        + [o.token_ids for o in llm.generate(again, params)])
            stats = llm.stats
            accounting = llm.check_accounting()
            if spec is not None:
                kept = _kept_share(llm)
                assert stats.retracted_requests_total > 0 and stats.cached_tokens_total > 0, \
                    stats
        assert accounting.live_requests == accounting.reserved_pages == 0
    assert runs[0] == runs[1]
    assert kept > 0.9, kept


def test_seeded_sampling_and_logit_edits_give_plain_decodings_tokens(
        tiny_model: Callable[..., Path]) -> None:
    """Random sampling (seeded), top-p, penalties, logit bias, allowed tokens and
    log-probabilities: the tokens plain decoding gives; and a self-draft, each draft sampled
    from the target's edits of its logits with the noise the verify will use at its position,
    keeps nearly all of them (measured: 1.0; 0.49 with the edits left out of the draft; argmax
    drafts kept none at temperature 0.8: the tiny model's distributions are nearly flat)."""
    path = tiny_model("llama")
    prompts = mixed_prompts(6, seed=11, lengths=(8, 30))
    edits = [{}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.3},
             {"logit_bias": {100: 3.0, 200: -5.0}}, {"allowed_token_ids": tuple(range(50, 900))},
             {"presence_penalty": 0.4, "min_tokens": 12}]
    params = [SamplingParams(max_tokens=20, temperature=t, top_p=0.9, seed=i, logprobs=2,
                             ignore_eos=True, **edit)  # type: ignore[arg-type]
              for i, (t, edit) in enumerate(zip((0.7, 1.0, 0.0, 0.8, 0.9, 0.0), edits))]
    runs = []
    for spec in (None, _spec(path, 3)):
        with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=1024,
                 speculative_config=spec, show_progress=False) as llm:
            outs = llm.generate(prompts, params)
            runs.append([o.token_ids for o in outs])
            assert all(o.logprobs is not None for o in outs)
            if spec is not None:
                kept = _kept_share(llm)
    assert runs[0] == runs[1]
    assert all(50 <= t < 900 for t in runs[0][4])
    assert kept > 0.95, kept


def test_steps_past_disable_by_batch_size_keep_the_draft_kv(
        tiny_model: Callable[..., Path]) -> None:
    """Past disable_by_batch_size running requests no step drafts, but the draft still runs
    over every decode step: once the batch has shrunk, a self-draft keeps nearly every draft
    (its K/V of the tokens decoded meanwhile are there), and the tokens are plain decoding's."""
    path = tiny_model("llama")
    prompts = mixed_prompts(4, seed=13, lengths=(6, 20))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (6, 8, 10, 40)]
    spec = {**_spec(path, 3), "disable_by_batch_size": 1}
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=1024, speculative_config=spec,
             show_progress=False) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        kept = _kept_share(llm)
    assert tokens == [t[:n] for t, n in zip(hf_greedy(path, prompts, 40), (6, 8, 10, 40))]
    assert kept > 0.9, kept


def test_tp2_drafts_in_lockstep(tiny_model: Callable[..., Path]) -> None:
    """The draft split over two ranks as the target is: every rank proposes the same drafts
    (lockstep checked each step), and tp=2 gives tp=1's greedy tokens."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(3, seed=5, lengths=(9, 30))
    with LLM(str(path), device="cpu", tp=2, page_size=4, max_kv_tokens=1024,
             speculative_config=_spec(path), check_lockstep=True, show_progress=False) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(path, prompts, 24)


def test_draft_model_settings_name_what_is_wrong(tiny_model: Callable[..., Path]) -> None:
    """vLLM's {"model": ...} (method draft_model implied) and SGLang's STANDALONE with its
    draft path; what does not fit is refused by name, at the settings or at start-up."""
    assert SpeculativeConfig.parse('{"model": "d", "num_speculative_tokens": 3}') \
        == SpeculativeConfig(3, model="d")
    cfg = SchedulerConfig(speculative_config=json.dumps(
        {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}))
    assert cfg.draft_model_path == "d" and cfg.verify_tokens == 3
    assert SchedulerConfig(speculative_config=json.dumps(  # vLLM's key, at the target's tp
        {"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    ).speculative == SpeculativeConfig(2, model="d", draft_tensor_parallel_size=1)
    standalone = SchedulerConfig(speculative_algorithm="STANDALONE",
                                 speculative_draft_model_path="d",
                                 speculative_num_draft_tokens=4)
    assert standalone.speculative == SpeculativeConfig(3, model="d")
    assert SchedulerConfig(speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 2})).draft_model_path is None
    bad = [({"speculative_config": '{"method": "draft_model", "num_speculative_tokens": 2}'},
            "draft_model needs \"model\""),
           ({"speculative_config": '{"model": "d", "num_speculative_tokens": 2, '
                                   '"prompt_lookup_min": 2}'}, "prompt_lookup_min is n-gram"),
           ({"speculative_config": '{"model": "d"}'}, "num_speculative_tokens must be"),
           ({"speculative_algorithm": "STANDALONE", "speculative_num_draft_tokens": 3},
            "STANDALONE needs speculative_draft_model_path"),
           ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3,
             "speculative_draft_model_path": "d"}, "is a draft model's or head's"),
           ({"speculative_draft_model_path": "d"}, "needs speculative_algorithm"),
           ({"speculative_config": '{"model": "d", "num_speculative_tokens": 2, '
                                   '"draft_tensor_parallel_size": 2}'},
            "draft_tensor_parallel_size 2: the draft model is split over the target's 1"),
           ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2, '
                                   '"draft_tensor_parallel_size": 1}'},
            "draft_tensor_parallel_size is a draft model's")]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**kw)  # type: ignore[arg-type]
    path = tiny_model("llama")
    pages = []
    for spec in (None, _spec(path)):  # the draft's pool takes its share of the same budget
        with LLM(str(path), device="cpu", page_size=4, kv_cache_memory=409600,
                 speculative_config=spec, show_progress=False) as llm:
            pages.append(llm.check_accounting().pages.total)
    assert pages == [200, 100]  # 2,048 bytes a page of the tiny Llama's K/V, twice with itself
    with pytest.raises(ValueError, match="enable_sleep_mode with a draft model"):
        LLM(str(path), device="cpu", max_kv_tokens=256, enable_sleep_mode=True,
            speculative_config=_spec(path), show_progress=False)
    short = tiny_model("llama", max_position_embeddings=256)  # the target's: 512
    with pytest.raises(ValueError, match="context length of 256 tokens, below the served 512: "
                                         "give max_model_len 256 or less"):
        LLM(str(path), device="cpu", max_kv_tokens=256, speculative_config=_spec(short),
            show_progress=False)
    with LLM(str(path), device="cpu", max_kv_tokens=256, max_model_len=256,
             speculative_config=_spec(short), show_progress=False) as llm:
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 24
    odd = tiny_model("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(RuntimeError, match=r"draft model .*cannot split 3 attention heads "
                                           r"over tp=2"):
        LLM(str(path), device="cpu", tp=2, max_kv_tokens=256, speculative_config=_spec(odd),
            show_progress=False)
    with pytest.raises(FileNotFoundError, match="not a directory with a config.json"):
        LLM(str(path), device="cpu", max_kv_tokens=256, show_progress=False,
            speculative_config=_spec(path / "nowhere"))
