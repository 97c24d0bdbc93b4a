"""Beam search over HTTP: vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions
(protocol.py reads it and refuses what a beam search does not take; `n` is the beam width).

The search is the offline API's (`minisgl.beam_search`), driven here by the API server: each
step is one job holding every live beam of every prompt as a prompt of token ids, each asking
for one token and its 2 x n most likely next tokens with their log-probabilities (greedy, no
penalties: the model's raw log-probabilities); the prefix cache holds the beams, so a step
prefills about a token a beam. Each prompt's n best beams, best first, are its n choices: the
generated tokens decoded (a final EOS left out of the text unless include_stop_str_in_output,
as vLLM), finish_reason "stop" where an EOS ended the beam, else "length". max_tokens unset
(chat) is what the context leaves after the prompt. The reply has the endpoint's usual shape; a
stream carries each choice whole in one chunk once the search ends (as vLLM's does).

This module only sequences the search: the round trips (tokenize, a step's job, detokenize)
are the caller's (`BeamServer`), which raise the endpoint's errors.
"""

from __future__ import annotations

from typing import Awaitable, Callable, List, NamedTuple, Sequence, Tuple

from minisgl.beam_search import BeamSearch, BeamSearchParams
from minisgl.core import SamplingParams
from minisgl.message.types import ReplyChunk
from minisgl.server.protocol import ApiError, Job, Prompt

BEAM_WIDTH_PARAM = "n"  # the request field that is the beam width (errors name it)


class BeamLimits(NamedTuple):
    """The model's and the engine's, for every search."""

    eos_ids: Tuple[int, ...]  # a candidate among them completes its beam (unless ignore_eos)
    max_context: int  # prompt plus generated tokens
    max_logprobs: int  # the most likely tokens a step may ask for (the engine's cap)


class BeamServer(NamedTuple):
    """The round trips a search makes, each raising ApiError for a failure."""

    encode: Callable[[Prompt], Awaitable[List[int]]]  # a prompt's token ids
    # a job run to its end: each prompt's final chunk, its log-probabilities accumulated
    run: Callable[[Job], Awaitable[List[ReplyChunk]]]
    decode: Callable[[List[int], bool], Awaitable[str]]  # (ids, skip_special_tokens) -> text


def _check_width(job: Job, limits: BeamLimits) -> None:
    """ApiError(400) with the numbers where the width asks each step for more
    log-probabilities than the engine returns."""
    if 2 * job.n > limits.max_logprobs:
        raise ApiError(400, f"n {job.n}: a beam search asks each step for the 2 x n = "
                            f"{2 * job.n} most likely tokens, more than this server returns "
                            f"(max_logprobs {limits.max_logprobs})", BEAM_WIDTH_PARAM)


def _params(job: Job, prompt_len: int, limits: BeamLimits, index: int) -> BeamSearchParams:
    """Prompt `index`'s search parameters; ApiError(400) with the numbers where the prompt
    and max_tokens outgrow the context."""
    where = f"prompt {index}: " if len(job.prompts) > 1 else ""
    max_context = limits.max_context
    max_tokens = job.params.max_tokens
    if max_tokens is None:
        max_tokens = max_context - prompt_len
    if max_tokens < 1 or prompt_len + max_tokens > max_context:
        raise ApiError(400, f"{where}{prompt_len} prompt tokens + max_tokens {max_tokens} "
                            f"exceed the context of {max_context} tokens", "max_tokens")
    return BeamSearchParams(job.n, max_tokens, ignore_eos=job.params.ignore_eos,
                            length_penalty=job.length_penalty)


def _step_job(job: Job, beams: Sequence[List[int]]) -> Job:
    """One step of every live beam: a prompt of its tokens each, one greedy token with its
    2 x n most likely alternatives (the request's adapter, cache namespace and priority)."""
    p = job.params
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * job.n,
                            lora_name=p.lora_name, cache_salt=p.cache_salt,
                            priority=p.priority)
    return Job([Prompt(input_ids=list(b)) for b in beams], params, 1, (), True, False, False,
               request_id=job.request_id, trace_headers=job.trace_headers)


def _offered(chunk: ReplyChunk) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """A step's candidate next tokens and their log-probabilities, most likely first."""
    if not chunk.logprobs:
        raise ApiError(500, "a beam search step came back without log-probabilities",
                       kind="server_error")
    return chunk.logprobs[0].top_ids, chunk.logprobs[0].top_logprobs


async def beam_search(job: Job, server: BeamServer, limits: BeamLimits) -> List[ReplyChunk]:
    """Each prompt's n best beams, best first, as one final chunk each (choice i of prompt p
    at p * n + i, uid its index); a final EOS stays in the text where the request keeps stop
    strings (include_stop_str_in_output: `job.no_stop_trim`)."""
    _check_width(job, limits)
    prompts = [await server.encode(p) for p in job.prompts]
    searches = [BeamSearch(ids, _params(job, len(ids), limits, i), limits.eos_ids)
                for i, ids in enumerate(prompts)]
    step = 0
    while True:
        growing = [s for s in searches if s.live and step < s.params.max_tokens]
        if not growing:
            break
        chunks = iter(await server.run(_step_job(job, [b.tokens for s in growing
                                                       for b in s.live])))
        for search in growing:  # each takes its live beams' chunks, in order
            search.step([_offered(next(chunks)) for _ in search.live])
        step += 1
    out: List[ReplyChunk] = []
    for ids, search in zip(prompts, searches):
        for beam in search.best():
            made = beam.tokens[len(ids):]
            shown = made[:-1] if beam.finish_reason == "stop" and not job.no_stop_trim else made
            text = await server.decode(shown, job.skip_special_tokens)
            out.append(ReplyChunk(len(out), text, made, beam.finish_reason,
                                  prompt_tokens=len(ids), completion_tokens=len(made)))
    return out

