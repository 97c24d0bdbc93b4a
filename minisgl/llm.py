"""The offline API: `LLM(...).generate(prompts, sampling_params)` and
`.chat(messages, sampling_params)`.

With tp=1 the scheduler and engine run in this process behind in-process queues; with tp>1 one
process per rank is spawned and this process plays tokenizer and detokenizer over ZMQ, exactly as
the service does (llm_ranks.py). Bad input raises ValueError naming the values before anything
is submitted.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
import weakref
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import (Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Set,
                    Tuple, Union, cast)

import torch
from tqdm import tqdm

from minisgl.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from minisgl.core import (FinishReason, Limits, LoRARequest, PoolingParams, SamplingParams,
                          StructuredOutput, StructuredOutputsParams, TokenLogprobs,
                          check_request, truncate_prompt)
from minisgl.grammar import make_checker
from minisgl.distributed.weight_group import GroupSpec, check_update
from minisgl.distributed.load_formats import DISK_FORMATS, TENSOR_FORMATS, check_load_format
from minisgl.distributed.tensor_payload import serialize
from minisgl.engine.config import environment_settings
from minisgl.engine.sleep_parts import TAGS as SLEEP_PARTS, check_level, check_tags, sglang_parts
from minisgl.message import AbortMsg, SchedulerStats, TokenOut, UserMsg
from minisgl.message.tensors import from_wire
from minisgl.message.types import (AdapterMsg, GroupMsg, GroupWeightsMsg, ProfileMsg,
                                   SleepMsg, TensorWeightsMsg, WakeMsg, WeightReadMsg,
                                   WeightsMsg, WireTensor)
from minisgl.models import ModelConfig
from minisgl.models.classifier import Classifier, LogitActivation, pair_score_error
from minisgl.models.generation import sampling_defaults
from minisgl.models.lora_config import check_runtime_load
from minisgl.models.path import resolve_model_path
from minisgl.models.pooling import (check_pooler_dimensions, dimensions_error, model_pooling,
                                    paired_texts, shortened)
from minisgl.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput,
                             EmbeddingOutput, EmbeddingRequestOutput, GenerateOutput,
                             PoolingOutput, PoolingRequestOutput, RequestStateStats,
                             ScoringOutput, ScoringRequestOutput)
from minisgl.llm_ranks import InProcessRank, RankProcesses
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Accounting
from minisgl.server.proc import prestart
from minisgl.server.structured import FieldError, constraint
from minisgl.server.tools import assistant_tool_calls
from minisgl.tokenizer.bad_words import with_bad_word_ids
from minisgl.tokenizer.chat_template import CONTENT_FORMATS, chat_prompt_ids
from minisgl.tokenizer.incremental import IncrementalDecoder, StopMatcher
from minisgl.tokenizer.text import (check_tokenizer_mode, load_tokenizer,
                                    resolve_tokenizer_path)
from minisgl.settings import build

logger = logging.getLogger(__name__)
# Text, token ids, or vLLM's TextPrompt / TokensPrompt: {"prompt": text} / {"prompt_token_ids": ids}
Prompt = Union[str, List[int], Dict[str, Any]]
LoraRequests = Union[None, LoRARequest, Sequence[Optional[LoRARequest]]]


class _Collected(NamedTuple):
    """Every request of one `_collected` call, in submission order: its (prompt, choice), ids
    and params, what came back (tokens, log-probabilities, the final TokenOut) and its stop
    watch; and the request id of each prompt."""

    origin: List[Tuple[int, int]]
    prompts: List[List[int]]
    params: List[SamplingParams]
    tokens: List[List[int]]
    logprobs: List[List[TokenLogprobs]]
    prompt_logprobs: List[Optional[List[TokenLogprobs]]]
    finals: List[TokenOut]
    stops: List[Optional["_StopWatch"]]
    request_ids: Dict[int, str]
    clocks: List["_Clock"]
    hidden: List[List[WireTensor]]  # params.return_hidden_states' rows, a part a token


@dataclasses.dataclass
class _Clock:
    """One request's times as `_collect` sees them (RequestStateStats' sources): submitted
    (wall and monotonic), its first and last token's arrival, its scheduler queue time."""

    wall: float = dataclasses.field(default_factory=time.time)
    queued: float = dataclasses.field(default_factory=time.monotonic)
    first: Optional[float] = None
    last: Optional[float] = None
    queued_s: float = 0.0

    def saw(self, out: TokenOut) -> None:
        now = time.monotonic()
        if out.times is not None:
            self.queued_s = out.times.queued_s
        if out.token >= 0:
            self.first = now if self.first is None else self.first
            self.last = now

    def stats(self, tokens: int) -> RequestStateStats:
        first = self.first if self.first is not None else self.queued
        return RequestStateStats(self.wall, self.queued, self.queued + self.queued_s, first,
                                 self.last if self.last is not None else first, tokens)


