"""vLLM's classification API (POST /classify, /v1/classify) of a sequence classification model
(models/classifier.py): each input's label probabilities (softmax over two or more labels, the
sigmoid of one; its logits where `use_activation` is false) and its most probable label; and
its pooling API (POST /pooling): each input's raw pooled values (a classifier's logits, a
reward model's reward; an embedding model's embedding).

Each input (a string, token ids, or a list of either) is one embedding request of the
scheduler, whose pooled values are the head's logits (CausalLM.pooled). Never streamed.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from minisgl.message.types import ReplyChunk
from minisgl.models.classifier import LogitActivation
from minisgl.server.embeddings import MAX_INPUTS, embedding_job, vector
from minisgl.server.protocol import ApiError, Body, Job, listed_prompts
from minisgl.server.responses import Choice, Formatter

CLASSIFY_PATHS = ("/classify", "/v1/classify")
POOLING_PATH = "/pooling"


class ClassifyRequest(Body):
    """vLLM's classification body (its pooling body alike)."""

    input: Union[str, List[str], List[int], List[List[int]]]
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    request_id: Optional[str] = None
    user: Optional[str] = None
    use_activation: Optional[bool] = None  # classify: False answers the logits (vLLM's)


def classify_job(body: ClassifyRequest, what: str = "classification",
                 pooling: str = "last") -> Job:
    """One request per input, in order, pooled as `pooling` says (a classifier: its last
    token); ApiError(400) naming what cannot be served (an empty input, more than
    MAX_INPUTS, an unknown field)."""
    extra = sorted(body.model_extra or {})
    if what != "classification" and body.use_activation is not None:
        extra.insert(0, "use_activation")
    if extra:
        raise ApiError(400, f"{extra[0]} is not supported by this server's {what}", extra[0])
    return embedding_job(listed_prompts(body.input, "input", body.add_special_tokens,
                                        MAX_INPUTS),
                         body.truncate_prompt_tokens, body.request_id, pooling)


class ClassifyFormatter(Formatter):
    """vLLM's list of classifications, one per input in order."""

    id_prefix = "classify"
    prompt_param = "input"

    def __init__(self, model: str, job: Job, labels: Tuple[str, ...],
                 activation: LogitActivation = LogitActivation()) -> None:
        """`activation`: the server's (pooler_config) with the request's `use_activation`."""
        super().__init__(model, job)
        self.labels = labels
        self.activation = activation

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        tokens = sum(c.prompt_tokens for c in choices)
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model,
                "data": [self._entry(i, c) for i, c in enumerate(choices)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0}}

    def _entry(self, index: int, choice: Choice) -> Dict[str, Any]:
        probs = self.activation.probabilities(vector(choice).tolist())
        best = max(range(len(probs)), key=probs.__getitem__)
        return {"index": index, "label": self.labels[best], "probs": probs,
                "num_classes": len(probs)}

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        return iter(())  # never streamed

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        return iter(())


class PoolingFormatter(Formatter):
    """vLLM's list of pooled outputs, one per input in order: the raw values."""

    id_prefix = "pool"
    prompt_param = "input"

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        tokens = sum(c.prompt_tokens for c in choices)
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model,
                "data": [{"index": i, "object": "pooling", "data": vector(c).tolist()}
                         for i, c in enumerate(choices)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0}}

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        return iter(())  # never streamed

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        return iter(())
