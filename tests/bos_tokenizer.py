"""A tokenizer that adds a BOS token, made from one that does not."""

from __future__ import annotations

from typing import Any


def with_bos(tokenizer: Any, bos: str = "<|endoftext|>") -> Any:
    """A copy of a fast tokenizer that adds `bos` in front of every encoding with special
    tokens, as Llama-3's and Mistral's do (the default model's adds nothing)."""
    import copy

    from tokenizers import processors
    out = copy.deepcopy(tokenizer)
    out._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    return out
