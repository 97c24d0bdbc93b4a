"""vLLM's score API (/score, /v1/score) and the rerank API of Jina and Cohere (/rerank,
/v1/rerank), as vLLM answers them. A cross-encoder (a one-label sequence classifier:
models/classifier.py) reads each pair at once, its two texts tokenized as the tokenizer pairs
them, and the pair's score is the sigmoid of its logit (the logit itself where the request's
or the server's `use_activation` is false; standardized first by pooler_config's
`logit_mean` / `logit_sigma`). Any other model scores by embeddings
(embeddings.py): the cosine similarity of its two texts' embeddings, which are unit vectors,
so their dot product.

Score: `text_1` one text and `text_2` one or a list (each paired with text_1), or two lists
of one length (paired in order). Rerank: `query` and `documents`, answered best first, the
`top_n` best (all where unset). Every distinct text is embedded once, as one request; a
cross-encoder runs one request a pair.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from minisgl.message.types import ReplyChunk
from minisgl.models.classifier import LogitActivation
from minisgl.models.pooling import paired_texts
from minisgl.server.embeddings import MAX_INPUTS, embedding_job, vector
from minisgl.server.protocol import ApiError, Body, Job, Prompt
from minisgl.server.responses import Choice, Formatter

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


class ScoreRequest(Body):
    """vLLM's score body."""

    text_1: Union[str, List[str]]
    text_2: Union[str, List[str]]
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    request_id: Optional[str] = None
    use_activation: Optional[bool] = None  # a cross-encoder's: False answers its logit


class RerankRequest(Body):
    """Jina's and Cohere's rerank body (`return_documents`: each result carries its text)."""

    query: str
    documents: List[str]
    model: Optional[str] = None
    top_n: Optional[int] = None
    return_documents: bool = True
    truncate_prompt_tokens: Optional[int] = None
    request_id: Optional[str] = None
    use_activation: Optional[bool] = None


class Pairs:
    """What a body runs (`job`) and how its pairs' scores come out of it: with `cross`, one
    request a pair (text_pair: the tokenizer's pair encoding); else one embedding per
    distinct text, the pairs indices into them."""

    def __init__(self, firsts: List[str], seconds: List[str], body: Any, cross: bool,
                 pooling: str = "last", activation: LogitActivation = LogitActivation()
                 ) -> None:
        """`activation`: a cross-encoder's (the server's, with the body's `use_activation`,
        which an embedding model's cosine similarity does not take: a 400)."""
        extra = sorted(body.model_extra or {})
        if not cross and body.use_activation is not None:
            extra.insert(0, "use_activation")
        if extra:
            raise ApiError(400, f"{extra[0]} is not supported by this server's scoring",
                           extra[0])
        self.activation = activation.for_request(body.use_activation)
        texts = list(dict.fromkeys(firsts + seconds))
        if any(not t for t in texts):
            raise ApiError(400, "the texts must not be empty", "text_1")
        runs = len(firsts) if cross else len(texts)
        if runs > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} {'pairs' if cross else 'distinct texts'}"
                                f", got {runs}", "text_2")
        self.cross = cross
        if cross:
            prompts = [Prompt(text=a, text_pair=b, add_special_tokens=True)
                       for a, b in zip(firsts, seconds)]
            self.pairs = [(i, i) for i in range(len(firsts))]
        else:
            index = {t: i for i, t in enumerate(texts)}
            prompts = [Prompt(text=t, add_special_tokens=True) for t in texts]
            self.pairs = [(index[a], index[b]) for a, b in zip(firsts, seconds)]
        self.job = embedding_job(prompts, body.truncate_prompt_tokens, body.request_id,
                                 "last" if cross else pooling)

    def scores(self, choices: List[Choice]) -> List[float]:
        """Each pair's score from the job's finished choices."""
        if self.cross:
            return [self.activation.score(vector(c)[0]) for c in choices]
        vectors = [vector(c) for c in choices]
        return [sum(x * y for x, y in zip(vectors[a], vectors[b])) for a, b in self.pairs]


def score_pairs(body: ScoreRequest, cross: bool, pooling: str = "last",
                activation: LogitActivation = LogitActivation()) -> Pairs:
    """The pairs to score (a cross-encoder's, or embeddings pooled as `pooling` says);
    ApiError(400) naming text_2 where the texts do not pair (pooling.paired_texts)."""
    try:
        firsts, seconds = paired_texts(body.text_1, body.text_2)
    except ValueError as e:
        raise ApiError(400, str(e), "text_2") from None
    return Pairs(firsts, seconds, body, cross, pooling, activation)


def rerank_pairs(body: RerankRequest, cross: bool, pooling: str = "last",
                 activation: LogitActivation = LogitActivation()) -> Pairs:
    """The query paired with each document; ApiError(400) naming an empty documents list or
    a top_n below 1."""
    if not body.documents:
        raise ApiError(400, "documents must not be empty", "documents")
    if body.top_n is not None and body.top_n < 1:
        raise ApiError(400, f"top_n must be >= 1, got {body.top_n}", "top_n")
    return Pairs([body.query] * len(body.documents), list(body.documents), body, cross,
                 pooling, activation)


def _usage(choices: List[Choice]) -> Dict[str, int]:
    tokens = sum(c.prompt_tokens for c in choices)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


class _PairFormatter(Formatter):
    """Never streamed."""

    prompt_param = "text_1"

    def __init__(self, model: str, job: Job, pairs: Pairs) -> None:
        """`job`: `pairs.job` as the endpoint sends it (with the client's id, an adapter)."""
        super().__init__(model, job)
        self.pairs = pairs

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        return iter(())

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        return iter(())


class ScoreFormatter(_PairFormatter):
    id_prefix = "score"

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(self.pairs.scores(choices))],
                "usage": _usage(choices)}


class RerankFormatter(_PairFormatter):
    id_prefix = "rerank"
    prompt_param = "documents"

    def __init__(self, model: str, job: Job, pairs: Pairs, body: RerankRequest) -> None:
        super().__init__(model, job, pairs)
        self.body = body

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        ranked: List[Tuple[int, float]] = sorted(enumerate(self.pairs.scores(choices)),
                                                 key=lambda e: -e[1])
        results = []
        for i, score in ranked[:self.body.top_n]:
            entry: Dict[str, Any] = {"index": i, "relevance_score": score}
            if self.body.return_documents:
                entry["document"] = {"text": self.body.documents[i]}
            results.append(entry)
        return {"id": self.id, "model": self.model, "usage": _usage(choices),
                "results": results}
