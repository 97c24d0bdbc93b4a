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


def full_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """An int32 [rows, ceil(vocab/32)] bitmask allowing every token (xgrammar's layout: bit j of
    word w allows token 32 w + j)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=pin)


class RequestGrammar:
    """A constrained request's xgrammar matcher: what it may sample next, and whether it is
    done (terminated: it accepted a stop token, or reached an end where nothing may follow)."""

    def __init__(self, compiled: Any, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None,
                                          terminate_without_stop_token=False)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the mask
        prevents that, so it means a bug, or a token sampled without the mask)."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def fill_bitmask(grammars: List[Optional[RequestGrammar]], vocab_size: int,
                 pin: bool = False, batch_matcher: Any = None) -> torch.Tensor:
    """The bitmask of a batch's sampled rows: row i from grammars[i]'s next-token set, every
    token allowed where grammars[i] is None or terminated (an unconstrained request, or one
    that finished while this batch was planned: its token is dropped). `batch_matcher` (an
    xgrammar.BatchGrammarMatcher) fills many rows in parallel threads."""
    bitmask = full_bitmask(len(grammars), vocab_size, pin)
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not rows:
        return bitmask
    matchers = [grammars[i].matcher for i in rows]  # type: ignore[union-attr]
    if batch_matcher is not None and len(rows) > 1:
        batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
    else:
        for i, m in zip(rows, matchers):
            m.fill_next_token_bitmask(bitmask, i)
    return bitmask
