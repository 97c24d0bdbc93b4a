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

from typing import Any, List, Optional, Sequence, Tuple

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
        return self._step(token)[0]

    def _step(self, token: int) -> Tuple[bool, bool]:
        """Advance by `token`: (whether allowed, whether the matcher took it: not the
        thinking's). A refused token changes nothing."""
        if self.opening:
            self.opening = False
            if token == self.gate.start:
                self.thinking = True
                return True, False
        if self.thinking:
            self.thinking = token != self.gate.end
            return True, False
        taken = bool(self.matcher.accept_token(token))
        return taken, taken

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Bitmask row `row` (all allowed as it comes) restricted to the next tokens: the
        grammar's, and the thinking's start marker too where the output may open it; left
        all allowed while thinking or terminated."""
        if not self.constraining:
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.allow_opening(bitmask, row)

    def allow_opening(self, bitmask: torch.Tensor, row: int) -> None:
        """Where the output may open its thinking (its first token), allow the start marker
        in bitmask row `row` beside the grammar's tokens."""
        if self.opening:
            start = self.gate.start
            word = int(bitmask[row, start // 32]) | (1 << (start % 32))
            bitmask[row, start // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def fill_drafted(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """A verify step's rows `row` .. `row + len(drafts)`: row j as `fill_row` would fill it
        after the drafts before it were accepted. Past a draft the grammar refuses, the rows
        stay all allowed (the token sampled there differs from that draft, so none after it
        is kept). The state is as it was after."""
        saved, taken = (self.opening, self.thinking), 0
        for j in range(len(drafts) + 1):
            self.fill_row(bitmask, row + j)
            if j == len(drafts):
                break
            allowed, matched = self._step(drafts[j])
            taken += matched
            if not allowed:
                break
        if taken:
            self.matcher.rollback(taken)
        self.opening, self.thinking = saved

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
    chosen = [g for g in grammars if g is not None and g.constraining]
    if batch_matcher is not None and len(rows) > 1:
        batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in chosen], bitmask, rows)
        for i, grammar in zip(rows, chosen):
            grammar.allow_opening(bitmask, i)
    else:
        for i, grammar in zip(rows, chosen):
            grammar.fill_row(bitmask, i)
    return bitmask


def fill_verify_bitmask(grammars: List[Optional[RequestGrammar]], drafts: List[List[int]],
                        vocab_size: int, pin: bool = False) -> torch.Tensor:
    """The bitmask of a verify batch: request i's rows (1 + len(drafts[i]), one per position,
    in batch order) from grammars[i] as it will be at each position
    (`RequestGrammar.fill_drafted`), all allowed where grammars[i] is None."""
    bitmask = full_bitmask(sum(1 + len(d) for d in drafts), vocab_size, pin)
    row = 0
    for grammar, draft in zip(grammars, drafts):
        if grammar is not None:
            grammar.fill_drafted(bitmask, row, draft)
        row += 1 + len(draft)
    return bitmask