def _chat_message(i: int, message: Any) -> Dict[str, Any]:
    """Message i for the chat template: a role, content as text (a list of text parts joined
    with newlines, as the server and vLLM join them) and an assistant's `tool_calls` checked as
    the server checks them (`arguments` JSON text, or an object as vLLM also takes them);
    ValueError naming what is wrong."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {i} must be a dict with a role, got {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):
        texts = [part.get("text") if isinstance(part, dict) and part.get("type") == "text"
                 else None for part in content]
        if any(not isinstance(t, str) for t in texts):
            raise ValueError(f"message {i}: only text content parts are supported, got "
                             f"{content!r:.80}")
        message = {**message, "content": "\n".join(texts)}  # type: ignore[arg-type]
    calls = message.get("tool_calls")
    if calls is not None and message["role"] != "assistant":
        raise ValueError(f"message {i}: only assistant messages make tool calls, got role "
                         f"{message['role']!r}")
    if calls is not None:
        as_text = [_arguments_as_text(c) for c in calls] if isinstance(calls, list) else calls
        message = {**message, "tool_calls": assistant_tool_calls(f"messages[{i}].tool_calls",
                                                                 as_text)}
    return message


def _arguments_as_text(call: Any) -> Any:
    """A tool call with `arguments` given as an object (vLLM's offline chat takes them so) as
    the JSON text the server's check expects; anything else as it is, for the check to name."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
        return {**call, "function": {**fn, "arguments": json.dumps(fn["arguments"])}}
    return call


def _read_structured_outputs(p: SamplingParams) -> SamplingParams:
    """`p` with vLLM's `structured_outputs` read into `structured`, as the server reads the
    request field of that name; ValueError naming what is wrong."""
    so = p.structured_outputs
    if so is None:
        return p
    fields = dataclasses.asdict(so) if isinstance(so, StructuredOutputsParams) else dict(so)
    given = {k: v for k, v in fields.items() if v is not None}
    if given.get("whitespace_pattern") is not None:
        raise ValueError("structured_outputs: whitespace_pattern is not supported (xgrammar's "
                         "JSON is compact)")
    try:
        found = constraint({"structured_outputs": given})
    except FieldError as e:
        raise ValueError(str(e)) from None
    if found is None:
        raise ValueError("structured_outputs: asks for no constraint (set json, regex, choice, "
                         "grammar, json_object or structural_tag)")
    return dataclasses.replace(p, structured=found.structured, structured_outputs=None)


def _finals(done: List[Optional[TokenOut]], prompt_of: List[int]) -> List[TokenOut]:
    """Every request's final out (`_collect` returns once all came); ValueError naming the
    prompt of one the scheduler rejected (checked up front, so only a scheduler-side limit
    gets there)."""
    finals = [d for d in done if d is not None]
    if len(finals) != len(done):
        raise RuntimeError(f"{len(done) - len(finals)} requests never finished")
    errors = [(k, d.error) for k, d in enumerate(finals) if d.error]
    if errors:
        raise ValueError(f"prompt {prompt_of[errors[0][0]]} rejected: {errors[0][1]}")
    return finals


class _Checked(NamedTuple):
    ids: List[int]
    params: SamplingParams


class _StopWatch:
    """One request's stop strings and stop_regex patterns, matched on its text as it grows
    (as the detokenizer does for the server): once one matches, `text` is the output before
    it (through it, `keep`: vLLM's include_stop_str_in_output) and `stopped` is set."""

    def __init__(self, tokenizer: Any, p: SamplingParams) -> None:
        self.decoder = IncrementalDecoder(tokenizer, (), p.skip_special_tokens)
        self.matcher = StopMatcher(p.stop, p.include_stop_str_in_output, p.stop_regex)
        self.min_tokens = p.min_tokens  # stops count only after more tokens than this
        self.tokens = 0
        self.text = ""
        self.stopped = False

    def push(self, out: TokenOut, final: bool) -> bool:
        """Take a token out; True when a stop has just ended the request."""
        text = ""
        if out.token >= 0:
            self.tokens += 1
        if out.token >= 0 and out.finish_reason != FinishReason.STOP.value:
            text = self.decoder.push(out.token)  # a stop token is not rendered
        if final:
            text += self.decoder.flush()
        try:
            result = self.matcher.feed(text, self.tokens > self.min_tokens)
        except TimeoutError:
            raise ValueError(self.matcher.too_slow()) from None
        self.text += result.text
        self.stopped = result.stopped
        if final and not self.stopped:
            self.text += self.matcher.flush()
        return self.stopped


class LLM:
    """Offline generation. `model=None` uses the bundled default model (SmolLM2-135M-Instruct).
    The keywords are the scheduler and engine settings (`settings.names(SchedulerConfig())`:
    tp, device, dtype, page_size, max_prefill_tokens, overlap, fused_ops, pdl, ...; the same as
    the server's flags), with the same defaults but `max_prefill_tokens=None`:
    `utils.offline_prefill_tokens` (16,384 on large GPUs), resolved in the scheduler ranks, so
    this process leaves CUDA alone. An unknown keyword or a bad value is a ValueError naming it.
    `show_progress`: progress bars while loading and generating; `log_level`: the rank
    processes' (tp > 1). `generation_config`: where the params of a call given none come from
    (`get_default_sampling_params`): "auto" (the model's generation_config.json recommends
    temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as a cap on an
    unset max_tokens, as in vLLM), "none" (SamplingParams' own defaults), or a directory
    holding a generation_config.json; `override_generation_config` (vLLM's; a dict or its
    JSON): those defaults set over it. `tokenizer`: a directory or hub id whose tokenizer (and
    chat template) replaces the model's, as the server's `--tokenizer`; `tokenizer_mode`: vLLM's,
    "auto" or "hf" (others are refused: text.check_tokenizer_mode). `hf_token`: what hub
    downloads of the model and tokenizer are authorized with (vLLM's; None: huggingface_hub's
    own, HF_TOKEN or the saved login)."""

    def __init__(self, model: Optional[str] = None, *, show_progress: bool = True,
                 log_level: str = "WARNING", generation_config: str = "auto",
                 override_generation_config: Union[None, str, Dict[str, Any]] = None,
                 tokenizer: Optional[str] = None, tokenizer_mode: str = "auto",
                 hf_token: Optional[str] = None, **overrides: Any) -> None:
        check_tokenizer_mode(tokenizer_mode)
        if isinstance(overrides.get("lora_modules"), dict):  # {name: path}, as the flag's text
            overrides["lora_modules"] = ",".join(f"{name}={path}" for name, path
                                                 in overrides["lora_modules"].items())
        cfg = build(SchedulerConfig(), {**environment_settings(os.environ), **overrides},
                    "LLM()")
        # The LoRA adapters loaded (name -> directory), least recently used first
        self._adapters: "OrderedDict[str, str]" = OrderedDict(cfg.engine.lora_adapters)
        self._lora_slots = cfg.engine.lora_slots
        self._cpu_backup = cfg.engine.enable_weights_cpu_backup
        self._lora_runtime, self._max_lora_rank = cfg.engine.lora_runtime, cfg.engine.max_lora_rank
        tp = self._tp = cfg.engine.tp
        # the ranks' start method, checked first; a fork server's imports overlap the loading
        # of the tokenizer below
        forkserver = tp > 1 and prestart(os.environ)
        self.model_path = resolve_model_path(model, cfg.engine.revision,
                                             cfg.engine.download_dir, hf_token)
        tokenizer_path = resolve_tokenizer_path(tokenizer, self.model_path,
                                                cfg.engine.download_dir, hf_token,
                                                cfg.engine.tokenizer_revision)
        self.tokenizer = load_tokenizer(tokenizer_path)
        if isinstance(override_generation_config, dict):
            override_generation_config = json.dumps(override_generation_config)
        self.sampling_defaults = sampling_defaults(generation_config, self.model_path,
                                                   override_generation_config)
        self.model_config = ModelConfig.from_dir(self.model_path, cfg.engine.hf_override_dict)
        self._pooling = model_pooling(self.model_path, cfg.engine.pooler_config)  # files: once
        check_pooler_dimensions(cfg.engine.pooler_config,
                                self.model_config.matryoshka_dimensions,
                                self.model_config.hidden_size)
        self.model_config.check_tp(tp, cfg.engine.enable_expert_parallel)
        engine = dataclasses.replace(cfg.engine.for_rank(str(self.model_path), 0),
                                     show_progress=show_progress)
        cfg = dataclasses.replace(cfg, engine=engine, tokenizer_path=str(tokenizer_path))
        self.show_progress = show_progress
        self._backend = (InProcessRank(cfg) if tp == 1
                         else RankProcesses(cfg, tp, log_level, forkserver))
        self._uids = itertools.count()
        self._token_texts: Dict[int, str] = {}  # token id -> decoded alone (Logprob's)
        self._asleep: FrozenSet[str] = frozenset()  # sleep mode's parts asleep
        self._grammar_error: Optional[Callable[[StructuredOutput], Optional[str]]] = None
        self._finalizer = weakref.finalize(self, self._backend.close)

    @property
    def max_context(self) -> int:
        return self._backend.limits.max_context

    def get_default_sampling_params(self) -> SamplingParams:
        """The params of a `generate` / `chat` call given none (vLLM's method): SamplingParams'
        defaults with the model's recommended sampling (`generation_config`)."""
        return self.sampling_defaults.params()

    @property
    def limits(self) -> Limits:
        """What the engine holds (context, vocabulary, KV pages) and the prefill chunk the
        scheduler resolved, as the ranks reported them at start."""
        return self._backend.limits

    @property
    def rank_processes(self) -> Tuple[Any, ...]:
        """The rank processes (multiprocessing.Process, in rank order) with tp>1; empty with tp=1,
        where the scheduler runs in this process."""
        if isinstance(self._backend, RankProcesses):
            return tuple(self._backend.procs)
        return ()

    def check_accounting(self) -> Accounting:
        """The scheduler's resources between calls of `generate` / `chat` (KV pages by place,
        reserved pages, page-table rows, live requests, evictions and retractions so far).
        Raises RuntimeError naming the numbers when the pages do not balance (free + in use +
        cached != total). With tp>1 every rank checks its own at the same step (rank 0's
        numbers come back; ranks agree, as they schedule alike), and a rank whose pages do not
        balance ends: RuntimeError naming it, the other ranks stopped."""
        self._backend._check_open()
        if isinstance(self._backend, RankProcesses):
            return self._backend.accounting()
        return self._backend.scheduler.accounting()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM's method: cold-cache benchmarks, or after the prompts
        of one tenant), on every rank, between calls of `generate` / `chat`; True when done."""
        self._backend._check_open()
        if isinstance(self._backend, RankProcesses):
            self._backend.accounting(reset_prefix_cache=True)
        else:
            self._backend.scheduler.cache.drop_unused()
        return True

    @property
    def torch_threads(self) -> Tuple[int, ...]:
        """The torch thread count of each rank (`cpu_threads` setting): this process's own with
        tp=1."""
        if isinstance(self._backend, RankProcesses):
            return tuple(self._backend.torch_threads)
        return (torch.get_num_threads(),)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def get_tokenizer(self) -> Any:
        """The tokenizer prompts are encoded with (vLLM's method, which scripts use to apply
        the chat template themselves); ValueError for a model without one."""
        return self._need_tokenizer()

    @property
    def stats(self) -> Optional[SchedulerStats]:
        """The scheduler's latest counters (rank 0's): tokens, KV pages, steps and busy time by
        phase; None before the first step."""
        return self._backend.stats

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- public API ------------------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 *, use_tqdm: Optional[bool] = None,
                 priority: Optional[Sequence[int]] = None,
                 lora_request: LoraRequests = None) -> List[GenerateOutput]:
        """One output per prompt, in order, its `n` choices in `outputs` (vLLM's layout).
        `sampling_params`: one for all, or one per prompt (None: the default,
        `get_default_sampling_params`). `use_tqdm`: a progress bar over the requests (None:
        `show_progress`'s choice). `priority`: one per prompt, under `scheduling_policy=
        "priority"` (SamplingParams.priority). `lora_request`: the LoRA adapter of every
        prompt, or one per prompt (None: the base model; SamplingParams.lora_name). vLLM's
        names, so that its callers' keywords work."""
        batch = _prompt_list(prompts)
        ids = [self._encode(p) for p in batch]
        texts = [p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None
                 for p in batch]
        params = self._per_prompt(sampling_params, len(ids))
        if priority is not None:
            if isinstance(priority, (str, bytes)) or len(priority) != len(ids):
                raise ValueError(f"priority must give one value per prompt ({len(ids)}), got "
                                 f"{priority!r:.80}")
            params = [dataclasses.replace(p, priority=v) for p, v in zip(params, priority)]
        return self._run(ids, self._with_lora(params, lora_request), use_tqdm, texts)

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]], params: BeamSearchParams,
                    *, use_tqdm: bool = False, lora_request: LoraRequests = None
                    ) -> List[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best beams, best first
        (beam_search.py: the search and how beams rank). One engine call a step for every
        live beam of every prompt; `use_tqdm`: a progress bar over the steps. ValueError
        naming bad params, or a prompt whose beams would outgrow the context."""
        params.check(self.limits.max_logprobs)
        ids = [self._encode(p) for p in _prompt_list(prompts)]
        for i, prompt in enumerate(ids):
            if len(prompt) + params.max_tokens > self.max_context:
                raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_tokens "
                                 f"{params.max_tokens} exceed the context of "
                                 f"{self.max_context} tokens")
        step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=2 * params.beam_width, detokenize=False)
        steps = self._with_lora([step] * len(ids), lora_request)  # each prompt's adapter
        searches = [BeamSearch(prompt, params, self.model_config.eos_token_ids)
                    for prompt in ids]
        for _ in tqdm(range(params.max_tokens), desc="beam search", unit="step",
                      disable=not use_tqdm):
            live = [(b.tokens, k) for k, s in enumerate(searches) for b in s.live]
            if not live:
                break
            outs = self.generate([tokens for tokens, _ in live], [steps[k] for _, k in live],
                                 use_tqdm=False)
            offered = iter([_step_candidates(o) for o in outs])
            for search in searches:  # each takes its live beams' outputs, in order
                search.step([next(offered) for _ in search.live])
        results = [BeamSearchOutput(s.best()) for s in searches]
        for beam in (b for r in results for b in r.sequences):
            beam.text = "" if self.tokenizer is None else self.tokenizer.decode(beam.tokens)
        return results

    def chat(self, messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             *, use_tqdm: Optional[bool] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: Optional[Dict[str, Any]] = None,
             tools: Optional[List[Dict[str, Any]]] = None,
             chat_template: Optional[str] = None,
             chat_template_content_format: str = "auto",
             lora_request: LoraRequests = None) -> List[GenerateOutput]:
        """Apply the model's chat template (`chat_template`: Jinja text in its place) to one
        conversation or a list of them, then `generate` (vLLM's keywords: `tools` reach the
        template only; the output is not parsed for calls). A message's content is text or a
        list of text parts, joined with newlines as the server and vLLM join them; the
        messages reach the template as the server hands them over (`chat_template.py`: the
        content as text or as one text part, per `chat_template_content_format`)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true (pass add_generation_prompt=False)")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of "
                             f"{', '.join(CONTENT_FORMATS)}, got "
                             f"{chat_template_content_format!r}")
        template = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            template["continue_final_message"] = True
        if tools is not None:
            template["tools"] = tools
        if chat_template is not None:
            template["chat_template"] = chat_template
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self._chat_ids(c, template, chat_template_content_format)  # type: ignore[arg-type]
               for c in convs]
        params = self._per_prompt(sampling_params, len(ids))
        return self._run(ids, self._with_lora(params, lora_request), use_tqdm)

    # --- internals ---------------------------------------------------------------------------
    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer: pass token ids")
        return self.tokenizer

    def _encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            elif set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt is {{'prompt': text}} or "
                                 f"{{'prompt_token_ids': ids}}, got keys {sorted(prompt)}")
        if isinstance(prompt, str):  # with BOS where the tokenizer adds one, as vLLM and HF do
            return list(self._need_tokenizer().encode(prompt, add_special_tokens=True))
        if not isinstance(prompt, (list, tuple)) or not set(map(type, prompt)) <= {int}:
            # bool (an int subclass) is refused too
            raise ValueError("a token-id prompt must be a list of integers")
        return list(prompt)

    def _chat_ids(self, conversation: List[Dict[str, Any]],
                  template: Optional[Dict[str, Any]] = None, content_format: str = "auto"
                  ) -> List[int]:
        """The conversation's prompt ids; `template`: the chat template's keywords (a new
        assistant turn by default)."""
        template = {"add_generation_prompt": True} if template is None else template
        if not conversation:
            raise ValueError("a chat needs at least one message")
        messages = [_chat_message(i, m) for i, m in enumerate(conversation)]
        return chat_prompt_ids(self._need_tokenizer(), messages, False, content_format,
                               **template)

    def _with_lora(self, params: List[SamplingParams], requests: LoraRequests
                   ) -> List[SamplingParams]:
        """The params with each prompt's adapter (`generate`'s lora_request), loading those
        not loaded that give a lora_path (as vLLM does; `add_lora`); ValueError for one that
        gives none, or names an adapter loaded from another directory."""
        if requests is None:
            return params
        per_prompt = [requests] * len(params) if isinstance(requests, LoRARequest) else requests
        if len(per_prompt) != len(params):
            raise ValueError(f"lora_request must be one LoRARequest or give one value per "
                             f"prompt ({len(params)}), got {len(per_prompt)}")
        wanted = {r.lora_name for r in per_prompt if r is not None}
        for req in dict.fromkeys(r for r in per_prompt if r is not None):
            self._ensure_loaded(req, wanted)
        return [p if req is None else dataclasses.replace(p, lora_name=req.lora_name)
                for p, req in zip(params, per_prompt)]

    def _ensure_loaded(self, req: LoRARequest, keep: Set[str]) -> None:
        """Adapter `req` loaded (most recently used now): loaded already from its lora_path
        (if it gives one), or loaded now, unloading the least recently used adapter outside
        `keep` (the call's) where every slot is taken."""
        name, path = req.lora_name, req.lora_path
        if name in self._adapters:
            if path and not _same_dir(path, self._adapters[name]):
                raise ValueError(f"LoRA adapter {name!r} was loaded from "
                                 f"{self._adapters[name]}, not {path}")
            self._adapters.move_to_end(name)
            return
        if not path:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: "
                             f"{', '.join(self._adapters) or 'none'}) and the LoRARequest "
                             f"gives no lora_path to load it from")
        self._check_loadable(name, path)  # before anything is unloaded for it
        if len(self._adapters) >= self._lora_slots > 0:
            idle = next((n for n in self._adapters if n not in keep), None)
            if idle is None:
                raise ValueError(f"this call's {len(keep)} LoRA adapters do not fit the "
                                 f"{self._lora_slots} slots (LLM(..., max_loras=N))")
            self.remove_lora(idle)
        self.add_lora(req)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load adapter `lora_request.lora_name` from its `lora_path` on every rank (vLLM's
        `add_lora`); False where that name is loaded already. ValueError why it cannot load
        (no LoRA slots: `LLM(..., enable_lora=True)`; every slot taken: `remove_lora`; the
        adapter's files)."""
        name, path = lora_request.lora_name, lora_request.lora_path
        if name in self._adapters:
            return False
        if not path:
            raise ValueError(f"LoRA adapter {name!r}: add_lora needs its lora_path")
        self._check_loadable(name, path)
        self._change(AdapterMsg(next(self._uids), name, str(path)))
        self._adapters[name] = str(path)
        return True

    def _check_loadable(self, name: str, path: str) -> None:
        """ValueError where adapter `name` at `path` cannot load, as far as this process can
        tell (LoRA at run time off; its config: models/lora_config.py); the ranks check the
        rest (its tensors)."""
        check_runtime_load(name, path, self._lora_runtime, self._max_lora_rank)

    def remove_lora(self, name: str) -> bool:
        """Unload adapter `name` on every rank; False where it was not loaded."""
        if name not in self._adapters:
            return False
        self._change(AdapterMsg(next(self._uids), name))
        del self._adapters[name]
        return True

    def list_loras(self) -> List[str]:
        """The names of the adapters loaded, least recently used first."""
        return list(self._adapters)

    def update_weights_from_disk(self, model_path: str,
                                 load_format: Optional[str] = None) -> None:
        """Reload every rank's weights from checkpoint directory `model_path` (SGLang's
        `Engine.update_weights_from_disk`: a checkpoint of the served model's architecture and
        shapes, e.g. a training step's); the prefix cache is dropped. ValueError why not (a
        checkpoint of another shape, files that do not load), with the weights served
        unchanged on every rank; `load_format`: "auto" (the default) only."""
        check_load_format(load_format, DISK_FORMATS)
        self._change(WeightsMsg(next(self._uids), str(model_path)))

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> None:
        """Join a trainer's process group for weight updates (SGLang's
        `Engine.init_weights_update_group`; distributed/weight_group.py): the trainer is its
        rank 0 and hosts its TCP store at (master_address, master_port); rank r of this
        engine joins as rank_offset + r. Blocks until every member has joined. ValueError
        naming a group that cannot hold the ranks, or why a rank could not join."""
        spec = GroupSpec(master_address, master_port, rank_offset, world_size, group_name,
                         backend)
        spec.check(self._tp)
        self._change(GroupMsg(next(self._uids), group_name, master_address, master_port,
                              rank_offset, world_size, backend))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]],
                                        group_name: str = "weight_update_group") -> None:
        """Receive the tensors the trainer broadcasts from rank 0 of group `group_name`, in
        this order (checkpoint names, dtype names such as "bfloat16", whole shapes), into the
        served weights; the others stay (a trainer may send the weights in buckets). The
        prefix cache is dropped. ValueError why not (a tensor that is not a weight of the
        model: every rank then serves the checkpoint it loaded last from disk)."""
        dtype_names = check_update(names, dtypes, shapes)
        self._change(GroupWeightsMsg(next(self._uids), group_name, tuple(names), dtype_names,
                                     tuple(tuple(s) for s in shapes)))

    def update_weights_from_tensor(self, named_tensors: Any,
                                   load_format: Optional[str] = None,
                                   flush_cache: bool = True) -> None:
        """SGLang's: load (checkpoint name, whole tensor) pairs into the served weights, on
        every rank its shard (by reference across processes: a CUDA tensor's IPC handle, a
        CPU one's shared memory; keep them alive until this returns); the others stay. With
        `load_format="flattened_bucket"`, `named_tensors` is SGLang's flattened bucket
        ({"flattened_tensor", "metadata"}: tensor_payload.py). The prefix cache is dropped
        (`flush_cache`: either way). ValueError why not (a tensor that is not a weight of the
        model: every rank then serves the checkpoint it loaded last from disk)."""
        check_load_format(load_format, TENSOR_FORMATS)
        payload: Any = ([(str(n), t) for n, t in named_tensors] if load_format != "flattened_bucket"
                        else dict(named_tensors))
        # one payload a rank: each carries one reference to the memory it names
        self._change(TensorWeightsMsg(next(self._uids), tuple(serialize(payload)
                                                              for _ in range(self._tp))))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the trainer's group `group_name`; ValueError where none of that name was
        joined."""
        self._change(GroupMsg(next(self._uids), group_name, leave=True))

    def sleep(self, level: int = 1) -> None:
        """Hand back the device memory (vLLM's `LLM.sleep`; needs `enable_sleep_mode=True`):
        level 1 keeps the weights in host memory, level 2 forgets them (reload them with
        `update_weights_from_disk` after `wake_up(tags=["weights"])`); the KV cache and the
        prefix cache are forgotten at either. ValueError naming a bad level, or sleep mode
        off."""
        self._change(SleepMsg(next(self._uids), check_level(level)))
        self._asleep = frozenset(SLEEP_PARTS)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take the memory of the parts `tags` names ("weights", "kv_cache"; None: both)
        again (vLLM's `LLM.wake_up`); generating raises until nothing is asleep. ValueError
        naming an unknown tag, or why the engine could not (its device out of memory), with
        the parts asleep as they were."""
        named = check_tags(tags)
        self._change(WakeMsg(next(self._uids), named))
        self._asleep -= frozenset(named)

    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """SGLang's `Engine.release_memory_occupation`: the parts `tags` names ("weights",
        "kv_cache"; its "cuda_graph" beside them; None: all) asleep, the weights at level 1
        with `enable_weights_cpu_backup=True`, else forgotten (level 2)."""
        parts = sglang_parts(tags)
        self._change(SleepMsg(next(self._uids), 1 if self._cpu_backup else 2, parts))
        self._asleep |= frozenset(parts)

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """SGLang's `Engine.resume_memory_occupation`: `wake_up` of the parts named."""
        self.wake_up(sglang_parts(tags))

    def is_sleeping(self) -> bool:
        """Whether any part (weights, KV cache) is asleep."""
        return bool(self._asleep)

    def start_profile(self, profile_prefix: Optional[str] = None) -> None:
        """vLLM's: every rank starts torch.profiler (scheduler/profiler.py) until
        `stop_profile`, which writes each rank's trace to profile_dir (the setting, else
        VLLM_TORCH_PROFILER_DIR / SGLANG_TORCH_PROFILER_DIR) as
        `{profile_prefix}-{time}-rank{r}.trace.json.gz`. ValueError where profiling is off or
        already running."""
        name = f"{profile_prefix or 'minisgl'}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._change(ProfileMsg(next(self._uids), True, name))

    def stop_profile(self) -> None:
        """vLLM's: stop the profiler and write every rank's trace; ValueError where it is not
        running."""
        self._change(ProfileMsg(next(self._uids), False))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """SGLang's `Engine.get_weights_by_name`: the first `truncate_size` rows of checkpoint
        tensor `name` (Hugging Face's names: "model.layers.0.self_attn.q_proj.weight") as
        every rank serves it, put together, as nested lists of floats (what an RL loop
        compares with its trainer's tensor after an update; layers/readback.py). ValueError
        naming a tensor the model does not hold or keeps quantized."""
        out = self._change(WeightReadMsg(next(self._uids), name, truncate_size))
        if out.tensor is None:
            raise RuntimeError(f"rank 0 answered the read of {name} without values")
        return out.tensor.tolist()

    def _change(self, msg: Union[AdapterMsg, WeightsMsg, SleepMsg, WakeMsg, GroupMsg,
                                 GroupWeightsMsg, TensorWeightsMsg, ProfileMsg, WeightReadMsg]
                ) -> TokenOut:
        """Send `msg` to the ranks and wait for rank 0's answer (between calls: no request
        is in flight); ValueError with its error."""
        self._backend.submit(msg)
        while True:
            for out in self._backend.poll():
                if out.uid == msg.uid:
                    self._backend.drain()
                    if out.error is not None:
                        raise ValueError(out.error)
                    return out

    def _per_prompt(self, params: Union[None, SamplingParams, Sequence[SamplingParams]], n: int
                    ) -> List[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)

    def _check(self, i: int, ids: List[int], p: SamplingParams) -> "_Checked":
        """Prompt i's ids (truncated where its params ask) and the params to submit it with
        (max_tokens resolved); ValueError naming the prompt and the values when it cannot be
        served."""
        try:
            p.validate()
            if (p.stop or p.stop_regex) and self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: stop strings and "
                                 f"stop_regex need one")
            p = _read_structured_outputs(p)
            if p.structured is not None:
                self._check_structured(p.structured)
            ids = truncate_prompt(ids, p, self._backend.limits)
            p = with_bad_word_ids(self.tokenizer, p)
            return _Checked(ids, check_request(ids, p, self._backend.limits))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None

    def _check_structured(self, structured: StructuredOutput) -> None:
        """ValueError why the constraint does not compile (before any rank sees it)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer: structured output needs one")
        if self._grammar_error is None:
            self._grammar_error = make_checker(self.tokenizer, self._backend.limits.vocab_size)
        error = self._grammar_error(structured)
        if error is not None:
            raise ValueError(f"structured: {error}")

    def _run(self, prompts: List[List[int]], params: List[SamplingParams],
             use_tqdm: Optional[bool] = None,
             texts: Optional[Sequence[Optional[str]]] = None) -> List[GenerateOutput]:
        """One output per prompt, in order, holding its `n` choices (each its own request to
        the scheduler, choice j seeded `seed + j`). The progress bar shows where `use_tqdm` says,
        or, when None, where `show_progress` does and there are 8 requests or more. `texts`:
        each prompt's text where it was given as text (the outputs' `prompt`)."""
        texts = [None] * len(prompts) if texts is None else list(texts)
        collected = self._collected(prompts, params, use_tqdm)
        origin, prompts, params = collected.origin, collected.prompts, collected.params
        tokens, logprobs, finals = collected.tokens, collected.logprobs, collected.finals
        choices: List[List[CompletionOutput]] = [[] for _ in texts]
        for t, lp, d, p, w, h, (i, j) in zip(tokens, logprobs, finals, params, collected.stops,
                                             collected.hidden, origin):
            choices[i].append(self._completion(j, t, lp, d, p, w, h))
        outputs = []
        for k, (i, j) in enumerate(origin):
            if j > 0:
                continue
            first, plp = finals[k], collected.prompt_logprobs[k]
            outputs.append(GenerateOutput(
                choices[i], first.prompt_tokens, first.cached_tokens, prompts[k],
                collected.request_ids[i], texts[i], plp,
                self._decoded_tokens(prompts[k][1:], plp) if params[k].detokenize else {},
                collected.clocks[k].stats(len(tokens[k]))))
        return outputs

    def embed(self, prompts: Union[Prompt, Sequence[Prompt]], *,
              use_tqdm: Optional[bool] = None, lora_request: LoraRequests = None,
              pooling_params: Optional[PoolingParams] = None) -> List[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (the final norm's hidden states pooled
        as the model pools them: its last token's by default, as vLLM pools a decoder model;
        the mean or the first token's where its sentence-transformers files or pooler_config
        say; L2-normalized), in order. A
        prompt is text (special tokens added, as the tokenizer adds them) or token ids;
        `lora_request` as for `generate`; `pooling_params.dimensions` cuts a Matryoshka
        model's embeddings (normalized again). ValueError for what cannot be served (a
        classifier's embeddings among it)."""
        refusal = self._pooling.refusal
        if self.model_config.classifier is not None:
            refusal = (f"this model is a sequence classifier "
                       f"({self.model_config.architecture}): use classify or score")
        if pooling_params is not None and pooling_params.use_activation is not None:
            refusal = "use_activation applies to classify and to a cross-encoder's score"
        dims = self._pooling.cut_to(None if pooling_params is None
                                    else pooling_params.dimensions)
        normalize = (self._pooling.normalize if pooling_params is None
                     or pooling_params.normalize is None else pooling_params.normalize)
        if refusal is None and dims is not None:
            refusal = dimensions_error(dims, self.model_config.matryoshka_dimensions,
                                       self.model_config.hidden_size)
        if refusal is not None:
            raise ValueError(refusal)
        ids = [self._encode(p) for p in _prompt_list(prompts)]
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(shortened(values, dims, normalize)),
                                       prompt)
                for rid, values, prompt in self._pooled(ids, use_tqdm, lora_request,
                                                        self._pooling.mode, normalize)]

    def classify(self, prompts: Union[Prompt, Sequence[Prompt]], *,
                 use_tqdm: Optional[bool] = None, lora_request: LoraRequests = None,
                 pooling_params: Optional[PoolingParams] = None
                 ) -> List[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's label probabilities from a sequence
        classification model (models/classifier.py), in order (its logits where
        `pooling_params.use_activation` or pooler_config's says false); prompts as for
        `embed`. ValueError for a model without a classification head, or embedding options
        in `pooling_params`."""
        self._classifier("classify")
        activation = self._logit_activation(pooling_params, "classify")
        ids = [self._encode(p) for p in _prompt_list(prompts)]
        return [ClassificationRequestOutput(
            rid, ClassificationOutput(activation.probabilities(values.tolist())), prompt)
                for rid, values, prompt in self._pooled(ids, use_tqdm, lora_request)]

    def _logit_activation(self, pooling_params: Optional[PoolingParams], what: str
                          ) -> LogitActivation:
        """pooler_config's LogitActivation with `pooling_params.use_activation`; ValueError
        where `pooling_params` sets what only embeddings take."""
        if pooling_params is None:
            return self._pooling.logits
        if pooling_params.dimensions is not None or pooling_params.normalize is not None:
            raise ValueError(f"{what}: dimensions and normalize apply to embeddings; "
                             f"pooling_params takes use_activation here")
        return self._pooling.logits.for_request(pooling_params.use_activation)

    def reward(self, prompts: Union[Prompt, Sequence[Prompt]], *,
               use_tqdm: Optional[bool] = None, lora_request: LoraRequests = None
               ) -> List[PoolingRequestOutput]:
        """vLLM's `LLM.reward`: each prompt's raw logits from a sequence classification model
        (a reward model's reward: no activation), in order; prompts as for `embed`.
        ValueError for a model without a classification head."""
        self._classifier("reward")
        ids = [self._encode(p) for p in _prompt_list(prompts)]
        return [PoolingRequestOutput(rid, PoolingOutput(values.tolist()), prompt)
                for rid, values, prompt in self._pooled(ids, use_tqdm, lora_request)]

    def _classifier(self, what: str) -> Classifier:
        """The model's classification head; ValueError naming `what` needs one."""
        if self.model_config.classifier is None:
            raise ValueError(f"{what} needs a sequence classification model; "
                             f"{self.model_config.architecture} has no classification head")
        return self.model_config.classifier

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]], *,
              use_tqdm: Optional[bool] = None, lora_request: LoraRequests = None,
              pooling_params: Optional[PoolingParams] = None
              ) -> List[ScoringRequestOutput]:
        """vLLM's `LLM.score`, pairs as vLLM forms them (one text_1 with each text_2, or two
        lists of one length in order): a cross-encoder's (a one-label classifier: the
        sigmoid of its logit on the pair, tokenized as the tokenizer pairs two texts), or an
        embedding model's (the cosine similarity of the two embeddings). ValueError where
        they do not pair, or for a classifier of several labels; `pooling_params` as for
        `classify` (a cross-encoder's logit where use_activation is false), none for an
        embedding model."""
        firsts, seconds = paired_texts(text_1, text_2)
        classifier = self.model_config.classifier
        if classifier is not None:
            refusal = pair_score_error(classifier)
            if refusal is not None:
                raise ValueError(refusal)
            activation = self._logit_activation(pooling_params, "score")
            tokenizer = self._need_tokenizer()
            ids = [list(tokenizer.encode(a, b, add_special_tokens=True))
                   for a, b in zip(firsts, seconds)]
            return [ScoringRequestOutput(rid, ScoringOutput(activation.score(float(values[0]))))
                    for rid, values, _ in self._pooled(ids, use_tqdm, lora_request)]
        if pooling_params is not None:
            raise ValueError("score by embeddings (cosine similarity) takes no pooling_params")
        texts = list(dict.fromkeys([*firsts, *seconds]))
        vectors = {t: o.outputs.embedding for t, o in
                   zip(texts, self.embed(texts, use_tqdm=use_tqdm, lora_request=lora_request))}
        return [ScoringRequestOutput(str(i), ScoringOutput(
            sum(x * y for x, y in zip(vectors[a], vectors[b])))) for i, (a, b)
            in enumerate(zip(firsts, seconds))]

    def _pooled(self, ids: List[List[int]], use_tqdm: Optional[bool],
                lora_request: LoraRequests, pooling: str = "last", normalize: bool = True
                ) -> List[Tuple[str, array, List[int]]]:
        """(request id, pooled values, prompt) of each prompt run as an embedding request
        pooled as `pooling` says (CausalLM.pooled: an embedding, normalized or not, or a
        classifier's logits of the last token), in order."""
        params = self._with_lora([SamplingParams(max_tokens=1, temperature=0.0, embed=True,
                                                 pooling=pooling, normalize=normalize)]
                                 * len(ids), lora_request)
        collected = self._collected(ids, params, use_tqdm)
        out = []
        for k, final in enumerate(collected.finals):
            if final.embedding is None:
                raise RuntimeError(f"request {k} ended without its embedding")
            values = array("f")
            values.frombytes(final.embedding)
            out.append((collected.request_ids[k], values, collected.prompts[k]))
        return out

    def _collected(self, prompts: List[List[int]], params: List[SamplingParams],
                   use_tqdm: Optional[bool]) -> "_Collected":
        """Submit each prompt's `n` requests (choice j seeded `seed + j`) and wait for all;
        see `_run`."""
        if self._asleep:  # the ranks would hold the requests until a wake-up
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self._asleep))}): "
                               f"call wake_up() before generating")
        checked = [self._check(i, ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
        prompts, params = [c.ids for c in checked], [c.params for c in checked]
        # (prompt, choice) of each request, in submission order
        origin = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        prompts = [prompts[i] for i, _ in origin]
        params = [params[i].choice(j) for i, j in origin]
        uids = [next(self._uids) for _ in prompts]
        request_ids = {i: str(uid) for (i, j), uid in zip(origin, uids) if j == 0}
        slot = {uid: i for i, uid in enumerate(uids)}
        tokens: List[List[int]] = [[] for _ in prompts]
        logprobs: List[List[TokenLogprobs]] = [[] for _ in prompts]
        prompt_logprobs: List[Optional[List[TokenLogprobs]]] = [None] * len(prompts)
        done: List[Optional[TokenOut]] = [None] * len(prompts)
        clocks = [_Clock() for _ in prompts]
        hidden: List[List[WireTensor]] = [[] for _ in prompts]
        stops = [_StopWatch(self.tokenizer, p) if p.stop or p.stop_regex else None
                 for p in params]
        show = self.show_progress and len(prompts) >= 8 if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not show)
        submitted = 0
        try:
            for uid, ids, p, clock in zip(uids, prompts, params, clocks):
                clock.wall, clock.queued = time.time(), time.monotonic()
                self._backend.submit(UserMsg(uid, ids, p.for_engine()))
                submitted += 1
            self._collect(slot, tokens, logprobs, prompt_logprobs, done, stops, bar, clocks,
                          hidden)
        except BaseException:  # KeyboardInterrupt too: leave no request behind
            self._cancel([uid for uid in uids[:submitted] if done[slot[uid]] is None])
            raise
        finally:
            bar.close()
        self._backend.drain()
        return _Collected(origin, prompts, params, tokens, logprobs, prompt_logprobs,
                          _finals(done, [i for i, _ in origin]), stops, request_ids, clocks,
                          hidden)

    def _completion(self, index: int, tokens: List[int], logprobs: List[TokenLogprobs],
                    final: TokenOut, p: SamplingParams, watch: Optional["_StopWatch"],
                    hidden: Sequence[WireTensor] = ()) -> CompletionOutput:
        """One finished choice: its text as the server renders it (a stop token, EOS or one
        of stop_token_ids, left out; cut at a matched stop string) and what ended it."""
        stopped = watch is not None and watch.stopped
        stop_token = final.finish_reason == FinishReason.STOP.value and bool(tokens)
        reason: Union[None, int, str] = None
        if watch is not None and stopped:
            reason = watch.matcher.matched
            text = watch.text
        else:
            if stop_token and tokens[-1] in p.stop_token_ids:
                reason = tokens[-1]
            shown = tokens[:-1] if stop_token else tokens
            text = (self.tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens)
                    if p.detokenize and self.tokenizer is not None else "")
        own = logprobs if p.logprobs is not None else None
        rows = WireTensor.joined(hidden)
        states = None if rows is None else from_wire(rows)
        return CompletionOutput(
            index, text, tokens, FinishReason.STOP.value if stopped else final.finish_reason or "",
            reason, own, self._decoded_tokens(tokens, own) if p.detokenize else {}, states)

    def _decoded_tokens(self, tokens: List[int], logprobs: Optional[List[TokenLogprobs]]
                        ) -> Dict[int, str]:
        """Every token id in the log-probabilities of `tokens` decoded on its own, special
        tokens included (as the server renders them), from a cache kept for the LLM's life."""
        if self.tokenizer is None or logprobs is None:
            return {}
        ids: List[int] = []
        for t, lp in zip(tokens, logprobs):
            ids.append(t)
            ids.extend(lp.top_ids)
        for t in ids:
            if t not in self._token_texts:
                self._token_texts[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return {t: self._token_texts[t] for t in ids}

    def _collect(self, slot: Dict[int, int], tokens: List[List[int]],
                 logprobs: List[List[TokenLogprobs]],
                 prompt_logprobs: List[Optional[List[TokenLogprobs]]],
                 done: List[Optional[TokenOut]], stops: List[Optional["_StopWatch"]],
                 bar: Any, clocks: List[_Clock], hidden: List[List[WireTensor]]) -> None:
        """Poll until every request in `slot` (uid -> index) has its final out, filling the
        lists (and clocks) at each index; a request whose stop string matched is aborted."""
        left = sum(d is None for d in done)
        while left:
            for out in self._backend.poll():
                i = slot[out.uid]
                clocks[i].saw(out)
                final = out.finish_reason is not None or bool(out.error)
                watch = stops[i]
                if watch is None or not watch.stopped:
                    if out.token >= 0:
                        tokens[i].append(out.token)
                    if out.logprobs is not None:
                        logprobs[i].append(out.logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[i] = out.prompt_logprobs
                    if out.tensor is not None:
                        hidden[i].append(out.tensor)
                    if watch is not None and watch.push(out, final) and not final:
                        self._backend.submit(AbortMsg(out.uid))  # its final out ends it
                if final:
                    done[i] = out
                    left -= 1
                    bar.update(1)

    def _cancel(self, uids: List[int]) -> None:
        """Abort `uids` (submitted, not finished) and wait for each one's final out, so that
        their KV pages are free and none of their outs reaches a later call."""
        if not uids or self._backend.closed:
            return
        for uid in uids:
            self._backend.submit(AbortMsg(uid))
        left = set(uids)
        while left:
            for out in self._backend.poll():
                if out.finish_reason is not None or out.error:
                    left.discard(out.uid)
        self._backend.drain()


def _step_candidates(out: GenerateOutput) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """A beam search step's one token output: the next tokens it offers, most likely first."""
    logprobs = out.outputs[0].token_logprobs
    if not logprobs:
        raise RuntimeError(f"a beam search step came back without log-probabilities "
                           f"(finish reason {out.outputs[0].finish_reason})")
    return logprobs[0].top_ids, logprobs[0].top_logprobs


def _same_dir(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _prompt_list(prompts: Any) -> Sequence[Prompt]:
    """One prompt (text, token ids, a vLLM prompt dict) or a list of them, as a list;
    ValueError for anything else."""
    single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                  and isinstance(prompts[0], int))
    if not single and not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of them, got "
                         f"{type(prompts).__name__}")
    return cast(Sequence[Prompt], [prompts] if single else prompts)
