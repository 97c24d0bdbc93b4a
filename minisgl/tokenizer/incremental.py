"""Incremental detokenization and stop-string matching for one request (no IO, no shared state).

`IncrementalDecoder` turns a stream of token ids into text deltas whose concatenation equals
decoding all of them at once (in the left context of the prompt's last tokens):

- Byte-level BPE and SentencePiece byte-fallback tokens can split one character over several
  tokens. A delta is emitted only when the decoded text does not end in U+FFFD (an incomplete
  UTF-8 sequence); until then the tokens are held back.
- The prefix window (`prefix_offset`..`read_offset`) decodes the text just before the new tokens
  together with them, so tokenizers that drop a leading space when decoding a lone token
  (SentencePiece's "▁word") still get it right: delta = decode(prefix + new) - decode(prefix).

`StopMatcher` finds stop strings and stop_regex patterns across delta boundaries: it holds back the
longest tail that could still begin a stop string or match a pattern, and on a match releases only
the text before it.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from minisgl.core import compile_stop_regex

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
    """`stops`: stop strings; `patterns`: stop_regex patterns (SGLang's; compiled by
    core.compile_stop_regex). `keep` (SGLang's no_stop_trim): the match stays at the end of
    the text. After a match, `matched` is the stop string, or the pattern, that matched.

    Held back: the longest tail that may begin a stop string, and the text from the first
    place where a pattern matches partially (it may match once more text comes: the `regex`
    module's partial matches). So the text released never holds a match, and a match
    (which starts in held text) is cut exactly, streamed or not. A pattern that can match
    long text (`.*` and the like) holds back as much. Patterns see all the text before them
    (lookbehinds, anchors: the whole output is kept where there are patterns, appended in
    place), and each search runs under SEARCH_TIMEOUT_S: a pattern that backtracks past it
    raises TimeoutError (the caller ends the request)."""

    SEARCH_TIMEOUT_S = 0.1

    def __init__(self, stops: Sequence[str], keep: bool = False,
                 patterns: Sequence[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.patterns = tuple(compile_stop_regex(p) for p in patterns)
        self.keep = keep
        self.text = ""  # the output fed so far (without patterns: only what is held)
        self.out = 0  # where in `text` the held text begins: all before it is released
        self.matched: Optional[str] = None

    @property
    def held(self) -> str:
        return self.text[self.out:]

    def too_slow(self) -> str:
        """Why a feed raised TimeoutError, with the numbers (the caller ends the request)."""
        return (f"a stop_regex pattern of {[p.pattern for p in self.patterns]!r:.200} took "
                f"over {self.SEARCH_TIMEOUT_S * 1000:.0f} ms to search the output "
                f"({len(self.text)} characters): simplify it")

    def feed(self, text: str, armed: bool = True) -> StopResult:
        """The text that is out, given the next `text`. Not `armed` (vLLM's min_tokens: fewer
        tokens out than that), no stop ends the output yet, though the tail that may begin
        one is still held, so that one completed once armed ends it."""
        if not self.stops and not self.patterns:
            return StopResult(text, False)
        whole, self.text = self.text, ""
        whole += text  # its only reference: CPython appends in place (no copy of the output)
        self.text = whole
        buf = whole[self.out:]
        found = self._first_match(buf) if armed else None
        if found is not None:
            at, end, self.matched = found
            self.out = len(whole)
            return StopResult(buf[:end if self.keep else at], True)
        hold = min([len(buf) - self._partial_tail(buf)]
                   + [self._partial_start(p, armed) for p in self.patterns])
        released = buf[:hold]
        self.out += hold
        if not self.patterns:  # nothing looks back: keep the held text alone
            self.text, self.out = self.text[self.out:], 0
        return StopResult(released, False)

    def flush(self) -> str:
        """Held-back text, released at the end of the request (no stop completed it)."""
        out = self.held
        self.out = len(self.text)
        return out

    def _first_match(self, buf: str) -> Optional[Tuple[int, int, str]]:
        """(start, end, what) in `buf` (the held text) of the earliest stop (of those there,
        the longest)."""
        hits = [(i, i + len(s), s) for i, s in ((buf.find(s), s) for s in self.stops)
                if i >= 0]
        for pattern in self.patterns:
            m = pattern.search(self.text, self.out, timeout=self.SEARCH_TIMEOUT_S)
            if m is not None:
                hits.append((m.start() - self.out, m.end() - self.out, pattern.pattern))
        return min(hits, key=lambda h: (h[0], -h[1])) if hits else None

    def _partial_start(self, pattern: Any, armed: bool) -> int:
        """Where in the held text the first partial match of `pattern` (one that more text
        may complete) starts; the held text's length where none. Armed, it holds no whole
        match (the caller looked first); not armed, whole matches are passed over."""
        pos = self.out
        while pos <= len(self.text):
            m = pattern.search(self.text, pos, partial=True, timeout=self.SEARCH_TIMEOUT_S)
            if m is None:
                break
            if m.partial:
                return m.start() - self.out
            pos = m.start() + 1  # a whole match while not armed: it does not stop the output
        return len(self.text) - self.out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
