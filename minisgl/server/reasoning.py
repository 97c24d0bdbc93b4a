"""Reasoning models' output split into the thinking part and the answer (`--reasoning-parser`).

Both formats put the thinking between `<think>` and `</think>`:
- `qwen3`: the model writes both tags itself; text before a `<think>` (none, in practice) and
  after the `</think>` is the answer. Without tags (thinking turned off through
  `chat_template_kwargs: {"enable_thinking": false}`) everything is the answer.
- `deepseek-r1`: the chat template already opened the `<think>`, so the output starts inside the
  thinking part, up to `</think>` (a `<think>` the model repeats is dropped).

`ReasoningSplitter` works on streamed text deltas: a tag split over deltas is held back until
it is known, so the concatenation of the parts equals splitting the whole text at once.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

REASONING_PARSERS = ("qwen3", "deepseek-r1")
THINK_START, THINK_END = "<think>", "</think>"


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
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {name!r}")
        self.thinking = name == "deepseek-r1"
        self.done = False  # past the `</think>`: the rest is the answer
        self.held = ""

    def feed(self, text: str) -> Parts:
        buf, self.held = self.held + text, ""
        reasoning: List[str] = []
        content: List[str] = []
        while buf:
            if self.done:
                content.append(buf)
                break
            tags = (THINK_END, THINK_START) if self.thinking else (THINK_START,)
            hits = [(i, t) for i, t in ((buf.find(t), t) for t in tags) if i >= 0]
            side = reasoning if self.thinking else content
            if hits:
                at, tag = min(hits)
                side.append(buf[:at])
                buf = buf[at + len(tag):]
                if tag == THINK_END:
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
        """The held-back text, at the end of the output (no tag completed it)."""
        held, self.held = self.held, ""
        return Parts(held, "") if self.thinking else Parts("", held)


def split_reasoning(name: Optional[str], text: str) -> Parts:
    """The whole output split at once (`name` None: no parser, all of it is the answer)."""
    if name is None:
        return Parts("", text)
    splitter = ReasoningSplitter(name)
    a, b = splitter.feed(text), splitter.flush()
    return Parts(a.reasoning + b.reasoning, a.content + b.content)
