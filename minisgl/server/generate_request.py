"""SGLang's /generate request: its body (SGLang's names for the sampling fields served,
`max_new_tokens`, `min_new_tokens`, `sampling_seed`; one prompt or a batch) and its job
(protocol.shaped_job, with SGLang's return_logprob options); what SGLang offers and this
server does not is a 400 naming the field, unless its value asks for nothing."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from pydantic import ValidationError

from minisgl.models.generation import SamplingDefaults
from minisgl.server.protocol import (MAX_PROMPTS, ApiError, Body, GenerateLogprobs, Job,
                                     JobShape, Prompt, SamplingBody, check_ids, checked_id,
                                     logit_bias_ids, refuse_unsupported, shaped_job)


class GenerateRequest(Body):
    """SGLang's /generate body (the fields served; others that ask for something: 400): one
    prompt, or a batch (a list of texts or of id lists)."""

    input_ids: Union[None, List[int], List[List[int]]] = None
    text: Union[None, str, List[str]] = None
    sampling_params: SamplingBody = SamplingBody()
    stream: bool = False
    rid: Optional[str] = None  # the request's id (meta_info.id), as X-Request-Id
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: the output's only; k: prompt tokens from k on too
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    # SGLang's: these tokens' log-probabilities at every position logprobs cover (one list,
    # or one a prompt of a batch: the same list)
    token_ids_logprob: Union[None, List[int], List[List[int]]] = None
    lora_path: Optional[str] = None  # SGLang's: the name of a loaded LoRA adapter
    # SGLang's: meta_info.hidden_states, each position's final hidden state (generate_meta)
    return_hidden_states: bool = False


# SGLang's /generate fields this server does not serve, with the values that ask for nothing.
_GENERATE_UNSUPPORTED: Dict[str, Callable[[Any], bool]] = {
    "lora_id": lambda v: v is None,
    "image_data": lambda v: not v,
    "video_data": lambda v: not v,
    "audio_data": lambda v: not v,
    "input_embeds": lambda v: v is None,
    "custom_logit_processor": lambda v: v is None,
    "session_params": lambda v: v is None,
    "bootstrap_host": lambda v: v is None,
    "data_parallel_rank": lambda v: v is None,
}


# SGLang's sampling_params names for fields this server calls otherwise.
_SGLANG_SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                          "sampling_seed": "seed"}
# SGLang sampling_params this server does not serve, with the values that ask for nothing.
_SGLANG_SAMPLING_UNSUPPORTED: Dict[str, Callable[[Any], bool]] = {
    "custom_params": lambda v: not v,
}


class _SGLangSampling(NamedTuple):
    sampling: SamplingBody
    renamed: Dict[str, str]  # our field -> the SGLang name the request used for it


def _sglang_sampling(sampling: SamplingBody) -> _SGLangSampling:
    """/generate's sampling_params with SGLang's names (max_new_tokens, min_new_tokens,
    sampling_seed) as this server's, checked like the rest; ApiError(400) naming a field given
    under both names, or one asking for what is not served."""
    extra = dict(sampling.model_extra or {})
    refuse_unsupported(extra, _SGLANG_SAMPLING_UNSUPPORTED, "sampling_params.")
    given = sampling.model_dump(exclude_unset=True)
    renamed = {}  # ours -> theirs, for errors
    for theirs, ours in _SGLANG_SAMPLING_NAMES.items():
        if theirs in extra:
            if ours in given:
                raise ApiError(400, f"sampling_params: {theirs} and {ours} are the same field; "
                                    f"give one", theirs)
            given[ours], renamed[ours] = extra.pop(theirs), theirs
    if not renamed:
        return _SGLangSampling(sampling, renamed)
    try:
        return _SGLangSampling(SamplingBody.model_validate({**given, **extra}), renamed)
    except ValidationError as e:
        err = e.errors()[0]
        name = renamed.get(str(err["loc"][0]), str(err["loc"][0]))
        raise ApiError(400, f"sampling_params.{name}: {err['msg']}", name) from None


def _generate_prompts(body: GenerateRequest) -> List[Prompt]:
    """The prompts of a /generate body: text tokenized with the tokenizer's special tokens
    (SGLang's), ids as given; ApiError naming an empty one."""
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts or any(t == "" for t in texts):
            raise ApiError(400, "the prompt must not be empty", "text")
        return [Prompt(text=t, add_special_tokens=True) for t in texts]
    ids = body.input_ids or []
    batch = [ids] if not ids or isinstance(ids[0], int) else ids
    if not batch or any(not p for p in batch):
        raise ApiError(400, "the prompt must not be empty", "input_ids")
    for p in batch:
        check_ids("input_ids", p)
    return [Prompt(input_ids=list(p)) for p in batch]


def _asked_ids(body: GenerateRequest, prompts: int) -> Tuple[int, ...]:
    """token_ids_logprob as one list: a batch's list of lists must give each prompt the same
    (a job samples every prompt alike); ApiError(400) naming it otherwise."""
    asked = body.token_ids_logprob or []
    if not asked or isinstance(asked[0], int):
        return tuple(asked)
    if len(asked) != prompts or any(a != asked[0] for a in asked):
        raise ApiError(400, f"token_ids_logprob as a list of lists gives each of the "
                            f"{prompts} prompts its list, and this server asks the same of "
                            f"every prompt of a batch", "token_ids_logprob")
    return tuple(asked[0])


def generate_job(body: GenerateRequest, defaults: SamplingDefaults = SamplingDefaults(),
                 max_n: int = 1) -> Job:
    """SGLang's /generate request's job: its prompt, or its batch of them (each with n
    choices, prompt-major as SGLang orders them)."""
    if (body.input_ids is None) == (body.text is None):
        raise ApiError(400, "exactly one of input_ids and text must be given", "input_ids")
    prompts = _generate_prompts(body)
    if len(prompts) > MAX_PROMPTS:
        field = "text" if body.text is not None else "input_ids"
        raise ApiError(400, f"{field}: at most {MAX_PROMPTS} prompts, got {len(prompts)}", field)
    if len(prompts) > 1 and body.rid is not None:
        raise ApiError(400, "rid names one request; a batch has no single id", "rid")
    refuse_unsupported(body.model_extra or {}, _GENERATE_UNSUPPORTED)
    sampling, renamed = _sglang_sampling(body.sampling_params)
    n = (sampling.model_extra or {}).get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise ApiError(400, f"n must be between 1 and {max_n}, got {n!r}", "n")
    try:
        bias = logit_bias_ids((sampling.model_extra or {}).get("logit_bias"))
        job = shaped_job(JobShape(sampling, n, body.stream, False, sampling.max_tokens,
                                  logit_bias=bias), prompts, defaults)
    except ApiError as e:  # an error about fields the request named otherwise names them so
        theirs = renamed.get(e.param or "")
        if theirs is None:
            raise
        message = e.message
        for ours, name in renamed.items():
            message = re.sub(rf"\b{ours}\b", name, message)
        raise ApiError(e.status, message, theirs) from None
    interval = (sampling.model_extra or {}).get("stream_interval")
    if interval is not None:
        if (not isinstance(interval, int) or isinstance(interval, bool)
                or not 1 <= interval < 2 ** 31):
            raise ApiError(400, f"stream_interval must be a positive integer, got "
                                f"{interval!r:.40}", "stream_interval")
        job = dataclasses.replace(job, stream_interval=interval)
    if body.return_hidden_states:
        job = dataclasses.replace(job, params=dataclasses.replace(job.params,
                                                                  return_hidden_states=True))
    if checked_id(body.rid, "rid") is not None:
        job = dataclasses.replace(job, request_id=body.rid)
    if not body.return_logprob:
        if body.token_ids_logprob:
            raise ApiError(400, "token_ids_logprob needs return_logprob", "token_ids_logprob")
        return job
    if body.logprob_start_len < -1:
        raise ApiError(400, f"logprob_start_len must be -1 (the output only) or a prompt "
                            f"position >= 0, got {body.logprob_start_len}", "logprob_start_len")
    if body.top_logprobs_num < 0:
        raise ApiError(400, f"top_logprobs_num must be >= 0, got "
                            f"{body.top_logprobs_num}", "top_logprobs_num")
    k, ids = body.top_logprobs_num, _asked_ids(body, len(job.prompts))
    params = dataclasses.replace(job.params, logprobs=k, token_ids_logprob=ids,
                                 prompt_logprobs=k if body.logprob_start_len >= 0 else None)
    try:
        params.validate()
    except ValueError as e:  # the message starts with the field it names, as protocol's
        raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None
    shape = GenerateLogprobs(body.logprob_start_len, k, body.return_text_in_logprobs, ids)
    return dataclasses.replace(job, params=params, logprobs_param="top_logprobs_num",
                               generate_logprobs=shape)
