"""Reasoning models' output split into the thinking part and the answer (`--reasoning-parser`).

Each format opens the thinking with a start marker and ends it with an end marker:
- `qwen3`: `<think>` ... `</think>`, both written by the model; text before a `<think>` (none,
  in practice) and after the `</think>` is the answer. Without tags (thinking turned off
  through `chat_template_kwargs: {"enable_thinking": false}`) everything is the answer.
- `deepseek-r1`: the same tags, but the chat template already opened the `<think>`, so the
  output starts inside the thinking part, up to `</think>` (a `<think>` the model repeats is
  dropped).
- `granite`: Granite 3.2 / 3.3 with `chat_template_kwargs: {"thinking": true}` write
  "Here is my thought process:" (or "Here's ...") before the thinking and "Here is my
  response:" (or "Here's ...") before the answer, as vLLM's granite parser reads them; like
  qwen3, text without the first marker is the answer.
- `mistral`: Magistral (2507 and later) and Ministral reasoning models: `[THINK]` ... `[/THINK]`,
  read as qwen3's tags are. Both are special tokens, which a decode skipping special tokens
  drops: with this parser a chat's output keeps special tokens unless the request sets
  `skip_special_tokens` (as vLLM's parser preserves them).

`ReasoningSplitter` works on streamed text deltas: a marker split over deltas is held back
until it is known, so the concatenation of the parts equals splitting the whole text at once.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

from minisgl.grammar.reasoning import (FORMATS, REASONING_PARSERS, THINK_END, THINK_START,
                                      Markers)

__all__ = ["FORMATS", "Markers", "REASONING_PARSERS", "THINK_END", "THINK_START",
           "ReasoningSplitter", "keeps_special_tokens", "split_reasoning"]


def keeps_special_tokens(name: Optional[str]) -> bool:
    """Whether a chat's output must keep special tokens for parser `name` (None: no parser)
    to see its markers."""
    return name is not None and FORMATS[name].special


class Parts(NamedTuple):
    reasoning: str
    content: str


def _partial_tail(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's output, delta by delta, for the parser `name` (one of REASONING_PARSERS)."""

    def __init__(self, name: str) -> None:
        if name not in FORMATS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {name!r}")
        self.markers = FORMATS[name]
        self.thinking = self.markers.inside
        self.done = False  # past the end marker: the rest is the answer
        self.held = ""

    def feed(self, text: str) -> Parts:
        buf, self.held = self.held + text, ""
        reasoning: List[str] = []
        content: List[str] = []
        while buf:
            if self.done:
                content.append(buf)
                break
            # inside the thinking a repeated start marker is dropped; outside, only a start
            # marker counts
            tags = (self.markers.end + self.markers.start if self.thinking
                    else self.markers.start)
            hits = [(i, t) for i, t in ((buf.find(t), t) for t in tags) if i >= 0]
            side = reasoning if self.thinking else content
            if hits:
                at, tag = min(hits)
                side.append(buf[:at])
                buf = buf[at + len(tag):]
                if tag in self.markers.end:
                    self.thinking, self.done = False, True
                else:
                    self.thinking = True
                continue
            keep = max(_partial_tail(buf, t) for t in tags)
            side.append(buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            break
        return Parts("".join(reasoning), "".join(content))

    def flush(self) -> Parts:
        """The held-back text, at the end of the output (no marker completed it)."""
        held, self.held = self.held, ""
        return Parts(held, "") if self.thinking else Parts("", held)


def split_reasoning(name: Optional[str], text: str) -> Parts:
    """The whole output split at once (`name` None: no parser, all of it is the answer)."""
    if name is None:
        return Parts("", text)
    splitter = ReasoningSplitter(name)
    a, b = splitter.feed(text), splitter.flush()
    return Parts(a.reasoning + b.reasoning, a.content + b.content)
