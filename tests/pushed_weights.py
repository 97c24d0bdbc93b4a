"""What the tests of weights pushed into a running engine share (test_weight_group,
test_weights_from_tensor): the served checkpoint and the one pushed, the prompts, Hugging
Face's greedy tokens of each, and the tensors pushed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence

import pytest
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


def sglang_bucket(named: Sequence[tuple], monkeypatch: pytest.MonkeyPatch) -> dict:
    """SGLang's flattened bucket of (name, tensor) pairs, as its FlattenedTensorBucket builds
    it: the tensors' bytes end to end (uint8) and one FlattenedTensorMetadata each, whose
    class pickles under SGLang's module path (a stand-in module put in sys.modules for the
    test's length)."""
    import dataclasses
    import types
    path = "sglang.srt.weight_sync.tensor_bucket"

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int
    FlattenedTensorMetadata.__module__ = path
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        module = types.ModuleType(".".join(parts[:i]))
        if i == len(parts):
            module.FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
    flats, metadata, at = [], [], 0
    for name, tensor in named:
        flat = tensor.contiguous().flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, at,
                                                at + flat.numel(), flat.numel()))
        flats.append(flat)
        at += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": metadata}
