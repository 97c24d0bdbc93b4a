"""Greedy reference tokens from Hugging Face transformers (float32, CPU).

A test comparing with them builds its LLM with device="cpu" (float32 there): "auto" would pick
CUDA on a GPU machine, where the default dtype is bf16 and the tokens cannot match."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

_MODELS: Dict[str, object] = {}


def _hf_model(model_dir: Path, adapter: Optional[Path] = None) -> object:
    """The model (with the PEFT LoRA adapter at `adapter` applied, on a copy of its own)."""
    from transformers import AutoModelForCausalLM
    key = f"{model_dir}|{adapter}"
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter is not None:
            import peft
            model = peft.PeftModel.from_pretrained(model, adapter)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def hf_greedy(model_dir: Path, prompts: List[List[int]], new_tokens: int,
              repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
              presence_penalty: float = 0.0, adapter: Optional[Path] = None
              ) -> List[List[int]]:
    """`new_tokens` greedy tokens per prompt, EOS ignored (one prompt at a time: no padding).
    The penalties: HF's own repetition processor, then `OutputPenalties` (HF has no frequency
    or presence penalty of its own). `adapter`: a PEFT LoRA adapter applied to the model."""
    from transformers import LogitsProcessorList
    model = _hf_model(model_dir, adapter)
    out = []
    with torch.no_grad():
        for ids in prompts:
            extra = LogitsProcessorList()
            if frequency_penalty or presence_penalty:
                extra.append(OutputPenalties(len(ids), frequency_penalty, presence_penalty))
            gen = model.generate(input_ids=torch.tensor([ids]),  # type: ignore
                                 max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, top_k=None,
                                 top_p=None, temperature=None,
                                 repetition_penalty=repetition_penalty, logits_processor=extra)
            out.append(gen[0, len(ids):].tolist())
    return out


class OutputPenalties:
    """An HF logits processor: OpenAI's frequency and presence penalties over the tokens
    generated after the first `prompt_len`."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


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
