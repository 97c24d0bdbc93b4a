"""Incremental detokenization and stop-string matching for one request (no IO, no shared state).

`IncrementalDecoder` turns a stream of token ids into text deltas whose concatenation equals
decoding all of them at once (in the left context of the prompt's last tokens):

- Byte-level BPE and SentencePiece byte-fallback tokens can split one character over several
  tokens. A delta is emitted only when the decoded text does not end in U+FFFD (an incomplete
  UTF-8 sequence); until then the tokens are held back.
- The prefix window (`prefix_offset`..`read_offset`) decodes the text just before the new tokens
  together with them, so tokenizers that drop a leading space when decoding a lone token
  (SentencePiece's "▁word") still get it right: delta = decode(prefix + new) - decode(prefix).

`StopMatcher` finds stop strings across delta boundaries: it holds back the longest tail that could
still be the start of a stop string, and on a match releases only the text before it.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output, for the first token's spacing
_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """`tokenizer` None (a model without one): every delta is empty."""

    def __init__(self, tokenizer: Optional[Any], prompt_tail: Sequence[int],
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = list(prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _pending_text(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        # decode(prefix + new) normally extends decode(prefix); if a tokenizer rewrites the
        # prefix, fall back to everything after the common part.
        if full.startswith(prefix):
            return full[len(prefix):]
        common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b),
                      min(len(prefix), len(full)))
        return full[common:]

    def push(self, token: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token)
        text = self._pending_text()
        if not text or text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 64:  # drop ids no later decode can look at
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return text

    def flush(self) -> str:
        """The text of tokens still held back (at the end of the request; may hold U+FFFD when
        the model ended inside a character, exactly as decoding all tokens would)."""
        if self.read_offset == len(self.ids):
            return ""
        text = self._pending_text()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text


class StopResult(NamedTuple):
    text: str  # safe to emit now
    stopped: bool  # a stop string matched (`matched`); `text` ends right before it (or with it)


class StopMatcher:
    """`keep` (SGLang's no_stop_trim): the matched stop string stays at the end of the text.
    After a match, `matched` is the stop string that matched."""

    def __init__(self, stops: Sequence[str], keep: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep = keep
        self.held = ""
        self.matched: Optional[str] = None

    def feed(self, text: str, armed: bool = True) -> StopResult:
        """The text that is out, given the next `text`. Not `armed` (vLLM's min_tokens: fewer
        tokens out than that), no stop string ends the output yet, though the tail that may
        begin one is still held, so that one completed once armed ends it."""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return StopResult(buf, False)
        hits = [(i, -len(s), s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits and armed:
            self.held = ""
            at, _, self.matched = min(hits)  # the earliest; of those there, the longest
            return StopResult(buf[:at + len(self.matched) if self.keep else at], True)
        keep = self._partial_tail(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return StopResult(buf[:len(buf) - keep], False)

    def flush(self) -> str:
        """Held-back text, released at the end of the request (no stop string completed it)."""
        out, self.held = self.held, ""
        return out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
