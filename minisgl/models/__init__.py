"""Model classes by Hugging Face architecture name, and their config."""

from __future__ import annotations

from typing import Dict, Type

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM
from minisgl.models.llama import LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM
from minisgl.models.qwen import (Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM,
                                 Qwen3MoeForCausalLM)

MODEL_CLASSES: Dict[str, Type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> Type[CausalLM]:
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    return MODEL_CLASSES[architecture]


__all__ = ["CausalLM", "MODEL_CLASSES", "ModelConfig", "model_class"]
