"""vLLM's bad_words as token sequences: what the engine bans (engine/bad_words.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

from minisgl.core import RequestError, SamplingParams


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
    """Each word's tokens as the model would write it: alone (leading spaces stripped) and,
    where that spells it otherwise in as many tokens, after a space, as vLLM tokenizes them
    (a word inside a sentence usually comes with its space)."""
    out: List[Tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(out)


def with_bad_word_ids(tokenizer: Any, params: SamplingParams) -> SamplingParams:
    """`params` with `bad_word_ids` from its `bad_words` (as they are where it has none);
    RequestError naming bad_words for a model without a tokenizer or a word too long."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise RequestError("bad_words need the model's tokenizer; this model has none",
                           "bad_words")
    params = dataclasses.replace(params, bad_word_ids=bad_word_ids(tokenizer, params.bad_words))
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e), "bad_words") from None
    return params
