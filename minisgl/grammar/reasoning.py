"""Reasoning models' thinking markers, and where a structured-output constraint starts in such a
model's output.

`FORMATS` are the markers of each `--reasoning-parser` format (server/reasoning.py splits chat
output by them). A constrained chat request of a reasoning model thinks freely and is
constrained after its thinking, as vLLM does: the tokenizer resolves the format's markers to
token ids (`think_gate`; only markers that are single tokens of the vocabulary: Qwen3's and
DeepSeek-R1's `<think>` / `</think>`, Magistral's `[THINK]` / `[/THINK]`; Granite's phrases are
not, so its constraint holds from the first token), and the scheduler's matcher
(grammar/matcher.py) lets the thinking through:
- a prompt whose end already closed the thinking (Qwen3's template with thinking turned off
  writes an empty `<think></think>`) is constrained from the first token;
- a prompt whose end opened it (DeepSeek-R1's template) thinks until the end marker;
- otherwise the first token is the grammar's or the start marker: a model that answers without
  thinking (Qwen3-Instruct-2507) is constrained at once, one that opens its thinking is free
  until the end marker.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Sequence, Tuple

THINK_START, THINK_END = "<think>", "</think>"
# How far back from the prompt's end a closing marker counts as this turn's (an empty thinking
# block the template wrote: "<think>\n\n</think>\n\n"), not an earlier turn's.
_PROMPT_TAIL = 8


class Markers(NamedTuple):
    """A format's markers, each with its spellings: `start` opens the thinking, `end` closes
    it; `inside`: the output starts inside the thinking (the template opened it); `special`:
    the markers are the tokenizer's special tokens."""

    start: Tuple[str, ...]
    end: Tuple[str, ...]
    inside: bool = False
    special: bool = False  # the markers are special tokens (keeps_special_tokens)


_GRANITE_START = ("Here is my thought process:", "Here's my thought process:")
_GRANITE_END = ("Here is my response:", "Here's my response:")
_TAGS = Markers((THINK_START,), (THINK_END,))
_R1 = Markers((THINK_START,), (THINK_END,), inside=True)
FORMATS: Dict[str, Markers] = {
    "qwen3": _TAGS,
    "deepseek-r1": _R1,
    "granite": Markers(_GRANITE_START, _GRANITE_END),
    "mistral": Markers(("[THINK]",), ("[/THINK]",), special=True),
    # vLLM's names: its DeepSeek-R1 parser, and GLM-4.5's (Qwen3's tags, written by the model)
    "deepseek_r1": _R1,
    "glm45": _TAGS,
}
REASONING_PARSERS = tuple(FORMATS)


class ThinkGate(NamedTuple):
    """Where a constraint starts (core.StructuredOutput's think_* fields): `end` the token id
    that closes the thinking (-1: no gate, constrained from the first token), `start` the one
    that opens it (-1: none), `thinking` the output starts inside it."""

    start: int = -1
    end: int = -1
    thinking: bool = False


def _single_token(tokenizer: Any, text: str) -> int:
    """The id of `text` where it is one token of the vocabulary, else -1."""
    ids = tokenizer.convert_tokens_to_ids([text])
    token = ids[0] if ids else None
    unknown = getattr(tokenizer, "unk_token_id", None)
    return token if isinstance(token, int) and token >= 0 and token != unknown else -1


def think_gate(tokenizer: Any, parser: str, prompt: Sequence[int]) -> ThinkGate:
    """The gate of a constrained request of reasoning format `parser` whose prompt is `prompt`
    (see the module's doc); ThinkGate() where the constraint holds from the first token."""
    markers = FORMATS[parser]
    start, end = (_single_token(tokenizer, markers.start[0]),
                  _single_token(tokenizer, markers.end[0]))
    if end < 0 or len(markers.end) > 1:
        return ThinkGate()
    if markers.inside:
        return ThinkGate(start, end, True)
    for token in reversed(prompt[-_PROMPT_TAIL:]):
        if token == end:
            return ThinkGate()
        if token == start:
            return ThinkGate(start, end, True)
    return ThinkGate(start, end, False)
