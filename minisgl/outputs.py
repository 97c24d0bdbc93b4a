"""What the offline API returns: one `GenerateOutput` per prompt, holding its n choices, with
vLLM's `RequestOutput` / `CompletionOutput` / `Logprob` names so that a script ported from
vLLM reads them unchanged; our own short names (`out.text`, `out.token_ids`, ...) read the
first choice, which is the whole output at n = 1."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Generic, List, Optional, TypeVar, Union

from minisgl.core import TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob`: one token's log-probability, its rank in the model's distribution
    (1: the most likely; None where not computed) and the token decoded on its own, special
    tokens included (None with `detokenize=False` or without a tokenizer)."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


def vllm_step(token: int, lp: TokenLogprobs, texts: Dict[int, str]) -> Dict[int, Logprob]:
    """One position's log-probabilities as vLLM gives them: the token there first, then the
    k most likely (one entry where it is among them)."""
    step = {token: Logprob(lp.logprob, lp.rank, texts.get(token))}
    for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
        step.setdefault(t, Logprob(v, rank, texts.get(t)))
    return step


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's `CompletionOutput`: one choice of a prompt. `token_logprobs`: one TokenLogprobs
    per token of `token_ids` where params.logprobs was set, else None; `logprobs` gives them
    in vLLM's shape. `stop_reason`: the stop string or the stop_token_ids token that ended the
    output; None for EOS, a grammar's end, or max_tokens."""
    index: int
    text: str
    token_ids: List[int]
    finish_reason: str
    stop_reason: Union[None, int, str] = None
    token_logprobs: Optional[List[TokenLogprobs]] = None
    # Each token id in the log-probabilities decoded on its own (Logprob.decoded_token).
    decoded_tokens: Dict[int, str] = dataclasses.field(default_factory=dict, repr=False)
    # With params.return_hidden_states (SGLang's): [prompt + output tokens - 1, hidden] float32,
    # the final hidden state of every position that gave a token (the prompt's, then each
    # output token's but the last); None otherwise
    hidden_states: Optional["torch.Tensor"] = dataclasses.field(default=None, repr=False)

    @property
    def cumulative_logprob(self) -> Optional[float]:
        """The sum of the tokens' log-probabilities where params.logprobs was set, else None
        (as vLLM, which computes it only when logprobs are asked for)."""
        if self.token_logprobs is None:
            return None
        return float(sum(lp.logprob for lp in self.token_logprobs))

    @property
    def logprobs(self) -> Optional[List[Dict[int, Logprob]]]:
        """One {token id: Logprob} per output token: the sampled token first, then the k most
        likely; None where params.logprobs was not set."""
        if self.token_logprobs is None:
            return None
        return [vllm_step(t, lp, self.decoded_tokens)
                for t, lp in zip(self.token_ids, self.token_logprobs)]


@dataclass(frozen=True)
class RequestStateStats:
    """vLLM's `RequestOutput.metrics`: when a request arrived, was admitted and got its first
    and last tokens. `arrival_time` is the wall clock (time.time()) at submission; the `_ts`
    times are on the monotonic clock (time.monotonic()): queued at submission, scheduled at
    admission (queued plus the queue time rank 0's scheduler measured), first and last token
    as they reached the caller's process. `num_generation_tokens`: the output tokens."""

    arrival_time: float
    queued_ts: float
    scheduled_ts: float
    first_token_ts: float
    last_token_ts: float
    num_generation_tokens: int

    @property
    def first_token_latency(self) -> float:
        """Seconds from submission to the first token (vLLM's time to first token)."""
        return self.first_token_ts - self.queued_ts


