"""Sampling semantics against Hugging Face's logits warpers, and SamplingParams taking what
vLLM's users write (lists, a single stop string, None) while naming every bad value."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.sampler import (SamplingTensors, _filter, make_sampling_tensors,
                                    request_seed, sample)


def _tensors(rows: int, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
             temperature: float = 1.0) -> SamplingTensors:
    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)
    return SamplingTensors(full(temperature, torch.float32), full(top_k, torch.int64),
                           full(top_p, torch.float32), full(min_p, torch.float32),
                           torch.arange(rows, dtype=torch.int64), full(0, torch.int64),
                           full(False, torch.bool), False, True)


@pytest.mark.parametrize("top_k,top_p,min_p", [(8, 0.5, 0.0), (3, 0.9, 0.0), (-1, 0.7, 0.0),
                                               (20, 0.8, 0.05), (5, 1.0, 0.3)])
def test_filters_keep_what_hf_warpers_keep(top_k: int, top_p: float, min_p: float) -> None:
    """top-k, then top-p over what top-k leaves (renormalized), then min-p: Hugging Face's
    warper order, which vLLM follows (top-p over the whole distribution kept tokens that both
    drop)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(top_k + 100)) * 3
    ref = logits.clone()
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)  # type: ignore[arg-type]
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)  # type: ignore[arg-type]
    if min_p > 0:
        ref = MinPLogitsWarper(min_p)(None, ref)  # type: ignore[arg-type]
    got = _filter(logits, _tensors(16, top_k, top_p, min_p))
    assert torch.equal(got.isfinite(), ref.isfinite())
    assert torch.equal(got[got.isfinite()], logits[got.isfinite()])


def test_a_tiny_temperature_samples_the_most_likely_token() -> None:
    """Below vLLM's floor of 0.01 a temperature is the floor: logits / 1e-39 would be infinite
    and every row would pick token 0."""
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    best = torch.randint(1, 100, (8,), generator=torch.Generator().manual_seed(2))
    logits[torch.arange(8), best] = logits.max() + 1.0  # a margin of 100 once scaled
    reqs = [Req(i, [5], 1, SamplingParams(temperature=1e-39, seed=i), ()) for i in range(8)]
    s = make_sampling_tensors(reqs, 0, torch.device("cpu"))
    assert torch.equal(sample(logits, s), best)


def test_seeds_differing_in_either_half_give_different_noise() -> None:
    """The 64-bit seed is hashed, not folded: 1 and 2**32 (and -1 and 0) once shared a stream."""
    seeds = [0, 1, 2**32, 2**32 + 1, -1, -(2**32), 2**63, 7 << 40, *range(2, 2000)]
    got = {request_seed(Req(0, [5], 1, SamplingParams(seed=s), ()), 0) for s in seeds}
    assert len(got) == len(seeds) and all(0 <= g < 2**32 for g in got)
    logits = torch.zeros(2, 1000)
    reqs = [Req(0, [5], 1, SamplingParams(temperature=1.0, seed=s), ()) for s in (1, 2**32)]
    first, second = sample(logits, make_sampling_tensors(reqs, 0, torch.device("cpu")))
    again = sample(logits[:1], make_sampling_tensors(reqs[:1], 0, torch.device("cpu")))
    assert first != second and again.tolist() == [first]


def test_params_take_lists_a_single_stop_string_and_none() -> None:
    p = SamplingParams(stop="\n", stop_token_ids=[30, 31], allowed_token_ids=[5, 6])
    assert (p.stop, p.stop_token_ids, p.allowed_token_ids) == (("\n",), (30, 31), (5, 6))
    none = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert (none.stop, none.stop_token_ids) == ((), ())
    p.validate()
    none.validate()


@pytest.mark.parametrize("fields,message", [
    ({"temperature": "0.5"}, "temperature must be a finite number"),
    ({"temperature": None}, "temperature must be a finite number"),
    ({"top_p": "1"}, "top_p must be in"),
    ({"min_p": "0"}, "min_p must be in"),
    ({"top_k": -5}, "top_k must be -1 or 0"),
    ({"ignore_eos": "no"}, "ignore_eos must be true or false"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be non-negative integers"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop": ["ok", ""]}, "stop must be a string or a list"),
])
def test_bad_values_are_value_errors_naming_them(fields: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields).validate()
