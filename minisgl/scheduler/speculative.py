"""Speculative decoding by n-gram lookup (vLLM's `--speculative-config '{"method": "ngram"}'`,
prompt lookup decoding): drafts come from the request's own tokens, no draft model.

Each decode step, a request whose last n tokens (prompt_lookup_min <= n <= prompt_lookup_max)
occurred earlier in its prompt or output proposes the tokens that followed that occurrence
(the longest such n; among equals, the latest occurrence; `ngram.propose`) as up to
num_speculative_tokens drafts. A verify step (Phase.VERIFY) computes the newest token and the
drafts as one extend and samples every position as a decode step at that length would: the
same logits, the same noise (the sampler's step is the output position), penalties, bad
words and grammar masks that see the drafts before it as output, so every token is the one
plain decoding gives, greedy or seeded. Draft j is kept while it equals the token sampled before it; the
first token that differs (or the one after the last draft) is the step's last, so a step yields
1 to 1 + drafts tokens.

Drafts are a function of each request's tokens and lengths only: every rank proposes the same
ones (the lockstep invariant). A verify step needs the newest token on the host, so a
speculating scheduler runs without overlap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from minisgl.settings import json_object

KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size")
_DEFAULT_LOOKUP = 5  # vLLM's, where neither bound is given
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` drafts at most per request and step, from matches of
    `prompt_lookup_min` to `prompt_lookup_max` tokens; no drafts in a step of more than
    `disable_by_batch_size` running requests (None: no limit), where a verify step's extra
    positions cost more than the tokens they save."""

    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    disable_by_batch_size: Optional[int] = None

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["SpeculativeConfig"]:
        """--speculative-config's JSON object (vLLM's keys), None where unset; ValueError with
        the key and its value where a value is wrong, or for a method other than ngram."""
        value: Dict[str, Any] = json_object(text, "speculative_config",
                                            "speculative decoding settings", KEYS)
        if text is None:
            return None
        method = value.get("method")
        if method not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method {method!r} is not supported: minisgl "
                             f"speculates by n-gram lookup only ({{\"method\": \"ngram\"}}); "
                             f"draft models, EAGLE and MTP heads are not implemented")
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        cfg = cls(k, lo if lo is not None else _DEFAULT_LOOKUP,  # type: ignore[arg-type]
                  hi if hi is not None else _DEFAULT_LOOKUP, value.get("disable_by_batch_size"))
        cfg.check()
        return cfg

    @classmethod
    def from_sglang(cls, algorithm: Optional[str], num_draft_tokens: Optional[int],
                    min_window: Optional[int], max_window: Optional[int]
                    ) -> Optional["SpeculativeConfig"]:
        """SGLang's flags (--speculative-algorithm NGRAM, --speculative-num-draft-tokens: the
        tokens a verify step gives a request, its newest among them, so one more than the
        drafts; --speculative-ngram-min/max-match-window-size: the lookup bounds), None where
        no algorithm is set; ValueError naming the flag where a value is wrong, one is set
        without the algorithm, or the algorithm is another (SGLang's n-gram drafts a tree of
        branches; minisgl's drafts one chain, the longest match's)."""
        if algorithm is None:
            given = [f for f, v in (("speculative_num_draft_tokens", num_draft_tokens),
                                    ("speculative_ngram_min_match_window_size", min_window),
                                    ("speculative_ngram_max_match_window_size", max_window))
                     if v is not None]
            if given:
                raise ValueError(f"{given[0]} needs speculative_algorithm NGRAM")
            return None
        if algorithm.upper() != "NGRAM":
            raise ValueError(f"speculative_algorithm {algorithm!r} is not supported: minisgl "
                             f"speculates by n-gram lookup only (NGRAM); draft models, EAGLE "
                             f"and MTP heads are not implemented")
        if num_draft_tokens is None or isinstance(num_draft_tokens, bool) or num_draft_tokens < 2:
            raise ValueError(f"speculative_num_draft_tokens must be an integer >= 2 with "
                             f"speculative_algorithm NGRAM (the newest token and at least one "
                             f"draft), got {num_draft_tokens!r}")
        lo = min_window if min_window is not None else 1  # SGLang's defaults
        hi = max_window if max_window is not None else 12
        cfg = cls(num_draft_tokens - 1, lo, hi)
        cfg.check()
        return cfg

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "disable_by_batch_size":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {f.name} must be an integer >= 1, got "
                                 f"{v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} "
                             f"is more than prompt_lookup_max {self.prompt_lookup_max}")


def kept(drafts: Sequence[int], verified: Sequence[int]) -> int:
    """How many drafts a verify step keeps: those equal to the token sampled at their
    position (`verified[j]`, sampled after the newest token and drafts[:j])."""
    n = 0
    while n < len(drafts) and drafts[n] == verified[n]:
        n += 1
    return n


@dataclass
class SpecCounts:
    """Speculation's totals (vLLM's spec_decode metrics): verify steps' requests that had
    drafts, their draft tokens, those kept, and those kept at each draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: List[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_kept: int) -> None:
        if num_drafts == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_kept
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for j in range(num_kept):
            self.accepted_per_pos[j] += 1
