"""Beam search (vLLM's `LLM.beam_search`): Hugging Face's beams on a random tiny model, the
search's bookkeeping (EOS, length penalty) step by step, and bad parameters refused by name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from minisgl import LLM, BeamSearchParams
from minisgl.beam_search import BeamSearch, BeamSearchSequence, beam_score

PROMPTS = [[15, 300, 2000, 7], [42, 4242, 99, 1000, 5, 6, 7]]


def _hf_beams(model_dir: Path, prompts: List[List[int]], width: int, new_tokens: int
              ) -> List[List[List[int]]]:
    """HF's beam search with no EOS (every beam runs to `new_tokens`), best first, per
    prompt."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    beams = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), num_beams=width,
                                 num_return_sequences=width, max_new_tokens=new_tokens,
                                 do_sample=False, top_k=None, top_p=None, temperature=None,
                                 early_stopping=False, pad_token_id=0)
            beams.append([row.tolist() for row in out])
    return beams


def test_beams_are_hugging_faces(tiny_model: Callable[..., Path]) -> None:
    """Without EOS every beam has the same length, so any length penalty ranks them as HF
    does: the same beams in the same order, and each one's cumulative log-probability is the
    sum of its tokens' (HF's own scores, recomputed)."""
    model = tiny_model("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    with LLM(str(model), device="cpu", max_kv_tokens=2048, page_size=4,
             show_progress=False) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert llm.check_accounting().live_requests == 0
    for prompt, out, hf in zip(PROMPTS, outs, _hf_beams(model, PROMPTS, 3, 5)):
        assert [s.tokens for s in out.sequences] == hf
        for seq in out.sequences:
            assert len(seq.logprobs) == 5 and seq.finish_reason == "length"
            chosen = [step[t].logprob for step, t in zip(seq.logprobs, seq.tokens[len(prompt):])]
            assert seq.cum_logprob == pytest.approx(sum(chosen), abs=1e-5)
        assert out.sequences[0].cum_logprob >= out.sequences[-1].cum_logprob


def test_eos_completes_a_beam_and_length_penalty_ranks() -> None:
    """A beam extended by EOS is complete (not grown further, its EOS not counted in its
    length); live beams keep the beam_width best extensions; the final ranking divides by
    length ** length_penalty."""
    eos = 2
    search = BeamSearch([9, 9], BeamSearchParams(beam_width=2, max_tokens=3,
                                                 length_penalty=1.0), [eos])
    search.step([((eos, 5, 6, 7), (-0.1, -0.5, -0.7, -3.0))])
    assert [b.tokens for b in search.live] == [[9, 9, 5], [9, 9, 6]]
    assert [b.tokens for b in search.complete] == [[9, 9, eos]]
    assert search.complete[0].finish_reason == "stop"
    search.step([((8, 3), (-0.2, -0.3)), ((8, 3), (-0.05, -2.0))])
    assert [b.tokens for b in search.live] == [[9, 9, 5, 8], [9, 9, 6, 8]]  # -0.7, -0.75
    # scores: [9, 9, 2] -0.1 / 2 (EOS not counted); [9, 9, 5, 8] -0.7 / 4
    assert [b.tokens for b in search.best()] == [[9, 9, eos], [9, 9, 5, 8]]
    longer = BeamSearchSequence([1, 2, 3, 4], [], -1.0)
    assert beam_score(longer, [eos], 2.0) == pytest.approx(-1.0 / 16)
    ignoring = BeamSearch([9], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True),
                          [eos])
    ignoring.step([((eos, 5), (-0.1, -0.5))])
    assert [b.tokens for b in ignoring.live] == [[9, eos]] and not ignoring.complete
    with pytest.raises(ValueError, match="1 candidate lists for 2 live beams"):
        search.step([((1,), (-1.0,))])


def test_bad_params_are_refused_by_name_and_nothing_is_held(default_model_dir: Path) -> None:
    """beam_width and max_tokens below 1, more log-probabilities a step than max_logprobs, a
    prompt whose beams outgrow the context: ValueError with the numbers; the engine serves on.
    A text prompt's beams come back decoded, prompt included (vLLM's offline text)."""
    with LLM(None, device="cpu", max_kv_tokens=1024, page_size=4, max_model_len=64,
             max_logprobs=6, show_progress=False) as llm:
        for params, words in ((BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
                              (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
                              (BeamSearchParams(beam_width=4, max_tokens=4),
                               "needs 8 log-probabilities a step; max_logprobs is 6"),
                              (BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1),
                               "temperature")):
            with pytest.raises(ValueError, match=words):
                llm.beam_search(["Hi"], params)
        with pytest.raises(ValueError, match="prompt 0: 60 tokens \\+ max_tokens 8 exceed the "
                                             "context of 64"):
            llm.beam_search([[5] * 60], BeamSearchParams(beam_width=2, max_tokens=8))
        with pytest.raises(ValueError, match="one value per prompt \\(1\\), got 2"):
            llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=2),
                            lora_request=[None, None])
        out = llm.beam_search(["The capital of France is"],
                              BeamSearchParams(beam_width=3, max_tokens=4))[0]
        assert len(out.sequences) == 3
        assert all(s.text.startswith("The capital of France is") for s in out.sequences)
        scores = [beam_score(s, llm.model_config.eos_token_ids, 1.0) for s in out.sequences]
        assert scores == sorted(scores, reverse=True) and all(math.isfinite(x) for x in scores)
        assert llm.check_accounting().live_requests == 0
