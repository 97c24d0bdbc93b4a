"""Log-probabilities (SamplingParams.logprobs) equal Hugging Face's log_softmax of its logits
(float32, CPU): for greedy and sampled requests, mixed in batches with requests that ask for
none, through chunked prefill and overlap scheduling; the detokenizer renders their tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from hf_reference import hf_logprobs, mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.core import TokenLogprobs
from minisgl.message.types import DetokenizeInit, TokenOut
from minisgl.tokenizer.detokenize_worker import Detokenizer

TOL = 1e-4


@pytest.mark.parametrize("overlap,chunk,mixed", [(False, 8192, False), (True, 16, True)])
def test_logprobs_equal_hf(tiny_model: Callable[..., Path], overlap: bool, chunk: int,
                           mixed: bool) -> None:
    """Also with mixed steps: prompts chunked at 16 tokens, the ones already answered decode
    alongside the others' chunks."""
    path = tiny_model("llama")
    prompts = mixed_prompts(6, seed=3)
    # Greedy with 5 alternatives, sampled (raw logprobs: before temperature) with none, and
    # requests asking for nothing, in the same batches.
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=chunk, overlap=overlap,
             mixed_steps=mixed, max_kv_tokens=4096, show_progress=False) as llm:
        outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        if p.logprobs is None:
            assert out.logprobs is None
            continue
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
        ref = hf_logprobs(path, prompt, out.token_ids)
        chosen = ref.gather(1, torch.tensor(out.token_ids).view(-1, 1)).squeeze(1)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(chosen.tolist(), abs=TOL)
        _check_ranks([lp.rank for lp in out.logprobs], ref, chosen)
        top_values, top_ids = ref.topk(p.logprobs, dim=-1)
        for lp, ids, values in zip(out.logprobs, top_ids.tolist(), top_values.tolist()):
            assert list(lp.top_ids) == ids
            assert list(lp.top_logprobs) == pytest.approx(values, abs=TOL)
        if p.is_greedy:  # the sampled token is the most likely one
            assert all(lp.top_ids[0] == t for lp, t in zip(out.logprobs, out.token_ids))


def test_bad_logprobs_are_refused_with_the_numbers(tiny_model: Callable[..., Path]) -> None:
    with LLM(str(tiny_model("llama")), max_kv_tokens=1024, show_progress=False) as llm:
        for bad in (-1, True, 2.0):
            with pytest.raises(ValueError, match=r"logprobs must be an integer >= 0"):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=bad))  # type: ignore[arg-type]
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's default cap, 20
            with pytest.raises(ValueError, match=rf"{name} asks for the 21 most likely tokens, "
                                                 rf"more than this engine returns "
                                                 rf"\(max_logprobs 20\)"):
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{name: 21}))
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=20))[0]
        assert out.logprobs is not None and all(len(lp.top_ids) == 20 for lp in out.logprobs)


@pytest.mark.parametrize("cap", [64, -1])
def test_max_logprobs_raises_the_cap(tiny_model: Callable[..., Path], cap: int) -> None:
    """vLLM's max_logprobs: more alternatives than 20 where configured, the same values as the
    full distribution's top k; -1 lets a request ask for the whole vocabulary and no more."""
    path = tiny_model("llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    k = vocab if cap == -1 else cap
    with LLM(str(path), max_kv_tokens=1024, show_progress=False, max_logprobs=cap) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=k,
                                                       prompt_logprobs=k))[0]
        assert out.logprobs is not None and all(len(lp.top_ids) == k for lp in out.logprobs)
        assert out.prompt_token_logprobs is not None
        assert all(len(lp.top_ids) == k for lp in out.prompt_token_logprobs)
        first = out.logprobs[0]
        assert list(first.top_logprobs) == sorted(first.top_logprobs, reverse=True)
        if cap == -1:  # every token once: the probabilities sum to one
            assert sorted(first.top_ids) == list(range(vocab))
            assert sum(math.exp(v) for v in first.top_logprobs) == pytest.approx(1.0, abs=1e-4)
        with pytest.raises(ValueError, match=rf"asks for the {k + 1} most likely tokens.*"
                                             rf"max_logprobs {k}"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=k + 1))


