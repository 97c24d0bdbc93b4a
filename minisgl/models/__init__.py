"""Model classes by Hugging Face architecture name, and their config.

`ModelConfig` imports without torch (the launcher reads a model's shape before any rank starts
and never touches a tensor); the model classes load on first use (`model_class`, and a module
`__getattr__` for `CausalLM`, PEP 562), as `minisgl.distributed` loads its names."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, Type

from minisgl.models.classifier import CLASSIFIER_BASES
from minisgl.models.config import ModelConfig

if TYPE_CHECKING:
    from minisgl.models.decoder import CausalLM

# Architecture name (config.json's) -> the module under minisgl.models defining that class.
_MODULE_OF: Dict[str, str] = {
    "Dots1ForCausalLM": "dots1",
    "Eagle3LlamaForCausalLM": "eagle3",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Gemma3ForConditionalGeneration": "gemma",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4",
    "GraniteForCausalLM": "llama",
    "LlamaForCausalLM": "llama",
    "LlamaForCausalLMEagle3": "eagle3",
    "MistralForCausalLM": "llama",
    "Mistral3ForConditionalGeneration": "llama",
    "MixtralForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen",
    "Qwen2MoeForCausalLM": "qwen",
    "Qwen3ForCausalLM": "qwen",
    "Qwen3MoeForCausalLM": "qwen",
    "SmolLM3ForCausalLM": "llama",
}
ARCHITECTURES = tuple(sorted([*_MODULE_OF, *CLASSIFIER_BASES]))


def model_class(architecture: str) -> Type[CausalLM]:
    """The class serving `architecture` (a sequence classifier: its causal LM's, which builds
    the head its ModelConfig.classifier describes); ValueError naming the supported ones
    otherwise."""
    architecture = CLASSIFIER_BASES.get(architecture, architecture)
    if architecture not in _MODULE_OF:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[architecture]}"),
                   architecture)


def __getattr__(name: str) -> Any:
    if name == "CausalLM":
        return importlib.import_module(f"{__name__}.decoder").CausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig", "model_class"]
