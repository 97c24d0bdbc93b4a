"""Speculative decoding by n-gram lookup (vLLM's `--speculative-config '{"method": "ngram"}'`,
prompt lookup decoding: drafts from the request's own tokens) or by a draft model (vLLM's
`{"model": PATH}`, SGLang's STANDALONE: a smaller model of the same tokenizer, engine/draft.py).

Each decode step, a request whose last n tokens (prompt_lookup_min <= n <= prompt_lookup_max)
occurred earlier in its prompt or output proposes the tokens that followed that occurrence
(the longest such n; among equals, the latest occurrence; `ngram.propose`) as up to
num_speculative_tokens drafts; with a draft model every request takes as many drafts as it
has room for (`ngram.Drafter.room`), proposed on the device when the step launches. A verify
step (Phase.VERIFY) computes the newest token and the
drafts as one extend and samples every position as a decode step at that length would: the
same logits, the same noise (the sampler's step is the output position), penalties, bad
words and grammar masks that see the drafts before it as output, so every token is the one
plain decoding gives, greedy or seeded. Draft j is kept while it equals the token sampled before it; the
first token that differs (or the one after the last draft) is the step's last, so a step yields
1 to 1 + drafts tokens.

Drafts are a function of each request's tokens and lengths only (n-gram), or of those and the
draft model, which every rank runs alike: every rank proposes the same ones (the lockstep
invariant). A verify step needs the newest token on the host, so a
speculating scheduler runs without overlap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from minisgl.settings import json_object

KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "draft_tensor_parallel_size")
DRAFT_METHODS = ("draft_model", "[draft_model]")  # vLLM's names; "model" alone says it too
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
    model: Optional[str] = None  # the draft model (a directory or a hub id); None: n-gram
    # vLLM's: the ranks the draft is split over (None: the target's, the only choice here)
    draft_tensor_parallel_size: Optional[int] = None

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["SpeculativeConfig"]:
        """--speculative-config's JSON object (vLLM's keys), None where unset; ValueError with
        the key and its value where a value is wrong, or for a method other than ngram and
        draft_model (which "model" implies)."""
        value: Dict[str, Any] = json_object(text, "speculative_config",
                                            "speculative decoding settings", KEYS)
        if text is None:
            return None
        method, model = value.get("method"), value.get("model")
        if model is not None or method in DRAFT_METHODS:
            return cls._draft_model(value, method, model)
        if method not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method {method!r} is not supported: minisgl "
                             f"speculates by n-gram lookup ({{\"method\": \"ngram\"}}) or a "
                             f"draft model ({{\"model\": PATH}}); EAGLE and MTP heads are not "
                             f"implemented")
        if "draft_tensor_parallel_size" in value:
            raise ValueError("speculative_config: draft_tensor_parallel_size is a draft "
                             "model's; n-gram lookup runs none")
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        cfg = cls(k, lo if lo is not None else _DEFAULT_LOOKUP,  # type: ignore[arg-type]
                  hi if hi is not None else _DEFAULT_LOOKUP, value.get("disable_by_batch_size"))
        cfg.check()
        return cfg

    @classmethod
    def _draft_model(cls, value: Dict[str, Any], method: Any, model: Any
                     ) -> "SpeculativeConfig":
        """speculative_config naming a draft model; ValueError naming what is wrong."""
        if method not in (None, *DRAFT_METHODS):
            raise ValueError(f"speculative_config: method {method!r} takes no draft model; "
                             f"got model {model!r} (draft_model takes one)")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config: method draft_model needs \"model\", a "
                             f"directory or a hub id, got {model!r}")
        lookup = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if key in value]
        if lookup:
            raise ValueError(f"speculative_config: {lookup[0]} is n-gram lookup's; a draft "
                             f"model takes none")
        cfg = cls(value.get("num_speculative_tokens"),  # type: ignore[arg-type]
                  disable_by_batch_size=value.get("disable_by_batch_size"), model=model,
                  draft_tensor_parallel_size=value.get("draft_tensor_parallel_size"))
        cfg.check()
        return cfg

    @classmethod
    def from_sglang(cls, algorithm: Optional[str], num_draft_tokens: Optional[int],
                    min_window: Optional[int], max_window: Optional[int],
                    draft_path: Optional[str] = None) -> Optional["SpeculativeConfig"]:
        """SGLang's flags (--speculative-algorithm NGRAM or STANDALONE,
        --speculative-num-draft-tokens: the tokens a verify step gives a request, its newest
        among them, so one more than the drafts; --speculative-ngram-min/max-match-window-size:
        NGRAM's lookup bounds; --speculative-draft-model-path: STANDALONE's draft model), None
        where no algorithm is set; ValueError naming the flag where a value is wrong, one is
        set without its algorithm, or the algorithm is another (SGLang's n-gram drafts a tree
        of branches; minisgl's drafts one chain, the longest match's)."""
        flags = (("speculative_num_draft_tokens", num_draft_tokens),
                 ("speculative_ngram_min_match_window_size", min_window),
                 ("speculative_ngram_max_match_window_size", max_window),
                 ("speculative_draft_model_path", draft_path))
        if algorithm is None:
            given = [f for f, v in flags if v is not None]
            if given:
                raise ValueError(f"{given[0]} needs speculative_algorithm NGRAM or STANDALONE")
            return None
        name = algorithm.upper()
        if name not in ("NGRAM", "STANDALONE"):
            raise ValueError(f"speculative_algorithm {algorithm!r} is not supported: minisgl "
                             f"speculates by n-gram lookup (NGRAM) or a draft model "
                             f"(STANDALONE); EAGLE and MTP heads are not implemented")
        if num_draft_tokens is None or isinstance(num_draft_tokens, bool) or num_draft_tokens < 2:
            raise ValueError(f"speculative_num_draft_tokens must be an integer >= 2 with "
                             f"speculative_algorithm {name} (the newest token and at least one "
                             f"draft), got {num_draft_tokens!r}")
        if name == "STANDALONE":
            wrong = [f for f, v in flags[1:3] if v is not None]
            if wrong or not draft_path:
                raise ValueError(f"{wrong[0]} is NGRAM's" if wrong else
                                 "speculative_algorithm STANDALONE needs "
                                 "speculative_draft_model_path")
            cfg = cls(num_draft_tokens - 1, model=draft_path)
        elif draft_path is not None:
            raise ValueError("speculative_draft_model_path needs speculative_algorithm "
                             "STANDALONE (NGRAM drafts from the request's own tokens)")
        else:
            cfg = cls(num_draft_tokens - 1, min_window if min_window is not None else 1,
                      max_window if max_window is not None else 12)  # SGLang's defaults
        cfg.check()
        return cfg

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "model" or (v is None and f.name in ("disable_by_batch_size",
                                                               "draft_tensor_parallel_size")):
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
