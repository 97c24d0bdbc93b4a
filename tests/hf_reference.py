"""Greedy reference tokens from Hugging Face transformers (float32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import torch

_MODELS: Dict[str, object] = {}


def hf_greedy(model_dir: Path, prompts: List[List[int]], new_tokens: int) -> List[List[int]]:
    """`new_tokens` greedy tokens per prompt, EOS ignored (one prompt at a time: no padding)."""
    from transformers import AutoModelForCausalLM
    key = str(model_dir)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _MODELS[key]
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,  # type: ignore
                                 min_new_tokens=new_tokens, do_sample=False, top_k=None,
                                 top_p=None, temperature=None)
            out.append(gen[0, len(ids):].tolist())
    return out


def mixed_prompts(n: int, seed: int, lengths: Tuple[int, ...] = (3, 17, 64, 130)
                  ) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (lengths[i % len(lengths)] + i,), generator=g).tolist()
            for i in range(n)]
