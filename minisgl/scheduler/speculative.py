"""Speculative decoding by n-gram lookup (vLLM's `--speculative-config '{"method": "ngram"}'`,
prompt lookup decoding: drafts from the request's own tokens), by a draft model (vLLM's
`{"model": PATH}`, SGLang's STANDALONE: a smaller model of the same tokenizer, engine/draft.py)
or by an EAGLE-3 head (vLLM's `{"method": "eagle3", "model": PATH}`, SGLang's EAGLE3: one layer
drafting from the target's hidden states, engine/eagle.py).

Each decode step, a request whose last n tokens (prompt_lookup_min <= n <= prompt_lookup_max)
occurred earlier in its prompt or output proposes the tokens that followed that occurrence
(the longest such n; among equals, the latest occurrence; `ngram.propose`) as up to
num_speculative_tokens drafts; with a draft model or head every request takes as many drafts as it
has room for (`ngram.Drafter.room`), proposed on the device when the step launches. A verify
step (Phase.VERIFY) computes the newest token and the
drafts as one extend and samples every position as a decode step at that length would: the
same logits, the same noise (the sampler's step is the output position), penalties, bad
words and grammar masks that see the drafts before it as output, so every token is the one
plain decoding gives, greedy or seeded. Draft j is kept while it equals the token sampled
before it; the first token that differs (or the one after the last draft) is the step's last,
so a step yields 1 to 1 + drafts tokens.

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
EAGLE_METHODS = ("eagle3", "[eagle3]")
_NOT_SERVED = ("minisgl speculates by n-gram lookup, a draft model or an EAGLE-3 head; EAGLE-1 "
               "heads, Medusa, MLP speculators and MTP layers are not implemented")
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
    eagle: bool = False  # `model` is an EAGLE-3 head (engine/eagle.py), not a model
    # vLLM's: the ranks the draft is split over (None: the target's, the only choice here)
    draft_tensor_parallel_size: Optional[int] = None

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["SpeculativeConfig"]:
        """--speculative-config's JSON object (vLLM's keys), None where unset; ValueError with
        the key and its value where a value is wrong, or for a method other than ngram,
        draft_model (which "model" implies) and eagle3."""
        value: Dict[str, Any] = json_object(text, "speculative_config",
                                            "speculative decoding settings", KEYS)
        if text is None:
            return None
        method, model = value.get("method"), value.get("model")
        if method not in ("ngram", "[ngram]", None, *DRAFT_METHODS, *EAGLE_METHODS):
            raise ValueError(f"speculative_config: method {method!r} is not supported: "
                             f"{_NOT_SERVED} ({{\"method\": \"ngram\"}}, {{\"model\": PATH}}, "
                             f"{{\"method\": \"eagle3\", \"model\": PATH}})")
        if model is not None or method in (*DRAFT_METHODS, *EAGLE_METHODS):
            return cls._draft_model(value, method, model)
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
        if method not in (None, *DRAFT_METHODS, *EAGLE_METHODS):
            raise ValueError(f"speculative_config: method {method!r} takes no draft model; "
                             f"got model {model!r} (draft_model and eagle3 take one)")
        eagle = method in EAGLE_METHODS
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config: method {'eagle3' if eagle else 'draft_model'}"
                             f" needs \"model\", a directory or a hub id, got {model!r}")
        lookup = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if key in value]
        if lookup:
            raise ValueError(f"speculative_config: {lookup[0]} is n-gram lookup's; a draft "
                             f"model takes none")
        cfg = cls(value.get("num_speculative_tokens"),  # type: ignore[arg-type]
                  disable_by_batch_size=value.get("disable_by_batch_size"), model=model,
                  eagle=eagle, draft_tensor_parallel_size=value.get("draft_tensor_parallel_size"))
        cfg.check()
        return cfg

    @classmethod
    def from_sglang(cls, algorithm: Optional[str], num_draft_tokens: Optional[int],
                    min_window: Optional[int], max_window: Optional[int],
                    draft_path: Optional[str] = None, steps: Optional[int] = None,
                    topk: Optional[int] = None) -> Optional["SpeculativeConfig"]:
        """SGLang's flags (--speculative-algorithm NGRAM, STANDALONE or EAGLE3;
        --speculative-num-draft-tokens: the tokens a verify step gives a request, its newest
        among them, so one more than the drafts; --speculative-num-steps: the drafts, which a
        chain of drafts (--speculative-eagle-topk 1, the only one minisgl drafts) takes with
        num_draft_tokens = steps + 1; --speculative-ngram-min/max-match-window-size: NGRAM's
        lookup bounds; --speculative-draft-model-path: STANDALONE's draft model, EAGLE3's
        head), None where no algorithm is set; ValueError naming the flag where a value is
        wrong, one is set without its algorithm, or the algorithm is another (SGLang's n-gram
        drafts a tree of branches; minisgl's drafts one chain, the longest match's)."""
        flags = (("speculative_num_draft_tokens", num_draft_tokens),
                 ("speculative_ngram_min_match_window_size", min_window),
                 ("speculative_ngram_max_match_window_size", max_window),
                 ("speculative_draft_model_path", draft_path),
                 ("speculative_num_steps", steps), ("speculative_eagle_topk", topk))
        if algorithm is None:
            given = [f for f, v in flags if v is not None]
            if given:
                raise ValueError(f"{given[0]} needs speculative_algorithm NGRAM, STANDALONE or "
                                 f"EAGLE3")
            return None
        name = algorithm.upper()
        if name not in ("NGRAM", "STANDALONE", "EAGLE3"):
            raise ValueError(f"speculative_algorithm {algorithm!r} is not supported: "
                             f"{_NOT_SERVED} (NGRAM, STANDALONE, EAGLE3)")
        drafts = _sglang_drafts(name, num_draft_tokens, steps, topk)
        if name == "NGRAM":
            given = [f for f, v in flags[3:] if v is not None]
            if given:
                raise ValueError(f"{given[0]} is a draft model's or head's (STANDALONE, EAGLE3);"
                                 f" NGRAM drafts from the request's own tokens")
            cfg = cls(drafts, min_window if min_window is not None else 1,
                      max_window if max_window is not None else 12)  # SGLang's defaults
        else:
            wrong = [f for f, v in flags[1:3] if v is not None]
            if wrong or not draft_path:
                raise ValueError(f"{wrong[0]} is NGRAM's" if wrong else
                                 f"speculative_algorithm {name} needs "
                                 f"speculative_draft_model_path")
            cfg = cls(drafts, model=draft_path, eagle=name == "EAGLE3")
        cfg.check()
        return cfg

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("model", "eagle") or (v is None and f.name in ("disable_by_batch_size",
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


def _sglang_drafts(name: str, num_draft_tokens: Optional[int], steps: Optional[int],
                   topk: Optional[int]) -> int:
    """The drafts per request of SGLang's speculative_num_draft_tokens (the newest token and
    the drafts) or speculative_num_steps (the drafts; both given: tokens = steps + 1, a chain's
    count) with `topk` 1 or unset; ValueError naming the flag where one is wrong."""
    for flag, v, least in (("speculative_num_draft_tokens", num_draft_tokens, 2),
                           ("speculative_num_steps", steps, 1),
                           ("speculative_eagle_topk", topk, 1)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
            raise ValueError(f"{flag} must be an integer >= {least}, got {v!r}")
    if topk is not None and topk != 1:
        raise ValueError(f"speculative_eagle_topk {topk}: minisgl drafts one chain of tokens "
                         f"(topk 1), not a tree")
    if name == "NGRAM" and (steps is not None or topk is not None):
        flag = "speculative_num_steps" if steps is not None else "speculative_eagle_topk"
        raise ValueError(f"{flag} is a draft model's or head's (STANDALONE, EAGLE3), not "
                         f"NGRAM's")
    if steps is not None and num_draft_tokens is not None and num_draft_tokens != steps + 1:
        raise ValueError(f"speculative_num_draft_tokens {num_draft_tokens} with "
                         f"speculative_num_steps {steps}: a chain of drafts (topk 1) takes "
                         f"{steps + 1} (the newest token and a draft a step)")
    if steps is not None:
        return steps
    if num_draft_tokens is None:
        steps_too = "" if name == "NGRAM" else " (or speculative_num_steps, the drafts)"
        raise ValueError(f"speculative_num_draft_tokens must be an integer >= 2 with "
                         f"speculative_algorithm {name} (the newest token and at least one "
                         f"draft){steps_too}, got None")
    return num_draft_tokens - 1


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
