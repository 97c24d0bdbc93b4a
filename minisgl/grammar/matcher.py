"""One request's grammar state on a scheduler rank, and the token bitmask of a batch.

Lockstep: no rank computes the mask for the others. Every rank compiles the same grammar
(compiler.py), makes one `RequestGrammar` per constrained request at the same step, and accepts
the same sampled tokens in the same order (sampling is identical on every rank), so the
deterministic xgrammar matcher is in the same state on every rank and every rank fills the same
bitmask (tests/test_structured_output.py, `test_tp2_constrained_ranks_agree`).

The matcher's state always equals the request's output tokens: the scheduler accepts each token
as it records it, and a request is retracted only when no batch is in flight (so every output
token has been accepted), so a retracted request keeps its matcher as it is and goes on from
there when it is admitted again.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from minisgl.grammar.reasoning import ThinkGate


def full_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """An int32 [rows, ceil(vocab/32)] bitmask allowing every token (xgrammar's layout: bit j of
    word w allows token 32 w + j)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=pin)


class RequestGrammar:
    """A constrained request's xgrammar matcher: what it may sample next, and whether it is
    done (terminated: it accepted a stop token, or reached an end where nothing may follow).

    A reasoning model's thinking goes free (grammar/reasoning.py; `gate` from the request's
    StructuredOutput): while `thinking`, every token is allowed and none reaches the matcher,
    until the end marker; where the output may open its thinking (`opening`: its first
    token), that token is the grammar's or the start marker."""

    def __init__(self, compiled: Any, stop_ids: Sequence[int],
                 gate: ThinkGate = ThinkGate()) -> None:
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None,
                                          terminate_without_stop_token=False)
        self.gate = gate
        self.thinking = gate.end >= 0 and gate.thinking
        self.opening = gate.end >= 0 and not gate.thinking and gate.start >= 0

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the mask
        prevents that, so it means a bug, or a token sampled without the mask)."""
        if self.opening:
            self.opening = False
            if token == self.gate.start:
                self.thinking = True
                return True
        if self.thinking:
            self.thinking = token != self.gate.end
            return True
        return bool(self.matcher.accept_token(token))

    @property
    def constraining(self) -> bool:
        """Whether the next token is masked (not inside the thinking, not terminated)."""
        return not self.thinking and not self.terminated

    @property
    def terminated(self) -> bool:
        return not self.thinking and bool(self.matcher.is_terminated())


def fill_bitmask(grammars: List[Optional[RequestGrammar]], vocab_size: int,
                 pin: bool = False, batch_matcher: Any = None) -> torch.Tensor:
    """The bitmask of a batch's sampled rows: row i from grammars[i]'s next-token set, every
    token allowed where grammars[i] is None, thinking or terminated (an unconstrained request,
    a reasoning model's thinking, or one that finished while this batch was planned: its
    token is dropped), the thinking's start marker too where it may open it. `batch_matcher` (an
    xgrammar.BatchGrammarMatcher) fills many rows in parallel threads."""
    bitmask = full_bitmask(len(grammars), vocab_size, pin)
    rows = [i for i, g in enumerate(grammars) if g is not None and g.constraining]
    if not rows:
        return bitmask
    matchers = [grammars[i].matcher for i in rows]  # type: ignore[union-attr]
    if batch_matcher is not None and len(rows) > 1:
        batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    else:
        for i, m in zip(rows, matchers):
            m.fill_next_token_bitmask(bitmask, i)
    for i in rows:  # a first token that may open the thinking instead
        grammar = grammars[i]
        if grammar is not None and grammar.opening:
            start = grammar.gate.start
            word = int(bitmask[i, start // 32]) | (1 << (start % 32))
            bitmask[i, start // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return bitmask
