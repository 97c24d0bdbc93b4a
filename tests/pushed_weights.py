"""What the tests of weights pushed into a running engine share (test_weight_group,
test_weights_from_tensor): the served checkpoint and the one pushed, the prompts, Hugging
Face's greedy tokens of each, and the tensors pushed."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence

import torch
from safetensors.torch import load_file

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams

NEW_TOKENS = 10


class PushCase(NamedTuple):
    served: Path  # the checkpoint the engine starts with (and reloads on a failed push)
    pushed: Path  # the checkpoint whose tensors are pushed
    prompts: List[List[int]]
    want_served: List[List[int]]  # Hugging Face's greedy tokens of each
    want_pushed: List[List[int]]
    tensors: Dict[str, torch.Tensor]  # the pushed checkpoint's
    names: List[str]  # its tensors' names, sorted


def push_case(checkpoints: Sequence[Path]) -> PushCase:
    served, pushed = checkpoints
    prompts = mixed_prompts(3, seed=37, lengths=(5, 21))
    tensors = load_file(str(pushed / "model.safetensors"))
    return PushCase(served, pushed, prompts, hf_greedy(served, prompts, NEW_TOKENS),
                    hf_greedy(pushed, prompts, NEW_TOKENS), tensors, sorted(tensors))


def greedy_tokens(llm: LLM, prompts: List[List[int]]) -> List[List[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]
