"""Helpers for the in-process formatter tests: one output formatted plain and streamed."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

from minisgl.message.types import ReplyChunk
from minisgl.server.responses import Choice, Formatter


def chunks_of(texts: List[str], finish: str = "stop") -> List[ReplyChunk]:
    """One request's reply chunks: a token a text piece (ids 0, 1, ...), 7 prompt tokens, the
    last piece ending the output with `finish`."""
    return [ReplyChunk(0, text, [k], prompt_tokens=7, completion_tokens=k + 1,
                       finish_reason=finish if k == len(texts) - 1 else None)
            for k, text in enumerate(texts)]


def plain_and_streamed(make: Callable[[], Formatter], replies: List[ReplyChunk]
                       ) -> Tuple[Any, List[str]]:
    """What a fresh formatter from `make` answers for `replies` whole (`full`), and the lines
    another streams for them (opening, a delta a chunk, closing)."""
    whole = Choice()
    for reply in replies:
        whole.add(reply)
    full = make().full([whole])
    streamed, choice = make(), Choice(prompt_tokens=7)
    lines = list(streamed.opening(0, choice))
    for reply in replies:
        choice.add(reply)
        lines += streamed.delta(0, reply, choice)
    lines += streamed.closing([choice])
    return full, lines