@dataclass(frozen=True)
class GenerateOutput:
    """One prompt's request (vLLM's `RequestOutput`): its choices in `outputs` (n of them,
    `index` 0..n-1), the prompt's ids and text (`prompt`: None where it was given as ids, or
    as a chat), and what its first choice's prefill found: `prompt_tokens`, `cached_tokens`
    (prompt tokens whose KV came from the prefix cache) and, where params.prompt_logprobs was
    set, `prompt_token_logprobs` (one per prompt token after the first; `prompt_logprobs`
    gives them in vLLM's shape); `metrics`: the first choice's times (RequestStateStats)."""
    outputs: List[CompletionOutput]
    prompt_tokens: int
    cached_tokens: int
    prompt_token_ids: List[int] = dataclasses.field(default_factory=list)
    request_id: str = ""
    prompt: Optional[str] = None
    prompt_token_logprobs: Optional[List[TokenLogprobs]] = None
    decoded_tokens: Dict[int, str] = dataclasses.field(default_factory=dict, repr=False)
    metrics: Optional[RequestStateStats] = None

    @property
    def text(self) -> str:
        """The first choice's text (the output's, at n = 1); so for the properties below."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> List[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> Union[None, int, str]:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> Optional[List[TokenLogprobs]]:
        return self.outputs[0].token_logprobs

    @property
    def cumulative_logprob(self) -> Optional[float]:
        return self.outputs[0].cumulative_logprob

    @property
    def finished(self) -> bool:
        """Always True: `generate` returns finished outputs only."""
        return True

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's name for `cached_tokens`."""
        return self.cached_tokens

    @property
    def prompt_logprobs(self) -> Optional[List[Optional[Dict[int, Logprob]]]]:
        """vLLM's `RequestOutput.prompt_logprobs`: one entry per prompt token, None for the
        first (nothing precedes it), then {token id: Logprob} holding the prompt token and the
        k most likely there; None where params.prompt_logprobs was not set."""
        if self.prompt_token_logprobs is None:
            return None
        steps = zip(self.prompt_token_ids[1:], self.prompt_token_logprobs)
        return [None, *(vllm_step(t, lp, self.decoded_tokens) for t, lp in steps)]


@dataclass(frozen=True)
class EmbeddingOutput:
    """vLLM's `EmbeddingOutput`: the prompt's embedding (the final norm's hidden state of its
    last token, L2-normalized)."""
    embedding: List[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


PooledT = TypeVar("PooledT")


@dataclass(frozen=True)
class PooledRequestOutput(Generic[PooledT]):
    """What vLLM's pooling calls return for one prompt, in order: its id, its output and its
    tokens."""
    request_id: str
    outputs: PooledT
    prompt_token_ids: List[int]
    finished: bool = True

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class EmbeddingRequestOutput(PooledRequestOutput[EmbeddingOutput]):
    """vLLM's `EmbeddingRequestOutput`: one per prompt of `LLM.embed`."""


@dataclass(frozen=True)
class ClassificationOutput:
    """vLLM's `ClassificationOutput`: a prompt's label probabilities (softmax over two or more
    labels, the sigmoid of one: models/classifier.probabilities)."""
    probs: List[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PooledRequestOutput[ClassificationOutput]):
    """vLLM's `ClassificationRequestOutput`: one per prompt of `LLM.classify`."""


@dataclass(frozen=True)
class PoolingOutput:
    """vLLM's `PoolingOutput`: a prompt's raw pooled values (a classifier's logits: a reward
    model's reward)."""
    data: List[float]


class PoolingRequestOutput(PooledRequestOutput[PoolingOutput]):
    """vLLM's `PoolingRequestOutput`: one per prompt of `LLM.reward`."""


@dataclass(frozen=True)
class ScoringOutput:
    """vLLM's `ScoringOutput`: a pair's score (the cosine similarity of an embedding model's
    embeddings, or a one-label classifier's sigmoid on the pair: a cross-encoder)."""
    score: float


@dataclass(frozen=True)
class ScoringRequestOutput:
    """vLLM's `ScoringRequestOutput`: one per pair of `LLM.score`, in order."""
    request_id: str
    outputs: ScoringOutput
    finished: bool = True
