"""Repetition, frequency and presence penalties give Hugging Face's greedy tokens (float32, CPU)
with the same penalties: HF's repetition processor, and an independent frequency / presence
processor (tests/hf_reference.py); also mixed with unpenalized requests, through chunked prefill,
overlap scheduling, prefix-cache hits and retraction. Also the other logit edits: logit_bias,
allowed_token_ids, min_tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import pytest
import torch

from hf_reference import hf_greedy, hf_logprobs, mixed_prompts
from minisgl import LLM, SamplingParams

PENALTIES = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8},  # below 1: rewards repeats
    {"frequency_penalty": 1.5},
    {"presence_penalty": -1.0, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.2, "frequency_penalty": 0.7, "presence_penalty": 0.4},
]


def _params(penalty: Dict[str, float]) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **penalty)


@pytest.mark.parametrize("penalty", PENALTIES, ids=[str(p) for p in PENALTIES])
def test_penalties_match_hf(tiny_model: Callable[..., Path], penalty: Dict[str, float]) -> None:
    path = tiny_model("llama")
    prompts = mixed_prompts(4, seed=4, lengths=(3, 17, 40))
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # Penalized and plain requests share batches; chunks of 16 split the longer prompts.
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=16, overlap=True,
             max_kv_tokens=4096, show_progress=False) as llm:
        outs = llm.generate(prompts + prompts, [_params(penalty)] * 4 + [plain] * 4)
    assert [o.token_ids for o in outs[:4]] == hf_greedy(path, prompts, 24, **penalty)
    assert [o.token_ids for o in outs[4:]] == hf_greedy(path, prompts, 24)
    assert [o.token_ids for o in outs[:4]] != [o.token_ids for o in outs[4:]]


def test_default_model_repetition_penalty_matches_hf(default_model_dir: Path) -> None:
    """16 tokens: the 19th is EOS, which HF's min_new_tokens would forbid (ignore_eos here)."""
    from minisgl.tokenizer.text import load_tokenizer
    ids = load_tokenizer(default_model_dir).encode("List the numbers: one, two, one, two, one,",
                                                   add_special_tokens=False)
    penalty = {"repetition_penalty": 1.5, "frequency_penalty": 0.3}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **penalty)
    with LLM(str(default_model_dir), device="cpu", page_size=4, max_kv_tokens=2048,
             show_progress=False) as llm:
        first, again = (llm.generate([ids], params)[0] for _ in range(2))
    assert again.cached_tokens > 0  # the second run starts from the prefix cache
    assert first.token_ids == again.token_ids == hf_greedy(default_model_dir, [ids], 16,
                                                           **penalty)[0]


def test_penalties_survive_retraction(tiny_model: Callable[..., Path]) -> None:
    """A retracted request comes back with its outputs so far: its counts are rebuilt from
    them, so the tokens are those of a run without retraction."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(12, seed=12, lengths=(20, 24))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            frequency_penalty=0.8, repetition_penalty=1.1)
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=400, max_running_requests=12,
             overlap=True, decode_reserve_tokens=4, show_progress=False) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        retracted = llm.check_accounting().retracted_requests
        assert retracted > 0
        assert llm.stats is not None and llm.stats.retracted_requests_total == retracted
    assert got == hf_greedy(path, prompts, 40, repetition_penalty=1.1, frequency_penalty=0.8)


@pytest.mark.parametrize("field,value,message", [
    ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    ("frequency_penalty", float("inf"), r"frequency_penalty must be a number in \[-2, 2\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a finite number > 0, got 0.0"),
])
def test_bad_penalties_are_refused(tiny_model: Callable[..., Path], field: str, value: float,
                                   message: str) -> None:
    with LLM(str(tiny_model("llama")), max_kv_tokens=1024, show_progress=False) as llm:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{field: value}))


def test_logit_bias_moves_the_choice(tiny_model: Callable[..., Path]) -> None:
    """+100 forces a token at every step (sampled at temperature 0.9); -100 on the greedy
    choice makes the raw runner-up win; an unbiased request in the same batch stays HF's."""
    path = tiny_model("llama")
    prompts = mixed_prompts(2, seed=21)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(path), device="cpu", page_size=4, overlap=True, max_kv_tokens=2048,
             show_progress=False) as llm:
        plain = llm.generate(prompts, greedy)
        top = plain[0].logprobs[0].top_ids  # type: ignore[index]
        forced, banned, same = llm.generate([prompts[0], prompts[0], prompts[1]], [
            SamplingParams(max_tokens=6, temperature=0.9, seed=1, ignore_eos=True,
                           logit_bias={77: 100.0}),
            SamplingParams(max_tokens=1, temperature=0.0, logit_bias={top[0]: -100.0}),
            greedy])
    assert forced.token_ids == [77] * 6
    assert banned.token_ids == [top[1]]
    assert same.token_ids == plain[1].token_ids == hf_greedy(path, prompts[1:], 6)[0]


