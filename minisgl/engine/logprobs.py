"""Log-probabilities of one rank's batches: which rows to compute them for, computing them on the
device, and turning the host copies into `TokenLogprobs` for the scheduler.

Two kinds: a sampled token's (`params.logprobs`), from the logits it was sampled from, and a
prompt's (`params.prompt_logprobs`), from the logits of the prompt rows of a prefill batch. Every
rank runs the LM head over the prompt rows (a collective under tensor parallelism); only the
primary rank, which alone replies, keeps either kind. The engine copies the tensors to pinned host
memory at launch; the `*_entries` functions wait for the launch's event before reading them.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from minisgl.core import Batch, Phase, Req, TokenLogprobs
from minisgl.engine.sampler import LogprobTensors, token_logprobs
from minisgl.utils import to_device

# Prompt log-probabilities run the LM head over at most this many prompt rows at a time, so a
# long prompt chunk never holds [chunk, vocab] logits at once.
PROMPT_LOGIT_ROWS = 1024


class PromptRows(NamedTuple):
    """The token rows of a prefill batch whose logits give prompt log-probabilities: row j
    predicts prompt token `targets[j]`; request `owners[i]` of the batch owns `counts[i]`
    consecutive rows. Built identically on every rank (the LM head is a collective)."""

    owners: List[int]
    counts: List[int]
    rows: List[int]
    targets: List[int]
    k: int  # alternatives: the largest params.prompt_logprobs asked
    asked: List[Tuple[int, ...]]  # per row: its owner's params.token_ids_logprob


def prompt_rows(batch: Batch) -> Optional[PromptRows]:
    """Rows for the requests still computing prompt log-probabilities (Req.wants_prompt_logprobs):
    token position q of a chunk predicts prompt token q + 1, for q + 1 < prompt_len (the last
    prompt position predicts the first output token: that is the sampled token's logprob)."""
    if batch.phase is not Phase.PREFILL:
        return None
    owners: List[int] = []
    counts: List[int] = []
    rows: List[int] = []
    targets: List[int] = []
    ks: List[int] = []
    asked: List[Tuple[int, ...]] = []
    start = 0
    for i, (req, prefix, ext) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        end = min(prefix + ext, req.prompt_len - 1)
        if req.wants_prompt_logprobs and end > prefix:
            owners.append(i)
            counts.append(end - prefix)
            rows.extend(range(start, start + end - prefix))
            targets.extend(req.token_ids[prefix + 1:end + 1])
            ks.append(req.params.prompt_logprobs or 0)
            asked += [req.params.token_ids_logprob] * (end - prefix)
        start += ext
    return PromptRows(owners, counts, rows, targets, max(ks), asked) if owners else None


def _asked_ids(asked: List[Tuple[int, ...]], device: torch.device) -> Optional[torch.Tensor]:
    """[rows, most asked] int64: each row's asked token ids, padded with token 0 (whose
    log-probability the host drops: `_host_entries`); None where no row asked."""
    width = max((len(a) for a in asked), default=0)
    if not width:
        return None
    return to_device([list(a) + [0] * (width - len(a)) for a in asked], torch.int64, device)


def prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    prompt: PromptRows, keep: bool) -> Optional[LogprobTensors]:
    """Prompt log-probabilities of `prompt`'s rows of `hidden`, PROMPT_LOGIT_ROWS at a time.
    `lm_head` runs on every rank (a collective under tensor parallelism); only a rank that
    `keep`s the result (the primary) computes the log-probabilities; others get None."""
    rows = to_device(prompt.rows, torch.int64, hidden.device)
    targets = to_device(prompt.targets, torch.int64, hidden.device)
    asked = _asked_ids(prompt.asked, hidden.device) if keep else None
    parts: List[LogprobTensors] = []
    for start in range(0, len(prompt.rows), PROMPT_LOGIT_ROWS):
        part = slice(start, start + PROMPT_LOGIT_ROWS)
        logits = lm_head(hidden[rows[part]])
        if keep:
            parts.append(token_logprobs(logits, targets[part], prompt.k,
                                        None if asked is None else asked[part]))
    if not parts:
        return None
    return LogprobTensors(*(torch.cat(t) for t in zip(*parts)))


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: List[Req], keep: bool
                     ) -> Optional[LogprobTensors]:
    """The sampled rows' log-probabilities (up to the largest top-k asked), on a rank that
    `keep`s them (the primary: it alone replies), and only if a request asked."""
    ks = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    if not ks or not keep:
        return None
    return token_logprobs(logits, tokens, max(ks),
                          _asked_ids([r.params.token_ids_logprob for r in reqs], logits.device))


