"""stop_regex (SGLang's sampling parameter) without processes: the matcher against a whole-text
search at every step, over random splits of the text; min_tokens; a match kept; patterns
refused with their reason; a pattern that backtracks past the time limit ends its request, not
the detokenizer. The served and offline paths: test_openai_conformance.py, test_llm_api.py."""

from __future__ import annotations

import random
from typing import List, Optional, Sequence, Tuple

import pytest
import regex

from minisgl.core import MAX_STOP_REGEX, SamplingParams, compile_stop_regex
from minisgl.message.types import DetokenizeInit, TokenOut
from minisgl.tokenizer.detokenize_worker import Detokenizer
from minisgl.tokenizer.incremental import StopMatcher

TEXT = "The answer: 42. Then 7 apples, 13 pears.\n\nfoobar baz END of it; x=1;y=22."
PATTERNS = [r"\d+\.", r"\d{2} p", r"\n\n", r"(?<=foo)bar", r"END|of it", r"x=\d+;y=\d+\.",
            r"apples?,", r"[A-Z]{3}", r"a.*z", r"^Then", r"\bbaz\b", r"zzz"]


def _streamed(pieces: Sequence[str], patterns: Sequence[str], stops: Sequence[str] = (),
              keep: bool = False, armed_from: int = 0) -> Tuple[str, Optional[str]]:
    """The text a matcher lets out of `pieces` (piece i armed from `armed_from` on), and what
    matched."""
    m = StopMatcher(stops, keep, patterns)
    out: List[str] = []
    for i, piece in enumerate(pieces):
        r = m.feed(piece, i >= armed_from)
        out.append(r.text)
        if r.stopped:
            return "".join(out), m.matched
    return "".join(out) + m.flush(), None


def _reference(pieces: Sequence[str], patterns: Sequence[str]) -> Tuple[str, Optional[str]]:
    """At each piece, the text so far searched whole: the first step with a match ends it,
    cut at the leftmost match (of those starting there, the longest)."""
    for k in range(1, len(pieces) + 1):
        text = "".join(pieces[:k])
        hits = [(m.start(), -m.end(), p) for p in patterns
                for m in [regex.search(p, text)] if m is not None]
        if hits:
            start, _, p = min(hits)
            return text[:start], p
    return "".join(pieces), None


def _split(text: str, rng: random.Random) -> List[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_streamed_matches_equal_the_whole_text_search(pattern: str) -> None:
    """However the text arrives, the output is the whole-text search's: text that may begin a
    match is held back, so the cut is exact (and the released text never holds a match)."""
    rng = random.Random(pattern)
    for _ in range(40):
        pieces = _split(TEXT, rng)
        assert _streamed(pieces, [pattern]) == _reference(pieces, [pattern]), pieces


def test_several_patterns_and_stop_strings_end_at_the_earliest() -> None:
    rng = random.Random(3)
    for _ in range(40):
        pieces = _split(TEXT, rng)
        assert _streamed(pieces, [r"\n\n", r"\d\d"]) == _reference(pieces, [r"\n\n", r"\d\d"])
    assert _streamed(["The answer: 42", "."], [r"\d+\."], stops=["answer"]) == (
        "The ", "answer")
    assert _streamed(["The answer: 42", "."], [r"T\w+"], stops=["answer"]) == ("", r"T\w+")


def test_a_match_kept_and_min_tokens() -> None:
    assert _streamed(["a 1", "2. b"], [r"\d+\."], keep=True) == ("a 12.", r"\d+\.")
    # not armed: a match passes (its text goes out); the first one once armed ends it
    assert _streamed(["1.", "a", "2.", "b"], [r"\d\."], armed_from=2) == ("1.a", r"\d\.")


def test_a_pattern_that_can_match_long_text_holds_it_back() -> None:
    """`a.*z` may match once a z comes: everything from the first a waits for it."""
    m = StopMatcher((), False, [r"a.*z"])
    assert m.feed("xx a b").text == "xx " and m.held == "a b"
    assert m.feed(" c").text == ""
    assert m.flush() == "a b c"


@pytest.mark.parametrize("patterns,words", [
    ((r"x*",), "matches the empty text"), ((r"(",), "does not compile"),
    (("a" * 1001,), "strings of 1 to 1000"), (("",), "strings of 1 to 1000"),
    ((r"a",) * (MAX_STOP_REGEX + 1), f"at most {MAX_STOP_REGEX} patterns"),
])
def test_bad_patterns_are_refused(patterns: Tuple[str, ...], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SamplingParams(stop_regex=list(patterns)).validate()


def test_params_take_one_pattern_or_a_list() -> None:
    assert SamplingParams(stop_regex=r"\d").stop_regex == (r"\d",)
    assert SamplingParams(stop_regex=[r"\d", "b"]).stop_regex == (r"\d", "b")
    assert SamplingParams(stop_regex=None).stop_regex == ()
    assert SamplingParams(stop_regex=r"\d").for_engine().stop_regex == ()
    with pytest.raises(ValueError, match="detokenize=True"):
        SamplingParams(stop_regex=r"\d", detokenize=False).validate()
    assert compile_stop_regex(r"\d+").search("ab 12").group() == "12"


class _Chars:
    """A tokenizer of one character a token (ids are code points)."""

    def decode(self, ids: Sequence[int], **_: object) -> str:
        return "".join(chr(i) for i in ids)


def test_a_slow_pattern_ends_its_request_not_the_detokenizer() -> None:
    """`(a|aa)+b` backtracks exponentially over a run of a's: past the time limit the request
    gets an error naming stop_regex and rank 0 an abort; another request goes on."""
    detok = Detokenizer(_Chars())
    detok.init(DetokenizeInit(1, [], stop_regex=(r"(a|aa)+b",)))
    detok.init(DetokenizeInit(2, [], stop_regex=(r"\d",)))
    outs = [TokenOut(uid, ord("a")) for _ in range(40) for uid in (1, 2)]
    rendered = detok.render(outs)
    errors = [c for c in rendered.chunks if c.error is not None]
    assert len(errors) == 1 and errors[0].uid == 1 and errors[0].error_param == "stop_regex"
    assert "took over 100 ms" in errors[0].error and rendered.aborts == [1]
    late = detok.render([TokenOut(1, ord("a")), TokenOut(2, ord("7"))])
    assert [(c.uid, c.text, c.finish_reason, c.matched_stop) for c in late.chunks] == [
        (2, "", "stop", r"\d")]
    assert late.aborts == [2]
