"""OpenAI's embeddings endpoint (POST /v1/embeddings): its body, the job it runs, its response.

Each input (a string, or a list of token ids; one or a list of them) is one request of the
scheduler with `params.embed`: its prompt is computed and the final norm's hidden state of its
last token, L2-normalized (vLLM's default pooling of a decoder model), comes back instead of
text. `encoding_format` "float" answers lists of numbers, "base64" the float32 little-endian
bytes in base64 (what the official client asks for by default and decodes). `dimensions`
cuts a Matryoshka model's embeddings (ModelConfig.matryoshka_dimensions) to their first values,
normalized again; other models' are refused (a prefix of theirs means nothing). Text is
tokenized with the tokenizer's special tokens, as vLLM does.
"""

from __future__ import annotations

import base64
from array import array
from typing import Any, Dict, Iterator, List, Literal, Optional, Tuple, Union

from minisgl.core import SamplingParams
from minisgl.message.types import ReplyChunk
from minisgl.models.pooling import Pooling, dimensions_error, shortened
from minisgl.server.protocol import ApiError, Body, Job, Prompt, checked_id, listed_prompts
from minisgl.server.responses import Choice, Formatter

EMBEDDINGS_PATH = "/v1/embeddings"
# OpenAI's limit on one embeddings request's inputs (clients batch documents up to it, e.g.
# LangChain's 1,000); each is a request of its own to the scheduler
MAX_INPUTS = 2048


class EmbeddingRequest(Body):
    """OpenAI's embeddings body, with vLLM's extensions."""

    input: Union[str, List[str], List[int], List[List[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's extensions
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    request_id: Optional[str] = None
    normalize: Optional[bool] = None  # False: the pooled states as they are (None: the model's)


def embeddings_job(body: EmbeddingRequest, hidden_size: int,
                   matryoshka: Optional[Tuple[int, ...]] = None,
                   pooling: Pooling = Pooling()) -> Job:
    """The requests of an embeddings body, pooled as `pooling` says (the model's:
    models/pooling.py; `body.normalize` may override its normalization); ApiError(400)
    naming the field that cannot be served (an empty input, more than MAX_INPUTS inputs,
    `dimensions` the model does not allow: `matryoshka`, pooling.dimensions_error; an unknown
    field)."""
    extra = sorted(body.model_extra or {})
    if extra:
        raise ApiError(400, f"{extra[0]} is not supported by this server's embeddings",
                       extra[0])
    error = (None if body.dimensions is None
             else dimensions_error(body.dimensions, matryoshka, hidden_size))
    if error is not None:
        raise ApiError(400, error, "dimensions")
    normalize = pooling.normalize if body.normalize is None else body.normalize
    return embedding_job(listed_prompts(body.input, "input", body.add_special_tokens,
                                        MAX_INPUTS),
                         body.truncate_prompt_tokens, body.request_id, pooling.mode, normalize)


def embedding_job(prompts: List[Prompt], truncate: Optional[int],
                  request_id: Optional[str], pooling: str = "last", normalize: bool = True
                  ) -> Job:
    """One embedding request per prompt (in order), pooled as `pooling` says (one of
    core.POOLINGS) and L2-normalized where `normalize`, each truncated to its last `truncate`
    tokens where given; ApiError(400) naming a bad truncate_prompt_tokens or request_id."""
    params = SamplingParams(max_tokens=1, temperature=0.0, embed=True, pooling=pooling,
                            normalize=normalize, truncate_prompt_tokens=truncate)
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(400, str(e), "truncate_prompt_tokens") from None
    return Job(prompts, params, n=1, stop=(), skip_special_tokens=True, stream=False,
               include_usage=False, request_id=checked_id(request_id, "request_id"))


def vector(choice: Choice) -> array:
    """A finished embedding request's vector (float32 values); ApiError(500) where the
    engine sent none."""
    if choice.embedding is None:
        raise ApiError(500, "the engine returned no embedding", code="internal_error",
                       kind="server_error")
    values = array("f")
    values.frombytes(choice.embedding)
    return values


class EmbeddingFormatter(Formatter):
    """OpenAI's list of embeddings, one per input in order, and the prompt tokens used."""

    id_prefix = "embd"
    prompt_param = "input"

    def __init__(self, model: str, job: Job, encoding: str,
                 dimensions: Optional[int] = None) -> None:
        super().__init__(model, job)
        self.encoding, self.dimensions = encoding, dimensions
        self.normalize = job.params.normalize  # a cut embedding is normalized again, or not

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        tokens = sum(c.prompt_tokens for c in choices)
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model,
                "data": [{"object": "embedding", "index": i, "embedding": self._vector(c)}
                         for i, c in enumerate(choices)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _vector(self, choice: Choice) -> Union[str, List[float]]:
        values = vector(choice)
        if self.dimensions is not None:
            values = array("f", shortened(values, self.dimensions, self.normalize))
        if self.encoding == "base64":
            return base64.b64encode(values.tobytes()).decode("ascii")
        return values.tolist()

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        return iter(())  # never streamed

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        return iter(())
