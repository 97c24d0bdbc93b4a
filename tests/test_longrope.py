"""Phi-3's longrope (Phi-3-128K, Phi-3.5, Phi-4-mini) and Phi-4-mini's partial rotary embedding,
against Hugging Face transformers (float32, CPU): greedy tokens of prompts shorter than the
pretraining length (32 here) that decode past it (transformers then recomputes the sequence
with the long factors; the scheduler prefills it again), and of prompts longer than it (all
their tokens rotate with the long factors), whole and in chunks, with overlap; the prefix cache
never hands a long sequence's K/V to a short one's, or back."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest
import torch

from hf_reference import hf_greedy, mixed_prompts

from minisgl import LLM, SamplingParams
from minisgl.layers.rotary import RopeIndex
from minisgl.models.config import ModelConfig

NEW = 24


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family,kw", [  # (the defaults: test_engine_hf's tiny families)
    ("phi3_longrope", {"max_prefill_tokens": 16, "overlap": True}),
    ("phi4_mini", {"max_prefill_tokens": 16}), ("phi4_mini", {"mixed_steps": True}),
    ("phi4_mini", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 2}})])
def test_longrope_matches_hf(tiny_model: Callable[..., Path], family: str, kw: dict) -> None:
    """Prompts of 12 and 20 tokens decode past 32 (one of 32 exactly, too); those of 40 and 70
    start past it."""
    model = tiny_model(family)
    prompts = mixed_prompts(5, seed=21, lengths=(12, 40, 20, 70, 28))
    with LLM(str(model), device="cpu", page_size=4, max_kv_tokens=4096, show_progress=False,
             **kw) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _greedy())]
    assert got == hf_greedy(model, prompts, NEW)


def test_long_and_short_prompts_never_share_cached_kv(tiny_model: Callable[..., Path]) -> None:
    """A 44-token prompt (long: every token rotates with the long factors) and its first 28
    tokens (short: short factors below 32) share no cached page either way; a second long
    prompt with the same start reuses the first's."""
    model = tiny_model("phi3_longrope")
    long = mixed_prompts(1, seed=22, lengths=(44,))[0]
    short, other_long = long[:28], long[:40] + [7, 8, 9, 10, 11]
    prompts = [long, short, other_long, short]
    outs = []
    with LLM(str(model), device="cpu", page_size=4, max_kv_tokens=4096,
             show_progress=False) as llm:
        for p in prompts:  # one at a time: each finds what the ones before left cached
            outs.append(llm.generate([p], _greedy(8))[0])
    assert [o.token_ids for o in outs] == hf_greedy(model, prompts, 8)
    assert [o.cached_tokens for o in outs[:2]] == [0, 0]
    assert outs[2].cached_tokens >= 36 and outs[3].cached_tokens >= 24


def test_rope_indices_follow_transformers_choice() -> None:
    rope = RopeIndex(32)
    assert list(rope.host(0, 4, True)) == [32, 33, 34, 35]  # a long sequence: the long table throughout
    assert list(rope.host(28, 4, False)) == [28, 29, 30, 31]
    assert rope.of_positions(torch.tensor([5, 31, 32, 99])).tolist() == [5, 31, 64, 131]
    assert list(RopeIndex().host(3, 2, True)) == [3, 4]


def _config(**rope: object) -> dict:
    return dict(architectures=["Phi3ForCausalLM"], vocab_size=100, hidden_size=64,
                intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=512, original_max_position_embeddings=32,
                rope_scaling=dict(type="longrope", **rope))


def test_longrope_configs_are_read_as_transformers_reads_them() -> None:
    """Phi-3's older names ("su", top-level original_max_position_embeddings) and a partial
    rotary factor; factor lists of the wrong length, or no pretraining length, are refused."""
    cfg = ModelConfig.from_dict({**_config(short_factor=[1.0] * 8, long_factor=[2.0] * 8),
                                 "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                  "long_factor": [2.0] * 8}})
    assert cfg.long_rope_from == 32 and cfg.rotary_dims == 16 and cfg.max_context == 512
    partial = ModelConfig.from_dict({**_config(short_factor=[1.0] * 6, long_factor=[1.0] * 6),
                                     "partial_rotary_factor": 0.75})
    assert partial.rotary_dims == 12
    with pytest.raises(ValueError, match="longrope long_factor must list 8 factors"):
        ModelConfig.from_dict(_config(short_factor=[1.0] * 8, long_factor=[1.0] * 6))
    bad: List[object] = []
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        ModelConfig.from_dict({**_config(short_factor=[1.0] * 8, long_factor=[1.0] * 8),
                               "original_max_position_embeddings": None, "x": bad})
