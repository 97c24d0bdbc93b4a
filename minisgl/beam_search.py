"""Beam search over the offline API (vLLM's `LLM.beam_search`, its names and semantics).

Each step asks the engine for one token of every live beam with its 2 x beam_width most likely
next tokens (raw log-probabilities), and keeps, per prompt, the beam_width best extensions. A
beam that picks an EOS id (unless `ignore_eos`) is complete and grows no further; the search
ends after `max_tokens` steps or when no beam is live, and each prompt returns its beam_width
best of the complete and live beams. Beams are ranked by cumulative log-probability over
length ** length_penalty, the length counting the prompt and not a final EOS (vLLM's
`get_beam_search_score`). Every step resubmits each beam whole: the prefix cache finds all of
it but the newest token, so a step prefills one token per beam.

Torch-free: pure bookkeeping over what the engine returned (`LLM.beam_search` drives it).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

from minisgl.outputs import Logprob


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`. `temperature` and `include_stop_str_in_output` are taken for
    vLLM's callers and change nothing: beams are ranked by the model's raw log-probabilities,
    as vLLM ranks them, and a beam search has no stop strings."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def check(self, max_logprobs: int) -> None:
        """ValueError naming a field out of range; each step asks for 2 x beam_width
        log-probabilities, which must fit the engine's `max_logprobs`."""
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an integer >= 1, got "
                                 f"{value!r}")
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width {self.beam_width} needs {2 * self.beam_width} "
                             f"log-probabilities a step; max_logprobs is {max_logprobs}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got "
                             f"{self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"BeamSearchParams.length_penalty must be a number, got "
                             f"{self.length_penalty!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    """vLLM's: one beam. `tokens` include the prompt's; `logprobs` hold, per generated token,
    the candidates its step offered (token id -> Logprob, most likely first); `text` is
    `tokens` decoded (the prompt's text included, as vLLM's offline beam search gives it; ""
    for a model without a tokenizer);
    `finish_reason` "stop" (an EOS id ended it) or "length"."""

    tokens: List[int]
    logprobs: List[Dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str = ""
    finish_reason: str = "length"


@dataclasses.dataclass
class BeamSearchOutput:
    """vLLM's: one prompt's best beams, best first."""

    sequences: List[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_ids: Sequence[int], length_penalty: float
               ) -> float:
    """The beam's rank key: cumulative log-probability over its length (prompt included, a
    final EOS not) to the power `length_penalty`."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_ids else 0)
    return beam.cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """One prompt's search: its live beams and the complete ones (see the module doc)."""

    def __init__(self, prompt: List[int], params: BeamSearchParams,
                 eos_ids: Sequence[int]) -> None:
        self.params, self.eos_ids = params, tuple(eos_ids)
        self.live = [BeamSearchSequence(list(prompt), [])]
        self.complete: List[BeamSearchSequence] = []

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_ids, self.params.length_penalty)

    def step(self, offered: Sequence[Tuple[Sequence[int], Sequence[float]]]) -> None:
        """Extend the live beams: `offered[i]` is live beam i's candidate next tokens and their
        log-probabilities, most likely first. Keeps the beam_width best extensions live; an
        extension by an EOS id (unless ignore_eos) goes to the complete beams."""
        if len(offered) != len(self.live):
            raise ValueError(f"{len(offered)} candidate lists for {len(self.live)} live beams")
        grown: List[BeamSearchSequence] = []
        for beam, (ids, logprobs) in zip(self.live, offered):
            step = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(zip(ids, logprobs), 1)}
            for token, logprob in zip(ids, logprobs):
                ended = token in self.eos_ids and not self.params.ignore_eos
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step],
                                         beam.cum_logprob + logprob,
                                         finish_reason="stop" if ended else "length")
                (self.complete if ended else grown).append(new)
        self.live = sorted(grown, key=self._key, reverse=True)[:self.params.beam_width]

    def best(self) -> List[BeamSearchSequence]:
        """The beam_width best of the complete and live beams, best first."""
        return sorted(self.complete + self.live, key=self._key,
                      reverse=True)[:self.params.beam_width]
