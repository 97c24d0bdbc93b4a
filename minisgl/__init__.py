"""minisgl: a small, tensor-parallel LLM serving engine.

`from minisgl import LLM, SamplingParams` is the offline API; `./serve` starts the service.
"""

from typing import TYPE_CHECKING

from minisgl.beam_search import BeamSearchParams
from minisgl.core import (LoRARequest, PoolingParams, SamplingParams, StructuredOutput,
                          StructuredOutputsParams, TokenLogprobs)

if TYPE_CHECKING:  # type checkers see the class; at run time `__getattr__` imports it late
    from minisgl.llm import LLM

__all__ = ["BeamSearchParams", "LLM", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutput",
           "StructuredOutputsParams", "TokenLogprobs"]


def __getattr__(name: str) -> object:
    if name == "LLM":  # imported on first use: the offline API pulls in torch models and tokenizers
        from minisgl.llm import LLM
        return LLM
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
