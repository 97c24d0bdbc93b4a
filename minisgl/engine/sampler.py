"""Token sampling: greedy, temperature, top-k, top-p, min-p, with counter-based noise; the
per-request logit edits before it (logit_bias, allowed_token_ids, min_tokens, the grammar's token
bitmask; the penalties live in penalties.py) and the log-probabilities of what was sampled.

Random sampling is Gumbel-max with noise from a hash of (seed, step, token id), computed with
integer tensor ops. So the token depends only on the logits, the request's seed and how many
tokens it has generated: identical on every rank, on any device, in any batch composition, with
no generator state to keep in step. A request without a seed uses its uid mixed with the engine's
seed.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from minisgl.core import Req
from minisgl.kernels.policy import KernelPolicy
from minisgl.utils import to_device

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# vLLM's floor for a positive temperature: logits / 1e-39 overflow to inf, and the argmax of a
# row of infs is its first token, not the most likely one.
MIN_TEMPERATURE = 1e-2
# Odd multipliers below 2**31 keep every product of a 32-bit value inside int64 (no overflow).
_MUL = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)


class SamplingTensors(NamedTuple):
    temperature: torch.Tensor  # [B] float32, 1 for greedy rows (unused there)
    top_k: torch.Tensor  # [B] int64, <= 0 disables
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64 in [0, 2**32)
    step: torch.Tensor  # [B] int64: tokens generated before this one
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_filter: bool


def request_seed(req: Req, engine_seed: int) -> int:
    """The request's 32-bit noise seed: its own seed (any int, negative too), else its uid mixed
    with the engine's, taken to 64 bits and through SplitMix64's finalizer (a bijection), whose
    top half is kept. So no two seeds collide by construction (1 and 2**32 did when the halves
    were XORed), only by chance, 1 in 2**32."""
    seed = req.params.seed if req.params.seed is not None else (engine_seed << 32) ^ (req.uid + 1)
    z = seed & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


def make_sampling_tensors(reqs: List[Req], engine_seed: int, device: torch.device
                          ) -> SamplingTensors:
    ps = [r.params for r in reqs]
    greedy = [p.is_greedy for p in ps]
    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)
    return SamplingTensors(
        temperature=t([1.0 if g else max(p.temperature, MIN_TEMPERATURE)
                       for p, g in zip(ps, greedy)], torch.float32),
        top_k=t([p.top_k for p in ps], torch.int64),
        top_p=t([p.top_p for p in ps], torch.float32),
        min_p=t([p.min_p for p in ps], torch.float32),
        seed=t([request_seed(r, engine_seed) for r in reqs], torch.int64),
        step=t([r.device_len - r.prompt_len for r in reqs], torch.int64),
        greedy=t(greedy, torch.bool),
        all_greedy=all(greedy),
        any_filter=any(not g and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)
                       for p, g in zip(ps, greedy)),
    )


def _mix32(x: torch.Tensor) -> torch.Tensor:
    for mul in _MUL:
        x = x ^ (x >> 16)
        x = (x * mul) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 in (0, 1), a pure function of (seed, step, column)."""
    col = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    row = _mix32((seed * 0x9E3779B) & _MASK32 ^ _mix32(step & _MASK32))
    x = _mix32((row.unsqueeze(1) + col.unsqueeze(0) * 0x3C6EF35) & _MASK32)
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _filter(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """Set to -inf every logit outside the top-k / top-p / min-p sets (rows scaled already).
    In Hugging Face's and vLLM's order: top-p (and min-p) over the distribution that top-k
    leaves, renormalized."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = (s.top_k.unsqueeze(1) > 0) & (rank >= s.top_k.unsqueeze(1))
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before > s.top_p.unsqueeze(1)
    drop |= probs < s.min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def greedy(logits: torch.Tensor, policy: KernelPolicy = KernelPolicy()) -> torch.Tensor:
    """The first index of each row's largest logit, int64 [B]. `policy.fused`: on CUDA, the
    two-launch Triton argmax (kernels/argmax.py), same answer as torch.argmax."""
    if policy.fused and logits.is_cuda:
        from minisgl.kernels import argmax
        return argmax.argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, s: SamplingTensors, policy: KernelPolicy = KernelPolicy()
           ) -> torch.Tensor:
    """logits [B, vocab] float32 -> token ids [B] int64 (`policy`: see greedy)."""
    greedy_tokens = greedy(logits, policy)
    if s.all_greedy:
        return greedy_tokens
    scaled = logits / s.temperature.unsqueeze(1)
    if s.any_filter:
        scaled = _filter(scaled, s)
    gumbel = -torch.log(-torch.log(uniform_noise(s.seed, s.step, logits.shape[-1])))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(s.greedy, greedy_tokens, sampled)


def suppress_early_stops(logits: torch.Tensor, reqs: List[Req]) -> torch.Tensor:
    """min_tokens: -inf for the stop tokens (EOS unless ignored, and stop_token_ids) of every
    request with fewer than `min_tokens` outputs before this one (row i is reqs[i]). Returns
    `logits` itself when none applies, else a new float32 tensor."""
    rows: List[int] = []
    cols: List[int] = []
    vocab = logits.shape[-1]
    for i, req in enumerate(reqs):
        if req.device_len - req.prompt_len < req.params.min_tokens:
            stops = req.params.stop_token_ids + (() if req.params.ignore_eos else req.eos_ids)
            stops = tuple(t for t in stops if t < vocab)  # an id beyond it never comes anyway
            rows.extend([i] * len(stops))
            cols.extend(stops)
    if not rows:
        return logits
    out = logits.float().clone()
    index = to_device([rows, cols], torch.int64, logits.device)
    out[index[0], index[1]] = float("-inf")
    return out


def add_logit_bias(logits: torch.Tensor, reqs: List[Req]) -> torch.Tensor:
    """OpenAI's logit_bias: each request's biases added to its row (row i is reqs[i]). Returns
    `logits` itself when no request has a bias, else a new float32 tensor."""
    rows: List[int] = []
    cols: List[int] = []
    values: List[float] = []
    for i, req in enumerate(reqs):
        for token, bias in (req.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    if not rows:
        return logits
    out = logits.float().clone()  # .float() of a float32 tensor is the tensor itself
    index = to_device([rows, cols], torch.int64, logits.device)
    out.index_put_((index[0], index[1]), to_device(values, torch.float32, logits.device),
                   accumulate=True)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output: -inf for every token of row i whose bit is clear in bitmask row i
    (int32 [B, ceil(vocab / 32)] on the logits' device; bit j of word w stands for token
    32 w + j, xgrammar's layout). Returns a new tensor of the logits' dtype; a row whose
    bits are all set comes out unchanged, so unconstrained requests in a masked batch sample
    exactly what they would alone."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab:  # a narrower mask allows nothing beyond it
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))


def mask_to_allowed_tokens(logits: torch.Tensor, reqs: List[Req]) -> torch.Tensor:
    """vLLM's allowed_token_ids: -inf for every token outside the list of each request that
    has one (row i is reqs[i]), so greedy and random sampling pick only among them. A pure
    function of the requests' params, hence identical on every rank. Returns `logits` itself
    when no request has a list, else a new float32 tensor."""
    rows: List[int] = []
    local: List[int] = []
    cols: List[int] = []
    for i, req in enumerate(reqs):
        allowed = req.params.allowed_token_ids
        if allowed is not None:
            local.extend([len(rows)] * len(allowed))
            cols.extend(allowed)
            rows.append(i)
    if not rows:
        return logits
    device = logits.device
    out = logits.float().clone()
    edit = torch.full((len(rows), logits.shape[-1]), float("-inf"), device=device)
    index = to_device([local, cols], torch.int64, device)
    edit[index[0], index[1]] = 0.0
    row_index = to_device(rows, torch.int64, device)
    out[row_index] += edit
    return out


class LogprobTensors(NamedTuple):
    """Log-probabilities of a batch's sampled rows (see core.TokenLogprobs)."""

    chosen: torch.Tensor  # [B] float32: the sampled token's
    top_ids: torch.Tensor  # [B, k] int64, most likely first
    top_logprobs: torch.Tensor  # [B, k] float32
    rank: torch.Tensor  # [B] int64: tokens at least as likely as the sampled one (1: the top)
    # [B, m] float32: the log-probabilities of each row's asked token ids (params.
    # token_ids_logprob; padded to the most any row asked, m = 0 where none did)
    asked: torch.Tensor


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int,
                   asked_ids: Optional[torch.Tensor] = None) -> LogprobTensors:
    """The sampled `tokens`' log-probabilities and ranks, each row's `k` most likely tokens,
    and the log-probabilities of the token ids in its row of `asked_ids` [B, m] (int64,
    padded), from the raw logits [B, vocab] (log_softmax in float32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
    top_logprobs, top_ids = lp.topk(k, dim=-1)
    rank = (lp >= chosen.unsqueeze(1)).sum(dim=-1)
    asked = lp.new_empty(lp.shape[0], 0) if asked_ids is None else lp.gather(1, asked_ids)
    return LogprobTensors(chosen, top_ids, top_logprobs, rank, asked)


def sample_requests(logits: torch.Tensor, reqs: List[Req], engine_seed: int,
                    policy: KernelPolicy = KernelPolicy()) -> torch.Tensor:
    """Tokens for `reqs` (row i of logits is reqs[i], any float dtype). An all-greedy batch is
    one argmax on the logits as they are (upcasting is exact, so the argmax cannot change), with
    no parameter tensors copied to the device; otherwise sampling runs in float32. `policy`:
    see greedy."""
    if all(r.params.is_greedy for r in reqs):
        return greedy(logits, policy)
    return sample(logits.float(), make_sampling_tensors(reqs, engine_seed, logits.device),
                  policy)
