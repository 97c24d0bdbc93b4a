"""Greedy reference tokens from Hugging Face transformers (float32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import torch

_MODELS: Dict[str, object] = {}


def _hf_model(model_dir: Path) -> object:
    from transformers import AutoModelForCausalLM
    key = str(model_dir)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _MODELS[key]


def hf_greedy(model_dir: Path, prompts: List[List[int]], new_tokens: int) -> List[List[int]]:
    """`new_tokens` greedy tokens per prompt, EOS ignored (one prompt at a time: no padding)."""
    model = _hf_model(model_dir)
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,  # type: ignore
                                 min_new_tokens=new_tokens, do_sample=False, top_k=None,
                                 top_p=None, temperature=None)
            out.append(gen[0, len(ids):].tolist())
    return out


def hf_logprobs(model_dir: Path, prompt: List[int], output: List[int]) -> torch.Tensor:
    """[len(output), vocab] float32: log_softmax of HF's logits at each output position (the
    distribution each output token was drawn from), one forward over prompt + output."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]  # type: ignore[operator]
    return torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)


def mixed_prompts(n: int, seed: int, lengths: Tuple[int, ...] = (3, 17, 64, 130)
                  ) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (lengths[i % len(lengths)] + i,), generator=g).tolist()
            for i in range(n)]