def test_detokenizer_renders_logprob_tokens(default_model_dir: Path) -> None:
    from minisgl.tokenizer.text import load_tokenizer
    tok = load_tokenizer(default_model_dir)
    paris, the = tok.encode(" Paris", add_special_tokens=False)[0], tok.encode(
        " the", add_special_tokens=False)[0]
    det = Detokenizer(tok)
    det.init(DetokenizeInit(uid=1, prompt_tail=[]))
    lp = TokenLogprobs(-0.25, (paris, the), (-0.25, -2.5))
    first, second = det.render([TokenOut(1, paris, logprobs=lp), TokenOut(1, the)]).chunks
    assert first.token_ids == [paris] and first.text == " Paris"
    assert second.logprobs == []  # that token came without logprobs
    (entry,) = first.logprobs
    assert (entry.token, entry.logprob) == (" Paris", -0.25)
    assert entry.top_tokens == (" Paris", " the") and entry.top_logprobs == (-0.25, -2.5)

    bare = Detokenizer(None)  # a model without tokenizer files: ids as names
    bare.init(DetokenizeInit(uid=2, prompt_tail=[]))
    (chunk,) = bare.render([TokenOut(2, 9, finish_reason="length",
                                     logprobs=TokenLogprobs(-1.0, (9,), (-1.0,)))]).chunks
    assert chunk.logprobs[0].token == "token_id:9" and chunk.logprobs[0].top_tokens == (
        "token_id:9",)


@pytest.mark.parametrize("chunk", [8192, 7])
def test_prompt_logprobs_equal_hf(tiny_model: Callable[..., Path], chunk: int) -> None:
    """Every prompt token after the first: its log-probability given those before it, and the
    top k there, as HF computes them; across prefill chunks of 7 tokens, and for a prompt the
    prefix cache holds (such a request skips the cache: cached tokens have no logits)."""
    path = tiny_model("llama")
    prompts = mixed_prompts(3, seed=5, lengths=(9, 30, 17))
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
              for k in (0, 3, None)]
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=chunk, max_kv_tokens=4096,
             show_progress=False) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=1))  # now the cache holds them
        outs = llm.generate(prompts, params)
    assert outs[2].prompt_token_logprobs is None and outs[2].prompt_logprobs is None
    assert outs[2].cached_tokens > 0
    for prompt, p, out in zip(prompts[:2], params, outs):
        lps = out.prompt_token_logprobs
        assert out.cached_tokens == 0 and lps is not None
        assert len(lps) == len(prompt) - 1
        ref = hf_logprobs(path, prompt[:1], prompt[1:])  # position q predicts prompt[q + 1]
        chosen = ref.gather(1, torch.tensor(prompt[1:]).view(-1, 1)).squeeze(1)
        assert [lp.logprob for lp in lps] == pytest.approx(chosen.tolist(), abs=TOL)
        _check_ranks([lp.rank for lp in lps], ref, chosen)
        top_values, top_ids = ref.topk(p.prompt_logprobs or 0, dim=-1)
        assert [list(lp.top_ids) for lp in lps] == top_ids.tolist()
        for lp, values in zip(lps, top_values.tolist()):
            assert list(lp.top_logprobs) == pytest.approx(values, abs=TOL)
        _check_vllm_shape(out.prompt_logprobs, prompt, lps)


