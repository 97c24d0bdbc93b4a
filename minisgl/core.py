"""The nouns every layer shares: sampling parameters, requests and batches.

`SamplingParams` crosses process boundaries (it is inside `message.UserMsg`); `Req` and `Batch`
live inside one scheduler rank. Every field of a `Req` that shapes a batch is a pure function of the
messages the rank received, so all ranks hold identical `Req` objects (the lockstep invariants of
docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Dict, List, Literal, NamedTuple, Optional, Sequence,
                    Tuple, Union, get_args)

if TYPE_CHECKING:  # messages import this module: the tokenizer and API processes need no torch
    import torch


# The most alternatives a request may ask log-probabilities for where the engine's config
# leaves it (SchedulerConfig.max_logprobs): vLLM's default cap, and OpenAI's top_logprobs bound.
DEFAULT_MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256  # a salt names a tenant: a key, not a document
# How an embedding pools the prompt's final hidden states (SamplingParams.pooling): its last
# token's, their mean, or the first token's (sentence-transformers' lasttoken, mean_tokens and
# cls_token; vLLM's LAST, MEAN and CLS)
POOLINGS = ("last", "mean", "cls")
MAX_BAD_WORDS = 128  # bad_words per request (each costs a comparison per decode step)
MAX_BAD_WORD_TOKENS = 16  # tokens in one bad word (the engine keeps that much history a row)
MAX_LOGIT_BIAS = 1024  # token entries in one request's logit_bias
MAX_STOP_REGEX = 16  # stop_regex patterns per request (each searched at every step)
MAX_TOKEN_IDS_LOGPROB = 256  # token_ids_logprob entries (each gathered at every position)
# return_hidden_states: values a request's hidden states may hold at most (64 MiB as float32;
# a prompt's go in one message with its first token)
MAX_HIDDEN_STATE_VALUES = 1 << 24
MAX_STOP_REGEX_CHARS = 1000  # one pattern's length

StructuredKind = Literal["json", "json_object", "regex", "grammar", "choice", "structural_tag"]
STRUCTURED_KINDS: Tuple[str, ...] = get_args(StructuredKind)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; compiled by the grammar cache, enforced by a token bitmask.
    A reasoning model's thinking goes free (grammar/reasoning.py): `reasoning` names its
    format (the API sets the server's --reasoning-parser), and the tokenizer resolves it to
    `think_start` / `think_end` (the marker token ids; -1 end: constrained from the first
    token) and `thinking` (the prompt left the output inside the thinking)."""
    kind: StructuredKind
    spec: str = ""   # json: the JSON schema as text; regex; grammar: EBNF (GBNF as xgrammar takes it);
                     # choice: a JSON list of strings; structural_tag: xgrammar's structural-tag JSON; json_object: ""
    reasoning: str = ""
    think_start: int = -1
    think_end: int = -1
    thinking: bool = False

    def shape_error(self) -> Optional[str]:
        """Why this is not a well-formed constraint (unknown kind, spec not text, a spec missing
        or given where none belongs), or None. Whether the spec compiles is the grammar cache's
        question, asked before the request reaches the scheduler."""
        if self.kind not in STRUCTURED_KINDS:
            return (f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got "
                    f"{self.kind!r}")
        if not isinstance(self.spec, str):
            return f"structured output spec must be a string, got {type(self.spec).__name__}"
        if self.kind == "json_object" and self.spec:
            return "structured output kind json_object takes no spec"
        if self.kind != "json_object" and not self.spec:
            return f"structured output kind {self.kind} needs a spec"
        return None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`, for scripts ported from vLLM: one of `json` (a
    schema, as an object or its text), `regex`, `choice`, `grammar`, `json_object` (True) or
    `structural_tag`; `LLM` reads it into a `StructuredOutput` as the server reads the same
    request field (server/structured.py). The options are taken as given (xgrammar is the only
    backend; its JSON is compact); a `whitespace_pattern` is refused."""
    json: Union[None, str, Dict[str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    `temperature == 0` (or `top_k == 1`) means greedy. `top_k <= 0` and `top_p == 1` and
    `min_p == 0` disable those filters. `seed` makes random sampling reproducible; without it the
    request's uid seeds the noise (still identical on every rank). `logprobs=k` (0 to the
    engine's max_logprobs, 20 unless configured; check_request judges it) returns each
    sampled token's log-probability and those of the k most likely tokens (see
    TokenLogprobs); None returns none. The penalties (engine/penalties.py) push the
    logits away from tokens already seen: `repetition_penalty` > 0 (1: off) over prompt and
    output, `frequency_penalty` and `presence_penalty` in [-2, 2] (0: off) over the output.
    `logit_bias` adds a bias in [-100, 100] to token ids' logits before sampling (OpenAI's).
    `prompt_logprobs=k` returns, for every prompt token after the first, its log-probability
    given the tokens before it and the k most likely tokens there (the request then skips the
    prefix cache: cached tokens have no logits). Until `min_tokens` tokens are out, EOS and
    `stop_token_ids` cannot be sampled (vLLM's min_tokens; HF's min_new_tokens).
    `structured` constrains the output to a JSON schema, regex, grammar or choice list
    (StructuredOutput): a token bitmask from the grammar is applied to the logits before
    sampling, and a grammar that reaches its end finishes the request with "stop".
    `allowed_token_ids` (vLLM's), when set, is the only tokens sampling may pick, greedy or
    random (a mask over the logits; the log-probabilities stay the model's own).
    `bad_words` (vLLM's) are words the output never writes as the tokenizer spells them (with
    and without a leading space): `bad_word_ids`, at most MAX_BAD_WORDS words of at most
    MAX_BAD_WORD_TOKENS tokens; the engine bans a word's last token where the output ends
    with the rest of it (engine/bad_words.py).
    `cache_salt` (vLLM's) keeps the request's prefix-cache entries apart from those of
    requests with another salt or none (a tenant cannot learn another's prompts from how fast
    a shared prefix is served); at most MAX_CACHE_SALT_CHARS characters.
    `embed` (vLLM's pooling, served at /v1/embeddings and `LLM.embed`) asks for the prompt's
    embedding instead of text: the final norm's hidden states pooled as `pooling` says (one of
    POOLINGS: the last token's, the mean of all, the first token's; the model's own, which
    `LLM` and the API server read from its files), L2-normalized, sent with the request's one
    token (max_tokens 1), which is not an output. A pooling other than the last token's needs
    every prompt token's hidden state: such a request reuses no cached prefix.
    `lora_name` names the LoRA adapter the request runs with (one loaded at the time the
    scheduler takes the request, at start-up or since; None: the base model); its prefix-cache
    entries are the adapter's own (`prefix_namespace`, and per load: `Req.prefix_namespace`).
    `truncate_prompt_tokens=k` (vLLM's) keeps only the prompt's last k tokens (-1: the
    context length's worth; `truncate_prompt`). `stop` (strings that end the output, which
    leaves them out unless
    `include_stop_str_in_output`, vLLM's), `n` (choices per prompt), `skip_special_tokens`
    (vLLM's: False renders special tokens in the text) and `detokenize` (vLLM's: False leaves
    the text empty, and takes no stop strings) are read by `LLM` only. `max_tokens=None` asks
    for as many tokens as fit: `check_request` resolves it against the engine's limits, so
    every `Req` and every params past that check has an integer.
    """

    max_tokens: Optional[int] = 16
    # What max_tokens=None resolves to at most (the model's max_new_tokens), besides an eighth
    # of the KV pool, at least 256 (check_request).
    default_max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Tuple[int, ...] = ()
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Dict[int, float]] = None
    prompt_logprobs: Optional[int] = None
    min_tokens: int = 0
    structured: Optional[StructuredOutput] = None
    allowed_token_ids: Optional[Tuple[int, ...]] = None
    # SGLang's: the log-probabilities of these tokens too, wherever log-probabilities are
    # computed (TokenLogprobs.ids_logprobs; needs `logprobs`)
    token_ids_logprob: Tuple[int, ...] = ()
    # SGLang's: each output token comes with the final hidden state it was sampled from (the
    # first also with the prompt's: message.TokenOut.tensor); no cached prefix is reused and
    # batches holding such a request run eagerly (no CUDA graph)
    return_hidden_states: bool = False
    # vLLM's bad_words as token sequences (tokenizer/bad_words.py fills them from `bad_words`
    # where the prompt is tokenized): a sequence's last token is banned right after the rest
    # of it was generated (a one-token word: always).
    bad_word_ids: Tuple[Tuple[int, ...], ...] = ()
    # vLLM's: the prefix cache's namespace (base.py); the router keys replicas by it too.
    cache_salt: Optional[str] = None
    # vLLM's: with --scheduling-policy priority, lower values are admitted first (and retracted
    # last); under the default first-come-first-served policy it must stay 0.
    priority: int = 0
    lora_name: Optional[str] = None  # the LoRA adapter (by its registered name); None: none
    embed: bool = False  # the prompt's embedding, not text (see above)
    pooling: str = "last"  # how an embedding pools the prompt (one of POOLINGS)
    normalize: bool = True  # an embedding L2-normalized (False: the pooled state as it is)
    # Read where the prompt is tokenized (the tokenizer process, `LLM`), not by the ranks.
    truncate_prompt_tokens: Optional[int] = None
    bad_words: Tuple[str, ...] = ()  # vLLM's: words the output never writes (as bad_word_ids)
    # vLLM's name for a constraint (StructuredOutputsParams, or its fields as a dict): `LLM`
    # reads it into `structured`.
    structured_outputs: Union[None, StructuredOutputsParams, Dict[str, Any]] = None
    # Offline only (`LLM`): the server takes them per HTTP request, outside the params.
    stop: Tuple[str, ...] = ()
    # SGLang's: regular expressions (the `regex` module's syntax) that end the output where
    # the text first matches one, the match left out as a stop string is
    stop_regex: Tuple[str, ...] = ()
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        """The sequences as vLLM's users write them (lists, a single stop string, None for
        none) stored as the tuples the rest of the engine reads; anything else is left for
        `validate` to name."""
        def store(name: str, value: object) -> None:
            object.__setattr__(self, name, value)
        for name in ("stop", "stop_regex"):
            value = getattr(self, name)
            if value is None or isinstance(value, str):
                store(name, () if value is None else (value,))
        if self.stop_token_ids is None:
            store("stop_token_ids", ())
        if self.bad_words is None:
            store("bad_words", ())
        for name in ("stop", "stop_regex", "stop_token_ids", "allowed_token_ids", "bad_words",
                     "token_ids_logprob"):
            value = getattr(self, name)
            if isinstance(value, list):
                store(name, tuple(value))
        ids = self.bad_word_ids
        if isinstance(ids, (list, tuple)) and all(isinstance(w, (list, tuple)) for w in ids):
            store("bad_word_ids", tuple(tuple(w) for w in ids))

    def validate(self) -> None:
        """Raise ValueError naming the offending value. The rules for every field are here; it
        runs once, where the params are built from user input (the HTTP API, `LLM`)."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool)):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        cap = self.default_max_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"default_max_tokens (max_new_tokens) must be an integer >= 1, "
                             f"got {cap!r}")
        error = _min_tokens_error(self.min_tokens, self.max_tokens)
        if error is not None:
            raise ValueError(error)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (all tokens) or a positive integer, got "
                             f"{self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes, dict)) or not isinstance(
                self.stop_token_ids, Sequence):
            raise ValueError(f"stop_token_ids must be a list of token ids, got "
                             f"{self.stop_token_ids!r}")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {tok!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not (
                0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty!r}")
        self._validate_logit_bias()
        error = _structured_error(self.structured)
        if error is not None:
            raise ValueError(error)
        self._validate_allowed_token_ids()
        self._validate_token_ids_logprob()
        self._validate_bad_words()
        so = self.structured_outputs
        if so is not None and not isinstance(so, (StructuredOutputsParams, dict)):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict "
                             f"of its fields, got {type(so).__name__}")
        if so is not None and self.structured is not None:
            raise ValueError("structured and structured_outputs both constrain the output; "
                             "give one")
        if not isinstance(self.stop, tuple) or any(not isinstance(x, str) or not x
                                                   for x in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got "
                             f"{self.stop!r}")
        check_stop_regex(self.stop_regex)
        for name in ("cache_salt", "lora_name"):  # names: keys, not documents
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value)
                                      <= MAX_CACHE_SALT_CHARS):
                raise ValueError(f"{name} must be a string of 1 to {MAX_CACHE_SALT_CHARS} "
                                 f"characters, got {value!r:.60}")
        if not isinstance(self.embed, bool):
            raise ValueError(f"embed must be true or false, got {self.embed!r}")
        if self.embed and self.max_tokens != 1:
            raise ValueError(f"an embedding request computes its prompt only: max_tokens must "
                             f"be 1, got {self.max_tokens!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got "
                             f"{self.pooling!r:.40}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r:.40}")
        if (not isinstance(self.priority, int) or isinstance(self.priority, bool)
                or not -2 ** 63 <= self.priority < 2 ** 63):  # what a message carries
            raise ValueError(f"priority must be a 64-bit integer, got {self.priority!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or not (k == -1 or 1 <= k < 2 ** 31)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the context length) or an "
                             f"integer from 1 to 2**31 - 1, got {k!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "return_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings need detokenize=True, got stop={list(self.stop)!r} "
                             f"with detokenize=False")
        if self.stop_regex and not self.detokenize:
            raise ValueError(f"stop_regex needs detokenize=True, got stop_regex="
                             f"{list(self.stop_regex)!r} with detokenize=False")

    @property
    def prefix_namespace(self) -> Optional[str]:
        """The prefix cache's namespace of this request (kvcache/base.py): its cache_salt and
        its LoRA adapter, whose K/V differ from the base model's; None: the shared one."""
        if self.lora_name is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora_name}"

    def choice(self, i: int) -> "SamplingParams":
        """Choice i of n: the seed shifted by i (where one is set), so the choices differ."""
        if self.seed is None or i == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + i)

    def for_engine(self) -> "SamplingParams":
        """These params as the ranks get them: the fields `LLM` reads itself (stop strings, n,
        include_stop_str_in_output, skip_special_tokens, detokenize, truncate_prompt_tokens,
        bad_words, whose ids travel) at their defaults, so that they cost nothing on the wire
        (message.codec leaves defaults out)."""
        return dataclasses.replace(self, stop=(), stop_regex=(), n=1,
                                   include_stop_str_in_output=False,
                                   skip_special_tokens=True, detokenize=True,
                                   truncate_prompt_tokens=None, bad_words=(),
                                   structured_outputs=None)

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got "
                             f"{type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got "
                             f"{len(bias)}")
        for tok, value in bias.items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok!r}")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                                 f"for token {tok}")

    def _validate_allowed_token_ids(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is None:
            return
        if isinstance(allowed, (str, bytes, dict)) or not isinstance(allowed, Sequence):
            raise ValueError(f"allowed_token_ids must be a sequence of token ids, got "
                             f"{type(allowed).__name__}")
        if not allowed:
            raise ValueError("allowed_token_ids must not be empty (leave it unset to allow "
                             "every token)")
        bad = [t for t in allowed if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise ValueError(f"allowed_token_ids must be non-negative token ids, got "
                             f"{', '.join(repr(t) for t in bad[:8])}")

    def _validate_token_ids_logprob(self) -> None:
        ids = self.token_ids_logprob
        if not isinstance(ids, tuple) or any(not isinstance(t, int) or isinstance(t, bool)
                                             or t < 0 for t in ids):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r:.80}")
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(f"token_ids_logprob takes at most {MAX_TOKEN_IDS_LOGPROB} token "
                             f"ids, got {len(ids)}")
        if ids and self.logprobs is None:
            raise ValueError("token_ids_logprob needs logprobs (0 or more alternatives): the "
                             "ids' log-probabilities come with the sampled token's")

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if not isinstance(words, tuple) or any(not isinstance(w, str) or not w.strip()
                                               for w in words):
            raise ValueError(f"bad_words must be a list of words (non-blank strings), got "
                             f"{words!r:.80}")
        ids = self.bad_word_ids
        if len(words) > MAX_BAD_WORDS or len(ids) > 2 * MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got "
                             f"{len(words) or len(ids)}")
        for seq in ids:
            if not isinstance(seq, tuple) or not seq or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in seq):
                raise ValueError(f"bad_word_ids must be non-empty sequences of token ids, got "
                                 f"{seq!r:.80}")
            if len(seq) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"a bad word may be at most {MAX_BAD_WORD_TOKENS} tokens long, "
                                 f"got one of {len(seq)}")

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @functools.cached_property
    def raw_sampling(self) -> bool:
        """Sampled from the logits as they come, nothing else asked: no penalties, no logit
        bias, no allowed-token mask, no logprobs (cached: the engine asks for every request at
        every step)."""
        return not (self.has_penalties or self.logit_bias or self.logprobs is not None
                    or self.min_tokens > 0 or self.allowed_token_ids is not None
                    or bool(self.bad_word_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def compile_stop_regex(pattern: str) -> Any:
    """`pattern` compiled for a stop matcher (the `regex` module, which matches partially and
    times out: tokenizer/incremental.py); ValueError naming it where it does not compile, is
    longer than MAX_STOP_REGEX_CHARS or matches the empty text (it would end every output
    before its first token)."""
    import regex  # transformers' own dependency; imported only where a request has patterns
    if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_STOP_REGEX_CHARS:
        raise ValueError(f"stop_regex patterns are strings of 1 to {MAX_STOP_REGEX_CHARS} "
                         f"characters, got {pattern!r:.60}")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"stop_regex {pattern!r:.60} does not compile: {e}") from None
    if compiled.fullmatch("") is not None:
        raise ValueError(f"stop_regex {pattern!r:.60} matches the empty text: it would end "
                         f"every output at once")
    return compiled


def check_stop_regex(patterns: object) -> None:
    """ValueError naming what is wrong with a request's stop_regex (a tuple of patterns)."""
    if not isinstance(patterns, tuple):
        raise ValueError(f"stop_regex must be a string or a list of strings, got "
                         f"{patterns!r:.60}")
    if len(patterns) > MAX_STOP_REGEX:
        raise ValueError(f"stop_regex takes at most {MAX_STOP_REGEX} patterns, got "
                         f"{len(patterns)}")
    for pattern in patterns:
        compile_stop_regex(pattern)


def _min_tokens_error(min_tokens: object, max_tokens: Optional[int]) -> Optional[str]:
    """Why `min_tokens` does not go with `max_tokens` (None: not known yet), or None."""
    upper = math.inf if max_tokens is None else max_tokens
    if (not isinstance(min_tokens, int) or isinstance(min_tokens, bool)
            or not 0 <= min_tokens <= upper):
        bound = "max_tokens" if max_tokens is None else f"max_tokens = {max_tokens}"
        return f"min_tokens must be an integer in [0, {bound}], got {min_tokens!r}"
    return None


def _structured_error(structured: object) -> Optional[str]:
    """Why `structured` is not a well-formed StructuredOutput (or None), or None."""
    if structured is None:
        return None
    if not isinstance(structured, StructuredOutput):
        return (f"structured must be a StructuredOutput, got {type(structured).__name__}")
    return structured.shape_error()


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Limits(NamedTuple):
    """What one engine can hold, and the scheduler's prefill chunk; identical on every rank.

    Built once per rank by the scheduler from its engine; a rank process's ready report carries
    it to whoever spawned it (the launcher, which hands it to the tokenizer, or `LLM`).
    """

    max_context: int
    vocab_size: int
    num_pages: int
    page_size: int
    max_prefill_tokens: int  # new tokens one prefill batch takes at most (the chunk size)
    # --scheduling-policy priority: requests' `priority` orders the queue (else it must be 0)
    priority_scheduling: bool = False
    # LoRA adapter slots (0: LoRA is off). Which adapters they hold changes at run time, so a
    # request's adapter name is checked by the scheduler as it takes the request.
    lora_slots: int = 0
    # The most log-probabilities a request may ask for per token (logprobs, prompt_logprobs):
    # SchedulerConfig.max_logprobs resolved, never more than the vocabulary.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    hidden_size: int = 0  # the model's hidden state (return_hidden_states' row; 0: unknown)

    @property
    def kv_capacity(self) -> int:
        """Tokens the KV pool holds."""
        return self.num_pages * self.page_size


def prompt_error(ids: Sequence[int], vocab_size: int) -> Optional[str]:
    """Why a prompt's token ids cannot be served (none, or one outside the vocabulary), or None."""
    if len(ids) == 0:
        return "the prompt is empty"
    # The common case at C speed (a long prompt's ids are checked before its prefill launches).
    if set(map(type, ids)) <= {int, bool} and 0 <= min(ids) and max(ids) < vocab_size:
        return None
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:  # none where every id is an int of another subclass, and in range
        return f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
    return None


class WeightsRefused(ValueError):
    """A weight reload refused before any weight changed (a checkpoint that does not fit the
    served model): nothing to restore (StepEngine.reload_weights)."""


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the values, `param` the request
    field they came from (an API error names it)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class TooLong(RequestError):
    """The prompt plus max_tokens exceed the context length or, `in_pool`, the KV pool."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limits: Limits, in_pool: bool
                 ) -> None:
        n, m = prompt_tokens, max_tokens
        if in_pool:
            pages = -(-(n + m) // limits.page_size)
            message = (f"{n} prompt tokens plus max_tokens {m} needs {pages} KV pages, more than "
                       f"the pool holds ({limits.num_pages})")
        else:
            message = (f"{n} prompt tokens plus max_tokens {m} = {n + m} exceeds the context "
                       f"length {limits.max_context}")
        super().__init__(message, "max_tokens" if n < limits.max_context else "prompt")
        self.prompt_tokens, self.max_tokens, self.limits, self.in_pool = n, m, limits, in_pool


class NoRoom(RequestError):
    """The prompt alone fills the context (or the KV pool) of a request that left max_tokens
    to the server: no output token fits."""


def _auto_max_tokens(prompt_tokens: int, params: SamplingParams, limits: Limits) -> int:
    """What `max_tokens=None` stands for: the rest of the context (and of the KV pool, which
    must hold the whole request), capped at an eighth of that limit (at least 256), since
    admission may reserve KV for the whole of max_tokens and requests without one should still
    run side by side, and at `params.default_max_tokens` (the model's max_new_tokens) where
    that is lower. RequestError when no token fits or min_tokens does not."""
    limit = min(limits.max_context, limits.kv_capacity)
    if prompt_tokens >= limit:
        raise NoRoom(f"the prompt has {prompt_tokens} tokens, which leaves no room for "
                     f"output in the context length of {limit} tokens", "prompt")
    max_tokens = min(limit - prompt_tokens, max(256, limit // 8))
    if params.default_max_tokens is not None:
        max_tokens = min(max_tokens, params.default_max_tokens)
    error = _min_tokens_error(params.min_tokens, max_tokens)
    if error is not None:
        raise RequestError(error, "min_tokens")
    return max_tokens


def truncate_prompt(ids: List[int], params: SamplingParams, limits: Limits) -> List[int]:
    """The prompt as `params.truncate_prompt_tokens` leaves it: its last k tokens (-1: the
    context length), as vLLM truncates (from the left, so the end of a conversation stays);
    RequestError naming both numbers where k is more than the context holds."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    k = limits.max_context if k == -1 else k
    if k > limits.max_context:
        raise RequestError(f"truncate_prompt_tokens ({k}) is more than the model's maximum "
                           f"context length ({limits.max_context})", "truncate_prompt_tokens")
    return ids[-k:] if len(ids) > k else ids


def check_request(ids: Sequence[int], params: SamplingParams, limits: Limits) -> SamplingParams:
    """The params to serve a request with (max_tokens resolved), or RequestError naming the
    numbers: the one check of a request against an engine's limits, made by the tokenizer and
    `LLM` before submitting and by the scheduler on every message (the last line of defence).
    The params themselves were validated where they were built (`SamplingParams.validate`)."""
    error = prompt_error(ids, limits.vocab_size)
    if error is not None:
        raise RequestError(error, "prompt")
    for name, tokens in (("logit_bias", params.logit_bias or {}),
                         ("stop_token_ids", params.stop_token_ids),
                         ("allowed_token_ids", params.allowed_token_ids or ()),
                         ("token_ids_logprob", params.token_ids_logprob),
                         ("bad_words", [t for w in params.bad_word_ids for t in w])):
        outside = list(dict.fromkeys(str(t) for t in tokens if t >= limits.vocab_size))
        if outside:
            many = len(outside) > 1
            raise RequestError(f"{name} token id{'s' if many else ''} {', '.join(outside)} "
                               f"{'are' if many else 'is'} outside the vocabulary "
                               f"[0, {limits.vocab_size})", name)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > limits.max_logprobs:
            raise RequestError(f"{name} asks for the {k} most likely tokens, more than this "
                               f"engine returns (max_logprobs {limits.max_logprobs})", name)
    error = _structured_error(params.structured)
    if error is not None:
        raise RequestError(error, "structured")
    if params.lora_name is not None and limits.lora_slots == 0:
        raise RequestError(f"LoRA adapter {params.lora_name!r} asked for, but this engine "
                           f"serves none (start it with --enable-lora or --lora-modules)",
                           "model")
    if params.priority != 0 and not limits.priority_scheduling:
        raise RequestError(f"priority {params.priority} needs the priority scheduling policy "
                           f"(--scheduling-policy priority); this engine serves first come, "
                           f"first served", "priority")
    n = len(ids)
    m = params.max_tokens
    if m is None:
        m = _auto_max_tokens(n, params, limits)
        params = dataclasses.replace(params, max_tokens=m)
    if n + m > limits.max_context:
        raise TooLong(n, m, limits, in_pool=False)
    if n + m > limits.kv_capacity:  # more tokens than the pages hold: more pages than there are
        raise TooLong(n, m, limits, in_pool=True)
    if params.return_hidden_states and (n + m) * limits.hidden_size > MAX_HIDDEN_STATE_VALUES:
        raise RequestError(f"return_hidden_states over {n} prompt tokens + max_tokens {m} would "
                           f"send {(n + m) * limits.hidden_size} values of hidden state, more "
                           f"than {MAX_HIDDEN_STATE_VALUES}: ask for fewer tokens",
                           "return_hidden_states")
    return params


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the `top` most likely tokens' (most likely
    first), under the model's own distribution: log_softmax of the raw logits in float32,
    before temperature and the top-k / top-p / min-p filters (vLLM's default). `rank` is the
    token's place in that distribution, 1 for the most likely (vLLM's: how many tokens are at
    least as likely), None where not computed. Computed by rank 0's engine only; it crosses
    processes inside `message.TokenOut`."""

    logprob: float
    top_ids: Tuple[int, ...] = ()
    top_logprobs: Tuple[float, ...] = ()
    rank: Optional[int] = None
    # params.token_ids_logprob's log-probabilities there, in that order (SGLang's)
    ids_logprobs: Tuple[float, ...] = ()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id, a stop token id, or (detokenizer side) a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client went away or the request was cancelled


@dataclass(eq=False)
class Req:
    """One request inside a scheduler rank.

    `cached_len` tokens have KV in the pool (or being computed by a launched batch);
    `device_len` counts the prompt plus every token whose sampling was launched, so with overlap
    scheduling `len(token_ids)` trails it by the one in-flight step (a retracted request restarts
    with `device_len = len(token_ids)`). `pages` are the KV pages backing the sequence in order;
    the first `num_prefix_pages` belong to the prefix cache (locked through `cache_handle`), the
    rest to this request. The request owns page-table row `table_row` from admission until the
    scheduler retires it (exactly once, on finish, abort or retraction). `params` passed
    `check_request`: its max_tokens is an integer.
    """

    uid: int
    token_ids: List[int]  # prompt followed by every generated token
    prompt_len: int
    params: SamplingParams
    eos_ids: Tuple[int, ...]
    table_row: int = -1
    cached_len: int = 0
    device_len: int = 0
    pages: List[int] = field(default_factory=list)
    num_prefix_pages: int = 0
    cache_handle: object = None  # the cache manager's lock on the matched prefix
    prefix_hit: int = 0  # prompt tokens taken from the prefix cache
    # Own pages admission set aside for the whole request and not yet allocated: each page
    # allocated for the request draws this down, never below 0.
    reserved_pages: int = 0
    finish_reason: Optional[FinishReason] = None
    # With params.prompt_logprobs: those of prompt tokens 1.. computed so far (chunk by chunk),
    # sent with the first output token.
    prompt_logprobs: List[TokenLogprobs] = field(default_factory=list)
    # With params.return_hidden_states: those of the prompt's chunks run so far (CPU float32
    # [positions, hidden] each), sent with the first output token
    prompt_hidden: List["torch.Tensor"] = field(default_factory=list)
    # With params.structured: its matcher (a minisgl.grammar.RequestGrammar), set when its
    # grammar has compiled, before it is queued for admission.
    grammar: object = None
    # With params.lora_name: the slot and load of that adapter when the scheduler took the
    # request (it keeps them until it retires, whatever is loaded or unloaded meanwhile).
    lora: Optional["LoraBinding"] = None
    # A longrope model's sequence past its pretraining length (StepEngine.long_rope_from): its
    # every token rotates with the long factors, so its K/V are not a shorter sequence's. Set
    # as the scheduler takes a longer prompt, or as it prefills a sequence again that grew
    # past that length.
    long_rope: bool = False
    # Statistics only, never scheduling input (clocks differ between ranks): perf_counter when
    # the scheduler took the request and when it was first admitted (the queue time's end)
    arrived_s: float = 0.0
    scheduled_s: float = 0.0

    @property
    def prefix_namespace(self) -> Optional[str]:
        """Its prefix-cache namespace: the params' (`SamplingParams.prefix_namespace`);
        with an adapter, that adapter's load, so that an adapter unloaded and loaded again
        under the same name (other weights, perhaps) never matches its predecessor's K/V;
        with `long_rope`, a namespace of its own."""
        base = self.params.prefix_namespace
        if self.lora is None and not self.long_rope:
            return base
        parts = ["-" if base is None else f"ns:{base}"]  # no namespace apart from any one
        if self.lora is not None:
            parts.append(f"load:{self.lora.load}")
        if self.long_rope:
            parts.append("longrope")
        return "\x00".join(parts)

    @property
    def max_tokens(self) -> int:
        """params.max_tokens, which `check_request` resolved before the request was built."""
        m = self.params.max_tokens
        if m is None:
            raise RuntimeError(f"request {self.uid} was built from params that did not pass "
                               f"check_request (max_tokens unresolved)")
        return m

    @property
    def pools_whole_prompt(self) -> bool:
        """An embedding that pools every prompt token's hidden state (not the last token's
        alone): computed from the first token, no cached prefix reused."""
        return self.params.embed and self.params.pooling != "last"

    @property
    def wants_prompt_hidden(self) -> bool:
        """Its prompt's hidden states are still to be computed (params.return_hidden_states,
        before its first token): every prompt token runs, none from the prefix cache."""
        return self.params.return_hidden_states and self.output_len == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to be computed (a retracted request that
        already sent them computes them no more)."""
        return self.params.prompt_logprobs is not None and self.output_len == 0

    def __post_init__(self) -> None:
        self.device_len = self.device_len or self.prompt_len

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def all_launched(self) -> bool:
        """Every token it may produce (max_tokens) has been launched: with overlap its last one
        may still be in flight, and no further step can be of use to it. A function of the
        request's lengths only, so every rank agrees."""
        return self.device_len - self.prompt_len >= self.max_tokens

    def append_token(self, token: int) -> Optional[FinishReason]:
        """Record a sampled token and return why the request finished, if it did."""
        self.token_ids.append(token)
        stop_ids = self.params.stop_token_ids if self.params.ignore_eos else (
            self.eos_ids + self.params.stop_token_ids)
        if token in stop_ids:
            self.finish_reason = FinishReason.STOP
        elif self.output_len >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason


class Phase(str, enum.Enum):
    PREFILL = "prefill"  # extend: new prompt tokens (possibly a chunk) after a cached prefix
    DECODE = "decode"  # one new token per request
    # Speculative decoding: each request's newest token and its draft tokens (Batch.drafts),
    # computed as an extend, every position sampled (scheduler/speculative.py)
    VERIFY = "verify"


@dataclass(eq=False)
class Batch:
    """One forward pass: requests in a fixed order, the same on every rank (decode: longest
    first, ties by uid) and the tensors built for it.

    `extend_lens[i]` new tokens of `reqs[i]` are computed, starting at position `prefix_lens[i]`.
    A request whose `sample[i]` is False is a partial prefill chunk: its logits are not sampled.
    A mixed step is a prefill batch whose last `num_decode` requests are running ones decoding
    their next token (one new token each, its input on the device only, as in a decode batch;
    longest first, ties by uid): see scheduler.Scheduler.schedule.
    A verify batch (Phase.VERIFY) extends each running request by its newest token (known on
    the host: no overlap) and `drafts[i]`, from position `prefix_lens[i]` (its length - 1), and
    samples every one of those `extend_lens[i] = 1 + len(drafts[i])` positions.
    """

    phase: Phase
    reqs: List[Req]
    prefix_lens: List[int]
    extend_lens: List[int]
    sample: List[bool]
    num_decode: int = 0
    # Filled when the batch is prepared for a forward pass (the scheduler's slots, the
    # backend's metadata).
    out_slots: Optional[torch.Tensor] = None
    attn_meta: object = None
    launched_at: float = 0.0  # scheduler's clock at launch: step-time statistics only
    # The tokens whose requests run with a LoRA adapter (the engine's, per forward); None:
    # none does.
    lora: Optional["LoraRows"] = None
    # Some sampled request is constrained (Req.grammar): the engine's launch runs the forward
    # only, and sampling waits for the token bitmask (StepEngine.sample).
    masked: bool = False
    drafts: Optional[List[List[int]]] = None  # Phase.VERIFY's draft tokens, per request

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def seq_lens(self) -> List[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def first_decode(self) -> int:
        """Index of the first request that decodes one token: 0 in a decode batch, the end of
        the prefill requests in a mixed step, the batch size in a plain prefill."""
        return 0 if self.phase is Phase.DECODE else self.size - self.num_decode


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's options of an embedding (`LLM.embed`'s pooling_params): `dimensions` cuts a
    Matryoshka model's embeddings to their first values, normalized again (None: whole);
    `normalize` False returns the pooled state as it is (None: the model's default,
    models/pooling.Pooling.normalize); `use_activation` (`LLM.classify`, a cross-encoder's
    `LLM.score`) False answers the logits, not their probabilities (None: pooler_config's,
    models/classifier.LogitActivation)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    use_activation: Optional[bool] = None


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's name for the LoRA adapter an offline request runs with (`LLM.generate`'s
    `lora_request`, `LLM.add_lora`): `lora_name` one the `LLM` loaded (`lora_modules`,
    `add_lora`), or, with `lora_path` (its PEFT directory), one it loads on first use;
    `lora_int_id` is vLLM's id, unused."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LoraBinding(NamedTuple):
    """A request's LoRA adapter as the scheduler resolved its name: the engine slot holding
    it and the adapter's load number (counted alike on every rank: the same loads in the
    same order)."""

    slot: int
    load: int


class LoraRows(NamedTuple):
    """A forward's tokens by LoRA adapter (layers/lora.py adds the deltas). `mask[t, j]`: 1
    where token t runs with adapter `picks[j]`, else 0 ([T, k] on the device, in the
    activations' dtype; a row of zeros: the base model alone). `picks`: the k adapter slots
    some token runs with (int64 on the device), or None for every slot in slot order: the
    decode graphs' form, whose batches' adapters are not known when they are captured."""

    mask: torch.Tensor
    picks: Optional[torch.Tensor] = None


class StepResult(NamedTuple):
    """What one launched batch produced, once the device finished it (the engine's `collect`).

    `tokens[i]` is request i's sampled token (-1 where `Batch.sample[i]` is False). `logprobs[i]`
    is its token's log-probabilities where it asked for them (`params.logprobs`) and was sampled,
    else None. `prompt_logprobs` maps a batch index to the prompt log-probabilities this batch
    computed for that request (usually empty). Log-probabilities exist on the primary rank only.
    """

    tokens: List[int]
    logprobs: List[Optional[TokenLogprobs]]
    prompt_logprobs: Dict[int, List[TokenLogprobs]]
    # batch index -> the embedding of a request that asked (params.embed): float32 values,
    # little-endian bytes (primary rank only)
    embeddings: Optional[Dict[int, bytes]] = None
    # A verify batch's: per request, the token sampled at each of its positions (`tokens[i]`
    # is the first of them), and their log-probabilities where it asked (else None each)
    verified: Optional[List[List[int]]] = None
    verified_logprobs: Optional[List[List[Optional[TokenLogprobs]]]] = None
    # batch index -> [positions it ran, hidden] float32 on the CPU: the final hidden states of
    # a request that asked (params.return_hidden_states; primary rank only)
    hidden_states: Optional[Dict[int, "torch.Tensor"]] = None
