"""SGLang's return_hidden_states through the scheduler and the engine: each output token's
TokenOut carries the final hidden states it was sampled from (the first token, every prompt
position's), equal to Hugging Face's last hidden states over the prompt and the output but its
last token: with prompts in prefill chunks, overlap scheduling, beside requests that do not
ask, at tp=2, through n-gram verification and through a retraction (the ranks driven as `LLM`
drives them: its backend's submit and poll); `LLM.generate`'s CompletionOutput.hidden_states;
the HTTP shape: test_server_api.py."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

from hf_reference import mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.message import TokenOut, UserMsg
from minisgl.message.tensors import from_wire

ASK = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_hidden_states=True)
PLAIN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _run(llm: LLM, prompts: List[List[int]], params: List[SamplingParams]
         ) -> Dict[int, List[TokenOut]]:
    """Each request's outs, by its index, as the ranks send them."""
    backend = llm._backend  # type: ignore[attr-defined]
    uids = itertools.count(10_000)
    slot = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        uid = next(uids)
        slot[uid] = i
        backend.submit(UserMsg(uid, prompt, p))
    outs: Dict[int, List[TokenOut]] = {i: [] for i in range(len(prompts))}
    while sum(bool(o) and o[-1].finish_reason is not None for o in outs.values()) < len(prompts):
        for out in backend.poll():
            outs[slot[out.uid]].append(out)
    backend.drain()
    return outs


def _rows(outs: List[TokenOut]) -> torch.Tensor:
    return torch.cat([from_wire(o.tensor) for o in outs if o.tensor is not None])


def _hf_states(path: Path, ids: List[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _check(path: Path, prompts: List[List[int]], params: List[SamplingParams],
           outs: Dict[int, List[TokenOut]]) -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        tokens = [o.token for o in outs[i] if o.token >= 0]
        if not p.return_hidden_states:
            assert all(o.tensor is None for o in outs[i])
            continue
        assert outs[i][0].tensor is not None and outs[i][0].tensor.shape[0] == len(prompt)
        got, want = _rows(outs[i]), _hf_states(path, prompt + tokens[:-1])
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-3, rtol=1e-3), i


@pytest.mark.parametrize("tp,chunk,overlap", [(1, 7, True), (2, 8192, False)])
def test_hidden_states_equal_hf(tiny_model: Callable[..., Path], tp: int, chunk: int,
                                overlap: bool) -> None:
    path = tiny_model("llama3")
    prompts = mixed_prompts(4, seed=21, lengths=(9, 20))
    params = [ASK, PLAIN, ASK, PLAIN]
    with LLM(str(path), device="cpu", tp=tp, page_size=4, max_prefill_tokens=chunk,
             overlap=overlap, max_kv_tokens=2048, show_progress=False) as llm:
        _run(llm, prompts, [PLAIN] * 4)  # the prefix cache holds them now: not reused
        outs = _run(llm, prompts, [p.for_engine() for p in params])
    _check(path, prompts, params, outs)


def test_hidden_states_through_verification_and_retraction(tiny_model: Callable[..., Path]
                                                            ) -> None:
    """n-gram drafts (a repetitive prompt: tokens kept a verify step each have their own
    position's state) and a pool small enough to retract (a request prefilled again sends
    only its new token's state)."""
    path = tiny_model("llama3")
    loop = [11, 12, 13, 14] * 6
    prompts = [loop, *mixed_prompts(5, seed=4, lengths=(20, 24))]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             return_hidden_states=True)] * len(prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3}
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=160, max_prefill_tokens=16,
             decode_reserve_tokens=2, speculative_config=spec, max_running_requests=6,
             show_progress=False) as llm:
        outs = _run(llm, prompts, params)
        retracted = llm.check_accounting().retracted_requests
        accepted = llm.stats.spec_accepted_tokens_total
    assert retracted > 0 and accepted > 0
    _check(path, prompts, params, outs)


def test_the_offline_api_gives_them_per_choice(tiny_model: Callable[..., Path]) -> None:
    """CompletionOutput.hidden_states: [prompt + output - 1, hidden], HF's; none unasked."""
    path = tiny_model("llama3")
    prompt = mixed_prompts(1, seed=8, lengths=(12,))[0]
    with LLM(str(path), device="cpu", max_kv_tokens=256, show_progress=False) as llm:
        asked, plain = (llm.generate([prompt], p)[0].outputs[0] for p in (ASK, PLAIN))
    assert plain.hidden_states is None and asked.hidden_states is not None
    want = _hf_states(path, prompt + asked.token_ids[:-1])
    assert torch.allclose(asked.hidden_states, want, atol=1e-3, rtol=1e-3)


def test_too_many_values_are_refused_before_anything_runs() -> None:
    """A prompt's hidden states go out in one message: (prompt + max_tokens) x hidden values
    past 2^24 are refused with the numbers, naming the field."""
    from minisgl.core import Limits, RequestError, check_request
    limits = Limits(100_000, 1000, 10_000, 16, 8192, hidden_size=4096)
    check_request([1] * 3000, SamplingParams(max_tokens=1000, return_hidden_states=True), limits)
    with pytest.raises(RequestError, match="4000 prompt tokens \\+ max_tokens 200 would send "
                                           "17203200 values") as e:
        check_request([1] * 4000, SamplingParams(max_tokens=200, return_hidden_states=True),
                      limits)
    assert e.value.param == "return_hidden_states"
    check_request([1] * 4000, SamplingParams(max_tokens=200), limits)  # not asked: no limit