def sampled_entries(batch: Batch, sampled: List[int], lp: Optional[LogprobTensors],
                    done: Optional[torch.cuda.Event]) -> List[Optional[TokenLogprobs]]:
    """Per request of `batch`, its token's log-probabilities where it asked for them
    (`params.logprobs`) and was sampled, else None. Row j of `lp` (host tensors, valid once
    `done` completes) belongs to request sampled[j]."""
    out: List[Optional[TokenLogprobs]] = [None] * batch.size
    if lp is None:
        return out
    ks = [batch.reqs[i].params.logprobs for i in sampled]
    asked = [len(batch.reqs[i].params.token_ids_logprob) for i in sampled]
    for i, k, entry in zip(sampled, ks, _host_entries(done, lp, ks, asked)):
        if k is not None:
            out[i] = entry
    return out


def prompt_entries(batch: Batch, prompt: Optional[PromptRows], lp: Optional[LogprobTensors],
                   done: Optional[torch.cuda.Event]) -> Dict[int, List[TokenLogprobs]]:
    """By batch index, the prompt log-probabilities of `prompt`'s rows (host tensors `lp`, valid
    once `done` completes) for each request still collecting them (Req.wants_prompt_logprobs)."""
    if prompt is None or lp is None:
        return {}
    reqs = batch.reqs
    ks = [reqs[owner].params.prompt_logprobs for owner, n in zip(prompt.owners, prompt.counts)
          for _ in range(n)]
    entries = _host_entries(done, lp, ks, [len(a) for a in prompt.asked])
    out: Dict[int, List[TokenLogprobs]] = {}
    start = 0
    for owner, n in zip(prompt.owners, prompt.counts):
        out[owner] = entries[start:start + n]
        start += n
    return out


def verified_entries(batch: Batch, lp: Optional[LogprobTensors],
                     done: Optional[torch.cuda.Event]) -> List[List[Optional[TokenLogprobs]]]:
    """A verify batch's (every position sampled, request by request): per request, each
    position's token log-probabilities where the request asked for them, else None."""
    rows = [(req.params.logprobs, n) for req, n in zip(batch.reqs, batch.extend_lens)]
    flat: List[Optional[TokenLogprobs]] = []
    if lp is None:
        flat = [None] * sum(n for _, n in rows)
    else:
        ks = [k for k, n in rows for _ in range(n)]
        asked = [len(req.params.token_ids_logprob) for req, n in
                 zip(batch.reqs, batch.extend_lens) for _ in range(n)]
        flat = [e if k is not None else None
                for e, k in zip(_host_entries(done, lp, ks, asked), ks)]
    out, start = [], 0
    for _, n in rows:
        out.append(flat[start:start + n])
        start += n
    return out


def _host_entries(done: Optional[torch.cuda.Event], lp: LogprobTensors,
                  ks: List[Optional[int]], asked: List[int]) -> List[TokenLogprobs]:
    """Row j of `lp` (host tensors, waited for here through `done`) as a TokenLogprobs keeping
    its ks[j] most likely alternatives (None: none) and its asked[j] asked ids' values."""
    if done is not None:
        done.synchronize()
    chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()
    extra = lp.asked.tolist()
    return [TokenLogprobs(c, tuple(i[:k or 0]), tuple(v[:k or 0]), r, tuple(x[:m]))
            for c, i, v, k, r, x, m in zip(chosen, ids, values, ks, lp.rank.tolist(), extra,
                                           asked)]