def _check_vllm_shape(entries: Optional[List[Optional[Dict[int, Any]]]], prompt: List[int],
                      lps: List[TokenLogprobs]) -> None:
    """vLLM's RequestOutput.prompt_logprobs, which lm-eval-harness reads for log-likelihoods:
    one entry per prompt token, None first, then {id: Logprob} with the prompt token first
    and the top k after it, ranks counted from 1."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for token, entry, lp in zip(prompt[1:], entries[1:], lps):
        assert entry is not None and next(iter(entry)) == token
        assert (entry[token].logprob, entry[token].rank) == (lp.logprob, lp.rank)
        assert set(entry) == {token, *lp.top_ids}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            assert entry[t].logprob == (lp.logprob if t == token else v)
            assert entry[t].rank == (lp.rank if t == token else rank)


def _check_ranks(ranks: List[Optional[int]], ref: torch.Tensor, chosen: torch.Tensor) -> None:
    """Each token's rank (1: the most likely) is HF's, up to tokens within float noise of it."""
    above = (ref > chosen.unsqueeze(1) + TOL).sum(dim=-1) + 1
    at_least = (ref >= chosen.unsqueeze(1) - TOL).sum(dim=-1)
    for rank, low, high in zip(ranks, above.tolist(), at_least.tolist()):
        assert rank is not None and low <= rank <= high


def test_prompt_logprobs_survive_retraction(tiny_model: Callable[..., Path]) -> None:
    """A request retracted before its first token computes its prompt again from the start:
    its prompt log-probabilities are each prompt token's once, as without retraction."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(12, seed=13, lengths=(20, 24))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    runs = []
    for kv, reserve in ((4096, None), (400, 4)):
        with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=kv, max_running_requests=12,
                 max_prefill_tokens=16, overlap=True, decode_reserve_tokens=reserve,
                 show_progress=False) as llm:
            runs.append(llm.generate(prompts, params))
            retracted = llm.check_accounting().retracted_requests
    assert retracted > 0
    for calm, pressed, prompt in zip(*runs, prompts):
        assert pressed.token_ids == calm.token_ids
        again, once = pressed.prompt_token_logprobs, calm.prompt_token_logprobs
        assert again is not None and once is not None and len(again) == len(prompt) - 1
        assert [lp.logprob for lp in again] == pytest.approx([lp.logprob for lp in once],
                                                             abs=TOL)


ASKED = (5, 17, 300, 5, 1023)  # SGLang's token_ids_logprob: any ids, repeats too


def test_token_ids_logprob_equal_hf(tiny_model: Callable[..., Path]) -> None:
    """SGLang's token_ids_logprob: at every output position, and at every prompt position
    where prompt log-probabilities are asked, those ids' log-probabilities as HF computes
    them, in the order asked; prefill chunks of 7, overlap on, beside requests asking other
    ids or none."""
    path = tiny_model("llama")
    prompts = mixed_prompts(3, seed=11, lengths=(9, 30, 17))
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0,
                             prompt_logprobs=0, token_ids_logprob=list(ASKED)),
              SamplingParams(max_tokens=6, temperature=0.7, seed=3, ignore_eos=True,
                             logprobs=2, token_ids_logprob=[9]),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)]
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=7, max_kv_tokens=4096,
             overlap=True, show_progress=False) as llm:
        outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.logprobs is not None
        ref = hf_logprobs(path, prompt, out.token_ids)[:, list(p.token_ids_logprob)]
        assert [list(lp.ids_logprobs) for lp in out.logprobs] == [
            pytest.approx(row, abs=TOL) for row in ref.tolist()]
    lps = outs[0].prompt_token_logprobs
    assert lps is not None
    ref = hf_logprobs(path, prompts[0][:1], prompts[0][1:])[:, list(ASKED)]
    assert [list(lp.ids_logprobs) for lp in lps] == [pytest.approx(row, abs=TOL)
                                                      for row in ref.tolist()]


def test_token_ids_logprob_refusals(tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="token_ids_logprob needs logprobs"):
        SamplingParams(token_ids_logprob=[3]).validate()
    with pytest.raises(ValueError, match="at most 256 token ids, got 257"):
        SamplingParams(logprobs=0, token_ids_logprob=list(range(257))).validate()
    with pytest.raises(ValueError, match="token_ids_logprob must be a list of token ids"):
        SamplingParams(logprobs=0, token_ids_logprob=[-1]).validate()
    with LLM(str(tiny_model("llama")), device="cpu", max_kv_tokens=1024,
             show_progress=False) as llm:
        with pytest.raises(ValueError, match="token_ids_logprob token id 99999 is outside "
                                             "the vocabulary"):
            llm.generate([[1, 2]], SamplingParams(logprobs=0, token_ids_logprob=[99999]))