def test_bad_logit_bias_is_refused_with_the_numbers(tiny_model: Callable[..., Path]) -> None:
    with LLM(str(tiny_model("llama")), max_kv_tokens=1024, show_progress=False) as llm:
        vocab = llm.vocab_size
        with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the "
                                             rf"vocabulary \[0, {vocab}\)"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
        with pytest.raises(ValueError, match=r"values must be numbers in \[-100, 100\], got 101"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2, logit_bias={3: 101}))


def test_allowed_token_ids_mask_the_choice(tiny_model: Callable[..., Path]) -> None:
    """Greedy picks the allowed token HF ranks highest, random sampling stays inside its list,
    the log-probabilities stay the model's own (before the mask), and a request without a
    list in the same batch is HF's."""
    path = tiny_model("llama")
    prompts = mixed_prompts(3, seed=23)
    allowed = (77, 300, 1234, 5000)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1,
                             allowed_token_ids=allowed),
              SamplingParams(max_tokens=6, temperature=3.0, seed=2, ignore_eos=True,
                             allowed_token_ids=list(allowed[:2])),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    with LLM(str(path), device="cpu", page_size=4, overlap=True, max_kv_tokens=2048,
             show_progress=False) as llm:
        greedy, sampled, plain = llm.generate(prompts, params)
        for bad, words in (((), "must not be empty"), ((5, -2), "-2"),
                           ((5, llm.vocab_size, llm.vocab_size + 7),
                            f"allowed_token_ids token ids {llm.vocab_size}, "
                            f"{llm.vocab_size + 7} are outside the vocabulary")):
            with pytest.raises(ValueError, match="allowed_token_ids") as e:
                llm.generate([[5, 6]], SamplingParams(max_tokens=2, allowed_token_ids=bad))
            assert words in str(e.value)
    ref = hf_logprobs(path, prompts[0], greedy.token_ids)
    best = ref[:, list(allowed)].argmax(dim=-1).tolist()
    assert greedy.token_ids == [allowed[i] for i in best]
    chosen = ref.gather(1, torch.tensor(greedy.token_ids).view(-1, 1)).squeeze(1)
    assert [lp.logprob for lp in greedy.logprobs] == pytest.approx(  # type: ignore[union-attr]
        chosen.tolist(), abs=1e-4)
    assert set(sampled.token_ids) <= set(allowed[:2])
    assert plain.token_ids == hf_greedy(path, prompts[2:], 6)[0]


def test_min_tokens_holds_back_eos_as_hf_min_new_tokens(default_model_dir: Path) -> None:
    """min_tokens forbids EOS (and stop_token_ids) until that many tokens are out, as HF's
    min_new_tokens does; afterwards EOS ends the request as usual."""
    import torch
    from hf_reference import _hf_model
    from minisgl.tokenizer.text import load_tokenizer
    tok = load_tokenizer(default_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with LLM(str(default_model_dir), device="cpu", max_kv_tokens=2048, show_progress=False) as llm:
        free, held = llm.generate([ids, ids], [
            SamplingParams(max_tokens=48, temperature=0.0),
            SamplingParams(max_tokens=48, temperature=0.0, min_tokens=30)])
    assert free.finish_reason == "stop" and len(free.token_ids) < 30  # stops early by itself
    assert len(held.token_ids) >= 30 and held.token_ids[:len(free.token_ids) - 1] == \
        free.token_ids[:-1]
    model = _hf_model(default_model_dir)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=30,  # type: ignore[operator]
                             do_sample=False, top_k=None, top_p=None, temperature=None)
    ref_ids = ref[0, len(ids):].tolist()
    assert held.token_ids == ref_ids[:len(held.token_ids)] and held.finish_reason == (
        "stop" if len(held.token_ids) < 48 else "length")
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens = 4\]"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()
