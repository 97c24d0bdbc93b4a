"""Request bodies of the HTTP API: parsing, validation, and conversion into a `Job`.

Every invalid request raises `ApiError` with an HTTP status and an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`); nothing here touches the request streams.
Unknown fields (user, metadata, ...) are accepted and ignored; OpenAI, vLLM and SGLang features
this server does not implement (tools outside chat, best_of, ...) are rejected with a 400
naming the field rather than silently dropped, unless the value asks for nothing (an empty
`functions` list, best_of 1). The structured-output fields (response_format,
structured_outputs, guided_*, regex, ebnf, choice) are read by structured.py, chat's tools by
tools.py. The README's table lists every field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, TypeVar,
                    Union)

from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl.core import SamplingParams, check_stop_regex
from minisgl.models.generation import SamplingDefaults
from minisgl.server.reasoning import keeps_special_tokens
from minisgl.server.tool_calls import tool_call_format
from minisgl.server.tools import ToolError, Tools, assistant_tool_calls, parse_tools
from minisgl.server.structured import FieldError, constraint

_INT64 = 2 ** 63
_INT32 = 2 ** 31  # token ids travel as int32
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64
# Deeper JSON is refused before validation: no request field needs more (tool schemas nest a
# few levels), and recursive parsers and encoders downstream would fail on much deeper input.
MAX_JSON_DEPTH = 64
COMPLETION_MAX_TOKENS = 16  # completions without max_tokens (OpenAI's and vLLM's default)
_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI request fields with an effect this server does not implement, each with the test for a
# value that asks for nothing (accepted, since clients often send the default explicitly).
_UNSUPPORTED: Dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: not v,  # completions (chat requests take them: tools.py)
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "suffix": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "parallel_tool_calls": lambda v: v in (None, False),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    # vLLM and SGLang extensions
    "guided_decoding_backend": lambda v: v in (None, "auto", "xgrammar"),
    "guided_whitespace_pattern": lambda v: v is None,
    "lora_request": lambda v: v is None,
    "mm_processor_kwargs": lambda v: not v,
    "documents": lambda v: not v,  # completions (chat requests take them)
    "chat_template": lambda v: v is None,  # completions (chat requests take it: trusted only)
}
# SGLang's and vLLM's flag for keeping special tokens' spaces is HF's decode option, which
# the fast tokenizers this server loads do not implement: only its default is served.
_SPACES_BETWEEN_SPECIAL_TOKENS = "spaces_between_special_tokens"



MAX_ID_CHARS = 128  # a client's request id: echoed in headers and ids, and logged


def request_id_error(value: str, what: str, param: str) -> Optional["ApiError"]:
    """Why a client's request id (`what`, e.g. "the X-Request-Id header") cannot be used, or
    None: 1 to MAX_ID_CHARS printable ASCII characters."""
    if 0 < len(value) <= MAX_ID_CHARS and value.isascii() and value.isprintable():
        return None
    return ApiError(400, f"{what} must be 1 to {MAX_ID_CHARS} printable ASCII characters, got "
                         f"{len(value)} characters", param)


def refuse_unsupported(fields: Dict[str, Any], table: Dict[str, Callable[[Any], bool]],
                        where: str = "") -> None:
    """ApiError(400) naming the first field of `fields` that `table` lists with a value that
    asks for something (its check says whether a value asks for nothing); `where`: the
    field's place, as "sampling_params."."""
    for name, value in fields.items():
        inert = table.get(name)
        if inert is not None and not inert(value):
            raise ApiError(400, f"{where}{name} is not supported by this server", name)


def checked_id(value: Optional[str], param: str) -> Optional[str]:
    """A request id from the body (vLLM's request_id, SGLang's rid), checked as the
    X-Request-Id header is; None where none was given."""
    error = None if value is None else request_id_error(value, param, param)
    if error is not None:
        raise error
    return value


class ApiError(Exception):
    """An HTTP error with an OpenAI error body; `headers` go on the response (Retry-After,
    WWW-Authenticate, ...)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error",
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                      code, kind)
        self.headers: Dict[str, str] = dict(headers or {})

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# --- request bodies ------------------------------------------------------------------------------
class Body(BaseModel):
    """A request body: strict types, unknown fields kept (each endpoint decides on them)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Body):
    # null is false (OpenAI's schema allows it; vLLM takes it)
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's: usage on every chunk


class SamplingBody(Body):
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: Union[None, str, List[str]] = None
    stop_regex: Union[None, str, List[str]] = None  # SGLang's (core.SamplingParams)
    stop_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang's: the matched stop string stays in the text
    include_stop_str_in_output: bool = False  # vLLM's name for the same
    allowed_token_ids: Optional[List[int]] = None  # vLLM's: sampling picks only among them


class _OpenAI(SamplingBody):
    model: Optional[str] = None
    max_completion_tokens: Optional[int] = None
    n: Optional[int] = None  # null: 1, as OpenAI's schema and vLLM read it
    stream: Optional[bool] = None  # null: false
    stream_options: Optional[StreamOptions] = None
    logprobs: Union[None, bool, int] = None
    logit_bias: Optional[Dict[str, float]] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: the prompt tokens' log-probabilities
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: keep the prompt's last k tokens
    cache_salt: Optional[str] = None  # vLLM's: the prefix cache's namespace for this request
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority
    bad_words: Optional[List[str]] = None  # vLLM's: words the output never writes
    # SGLang's: each choice's `hidden_states`, the last token's position's (streamed: on the
    # choice's last chunk)
    return_hidden_states: Optional[bool] = None
    # vLLM's: log-probability tokens as "token_id:N"
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's: the prompt's and each choice's token ids beside the text
    return_token_ids: Optional[bool] = None
    request_id: Optional[str] = None  # vLLM's: the response id's base (X-Request-Id wins)


class TextPart(Body):
    type: str
    text: Optional[str] = None


class ChatMessage(Body):
    role: str
    content: Union[None, str, List[TextPart]] = None
    tool_calls: Any = None  # an assistant's calls (checked by tools.assistant_tool_calls)
    tool_call_id: Optional[str] = None  # a tool message answers this call
    name: Optional[str] = None
    # an assistant's thinking, as vLLM takes it back (`reasoning`, its newer name, too): the
    # chat template decides what of it to render (Qwen3's, the turns after the last user's)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


# OpenAI's reasoning_effort values, as vLLM takes them
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class _ChatTemplate(Body):
    """How chat messages go through the model's chat template (vLLM's fields; OpenAI's
    `reasoning_effort`, which vLLM hands to the template: `template_kwargs`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    chat_template: Optional[str] = None  # vLLM's: Jinja text in the model's template's place
    documents: Optional[List[Dict[str, str]]] = None  # vLLM's: for a RAG template to show


def refuse_untrusted_template(body: _ChatTemplate, trusted: bool) -> None:
    """ApiError(400) naming the field where a request brings its own chat template
    (`chat_template`, or `chat_template_kwargs`' chat_template) and the server does not take
    them (vLLM's --trust-request-chat-template off): a template is code the tokenizer runs."""
    if trusted:
        return
    if body.chat_template is not None:
        field = "chat_template"
    elif "chat_template" in (body.chat_template_kwargs or {}):
        field = "chat_template_kwargs"
    else:
        return
    raise ApiError(400, f"{field}: this server does not take chat templates in requests (start "
                        f"it with --trust-request-chat-template to allow them)", field)


def template_kwargs(kwargs: Optional[Dict[str, Any]], reasoning_effort: Optional[str]
                    ) -> Optional[Dict[str, Any]]:
    """The chat template's keywords: the request's `chat_template_kwargs`, and its
    `reasoning_effort` as vLLM passes it on, as `reasoning_effort` (templates such as
    gpt-oss's and Qwen's newest read it) and as `enable_thinking` (false for "none": Qwen3's,
    Gemma's and DeepSeek's switch), each unless the request's own keywords set it. ApiError
    (400) for an effort not among REASONING_EFFORTS."""
    if reasoning_effort is None:
        return kwargs
    if reasoning_effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                            f"got {reasoning_effort!r:.40}", "reasoning_effort")
    return {"reasoning_effort": reasoning_effort,
            "enable_thinking": reasoning_effort != "none", **(kwargs or {})}


class _Tools(Body):
    """Function tools (checked by tools.parse_tools, which names the field at fault)."""

    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class ChatRequest(_OpenAI, _ChatTemplate, _Tools):
    messages: List[ChatMessage]
    top_logprobs: Optional[int] = None
    # vLLM's: the reply starts with the last message's text where that message has the reply's
    # role (a continued assistant message, say)
    echo: Optional[bool] = None
    # vLLM's: special tokens (BOS) added to the templated text too; the template writes its own
    add_special_tokens: bool = False


class CompletionRequest(_OpenAI):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: Optional[bool] = None  # null: false
    # vLLM's and Hugging Face's default: a text prompt gets the tokenizer's special tokens (BOS)
    add_special_tokens: bool = True


class TokenizeBody(_ChatTemplate, _Tools):
    """POST /tokenize: a `prompt` string or chat `messages` (the chat template applied as a
    chat request would, tools included: the same ids, the same count)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    return_token_strs: bool = False
    # None: as the generation endpoints tokenize (a prompt with special tokens, messages without)
    add_special_tokens: Optional[bool] = None


class DetokenizeBody(Body):
    model: Optional[str] = None
    tokens: List[int]


@dataclass(frozen=True)
class GenerateLogprobs:
    """SGLang's return_logprob options of a /generate job: prompt tokens from `start` on
    (-1: none), the `top` most likely at each position, each token's text where `text`."""

    start: int
    top: int
    text: bool
    ids: Tuple[int, ...] = ()  # token_ids_logprob: these ids' log-probabilities at each one


# --- the parsed job -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Template:
    """Options of the chat template, for a prompt of messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class Prompt:
    """Exactly one of `text`, `messages`, `input_ids` is set; `template` and `tools_json` (the
    tools for the chat template, a JSON list) go with messages. `add_special_tokens`: the
    tokenizer adds its special tokens (BOS) to the text, or to the templated messages' text
    (as vLLM: text prompts yes by default, chat no, since templates write their own)."""

    text: Optional[str] = None
    messages: Optional[List[Dict[str, Any]]] = None
    input_ids: Optional[List[int]] = None
    template: Template = Template()
    tools_json: Optional[str] = None
    add_special_tokens: bool = False
    text_pair: Optional[str] = None  # with text: the pair's second text (cross-encoders)
    # messages: the oldest turns dropped until the prompt fits the context (the Responses
    # API's truncation "auto"; tokenizer/truncation.py)
    drop_oldest: bool = False


@dataclass(frozen=True)
class Job:
    """What one HTTP request asks for: `n` choices for each prompt, choice i of prompt p at
    index p * n + i."""

    prompts: List[Prompt]
    params: SamplingParams  # max_tokens None: as many as fit (resolved by the tokenizer)
    n: int
    stop: Tuple[str, ...]
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the reply starts with the prompt
    continuous_usage: bool = False  # usage on every streamed chunk
    no_stop_trim: bool = False
    tools: Optional[Tools] = None  # chat: the tools, and whether the output is read for calls
    stop_regex: Tuple[str, ...] = ()  # SGLang's: patterns that end the output as `stop` does
    stream_interval: Optional[int] = None  # SGLang's: tokens a streamed chunk (None: the server's)
    # The request field params.structured came from: an error about it names that field.
    structured_param: Optional[str] = None
    # The request field params.logprobs came from (chat's top_logprobs, /generate's
    # top_logprobs_num): an error about it names that field.
    logprobs_param: str = "logprobs"
    # vLLM's prompt_logprobs as asked (alternatives per prompt token), for the reply's shape;
    # params.prompt_logprobs, what the engine computes, may be larger (an echo's logprobs).
    prompt_logprobs: Optional[int] = None
    # the client's X-Request-Id (server/request_log.py): the response id is built from it
    request_id: Optional[str] = None
    # the client's W3C trace context headers (traceparent, tracestate): tracing.py's parent
    trace_headers: Tuple[Tuple[str, str], ...] = ()
    # vLLM's return_tokens_as_token_ids: log-probability tokens rendered as "token_id:N"
    # (None: an OpenAI request that left it unset, which the server's setting decides)
    tokens_as_ids: Optional[bool] = False
    generate_logprobs: Optional[GenerateLogprobs] = None  # /generate's return_logprob
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids in the reply
    prompt_tokens_details: bool = True  # OpenAI usage's (cached_tokens); the server decides
    # chat: the role the reply's message names where the request continues its last message
    # (add_generation_prompt false: that message's role, as vLLM); None: the server's
    # response_role
    role: Optional[str] = None
    # chat echo (vLLM's): the last message's (role, text), which starts every choice's content
    # where its role is the reply's
    echo_message: Optional[Tuple[str, str]] = None
    # vLLM's use_beam_search: n is the beam width (beam_search_api.py), beams ranked by their
    # cumulative log-probability over length ** length_penalty
    beam_search: bool = False
    length_penalty: float = 1.0

    def field(self, param: str) -> str:
        """The request field that an engine-side error's `param` (a SamplingParams field)
        stands for in this request."""
        named = {"structured": self.structured_param, "logprobs": self.logprobs_param}
        return named.get(param) or param

    def choice_params(self, i: int) -> SamplingParams:
        """Choice i of a prompt: the request's seed shifted by i, so choices differ."""
        return self.params.choice(i)


M = TypeVar("M", bound=BaseModel)
_TOO_DEEP = object()  # what parse_body's JSON decoder could not recurse into


def parse_body(raw: bytes, model: Type[M]) -> M:
    """Decode, parse and schema-check a JSON body; ApiError(400) naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # nested far too deep for the parser
        obj = _TOO_DEEP
    if obj is _TOO_DEEP or _deeper_than(obj, text, MAX_JSON_DEPTH):
        raise ApiError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels "
                            f"deep")
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        raise ApiError(400, f"{loc or 'body'}: {err['msg']}", param) from None


def _deeper_than(obj: Any, text: str, limit: int) -> bool:
    """Whether the parsed JSON `obj` (of `text`) nests arrays and objects more than `limit`
    deep; iterative, and skipped when the text has too few brackets to nest that deep."""
    if text.count("[") + text.count("{") <= limit:
        return False
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _stop_strings(stop: Union[None, str, List[str]]) -> Tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                       "stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    return tuple(stops)


def _stop_patterns(stop_regex: Union[None, str, List[str]]) -> Tuple[str, ...]:
    patterns = (stop_regex,) if isinstance(stop_regex, str) else tuple(stop_regex or ())
    try:
        check_stop_regex(patterns)
    except ValueError as e:
        raise ApiError(400, str(e), "stop_regex") from None
    return patterns


def _check_int(name: str, value: Optional[int], limit: int = _INT64) -> None:
    if value is not None and not -limit <= value < limit:
        raise ApiError(400, f"{name} is out of range: {value}", name)


def check_ids(name: str, ids: Sequence[int]) -> None:
    for t in ids:
        _check_int(name, t, _INT32)


def _sampling(body: SamplingBody, max_tokens: Optional[int], defaults: SamplingDefaults,
              logprobs: Optional[int] = None, logit_bias: Optional[Dict[int, float]] = None,
              max_name: str = "max_tokens", **fields: Any) -> SamplingParams:
    """The request's SamplingParams, `defaults` where it leaves a field unset (or null), and
    `fields` (SamplingParams fields the request gives outside `body`, as they are);
    ApiError(400) naming the field at fault (`max_name`: the field max_tokens came from)."""
    for name in ("top_k", "seed", "min_tokens"):
        _check_int(name, getattr(body, name))
    _check_int(max_name, max_tokens, _INT32)
    check_ids("stop_token_ids", body.stop_token_ids or ())
    allowed = body.allowed_token_ids
    check_ids("allowed_token_ids", allowed or ())
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed, ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=(defaults.repetition_penalty if body.repetition_penalty is None
                            else body.repetition_penalty),
        min_tokens=body.min_tokens,
        default_max_tokens=defaults.max_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()), logprobs=logprobs,
        logit_bias=logit_bias, allowed_token_ids=None if allowed is None else tuple(allowed),
        **fields)
    try:
        params.validate()
    except ValueError as e:
        message = str(e)
        if message.startswith("max_tokens "):
            message = max_name + message[len("max_tokens"):]
        raise ApiError(400, message, message.split(" ", 1)[0]) from None
    return params


def _logprobs(body: _OpenAI) -> Optional[int]:
    """How many most likely tokens a request wants log-probabilities of (0: the sampled
    token's only), or None for none. Chat: `logprobs` true with `top_logprobs`; completions:
    `logprobs` as that count (OpenAI's two forms)."""
    if isinstance(body, ChatRequest):
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ApiError(400, f"logprobs: a chat request takes true or false, got "
                                f"{body.logprobs}", "logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k, name = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    else:
        if isinstance(body.logprobs, bool):
            raise ApiError(400, f"logprobs: a completion request takes the number of most likely "
                                f"tokens to return (0 to the server's --max-logprobs), got "
                                f"{json.dumps(body.logprobs)}",
                           "logprobs")
        k, name = body.logprobs, "logprobs"
    if k is not None and k < 0:
        raise ApiError(400, f"{name} must be >= 0, got {k}", name)
    return k


def _prompt_logprobs(body: _OpenAI) -> Optional[int]:
    """vLLM's prompt_logprobs: how many most likely tokens to return at each prompt position
    besides the prompt token itself (0 to the engine's max_logprobs, which the tokenizer
    checks), or None for none. vLLM's -1 (the whole vocabulary) is refused."""
    k = body.prompt_logprobs
    if k is not None and k < 0:
        raise ApiError(400, f"prompt_logprobs must be >= 0, got {k}",
                       "prompt_logprobs")
    return k


def logit_bias_ids(bias: object) -> Optional[Dict[int, float]]:
    """OpenAI's logit_bias (SGLang's too: token ids written as strings, each mapped to a
    number) with int keys, or None when empty; ApiError(400) naming logit_bias otherwise."""
    if not bias:
        return None
    if not isinstance(bias, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                         for v in bias.values()):
        raise ApiError(400, f"logit_bias must map token ids to numbers, got {bias!r:.80}",
                       "logit_bias")
    # ASCII digits only: str.isdigit also takes "²" and "١٢", which int() reads or refuses
    bad = [k for k in bias if not (k.isascii() and k.isdigit()) or len(k) > 10]
    if bad:
        raise ApiError(400, f"logit_bias: keys must be token ids (ASCII digits), got "
                            f"{', '.join(repr(k) for k in bad)}", "logit_bias")
    out_of_range = [k for k, v in bias.items() if not -100.0 <= v <= 100.0]
    if out_of_range:
        raise ApiError(400, f"logit_bias values must be numbers in [-100, 100], got "
                            f"{', '.join(f'{bias[k]} for {k}' for k in out_of_range)}",
                       "logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


class JobShape(NamedTuple):
    """What an endpoint reads from its body before the part every endpoint shares
    (`shaped_job`): the sampling fields, the choices, streaming, max_tokens (and the name it
    came under, for errors), and what only some endpoints give."""

    sampling: SamplingBody
    n: int
    stream: bool
    include_usage: bool
    max_tokens: Optional[int]
    max_name: str = "max_tokens"
    logprobs: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None
    # where the structured-output fields are (structured.constraint)
    structured_fields: Optional[Dict[str, Any]] = None
    params: Optional[Dict[str, Any]] = None  # more SamplingParams fields, as they are


def shaped_job(shape: JobShape, prompts: List[Prompt], defaults: SamplingDefaults) -> Job:
    """The job of `prompts` with `shape`'s sampling: SamplingParams (`defaults` where the body
    leaves a field unset), the structured-output constraint, the stop strings; ApiError(400)
    naming the field at fault."""
    sampling = shape.sampling
    extra = sampling.model_extra or {}
    if extra.get(_SPACES_BETWEEN_SPECIAL_TOKENS, True) is not True:
        raise ApiError(400, f"{_SPACES_BETWEEN_SPECIAL_TOKENS}: only true is supported",
                       _SPACES_BETWEEN_SPECIAL_TOKENS)
    try:
        found = constraint(extra if shape.structured_fields is None else shape.structured_fields)
    except FieldError as e:
        raise ApiError(400, str(e), e.param) from None
    params = _sampling(sampling, shape.max_tokens, defaults, shape.logprobs, shape.logit_bias,
                       shape.max_name, **(shape.params or {}))
    if found is not None:
        params = dataclasses.replace(params, structured=found.structured)
    return Job(prompts, params, shape.n, _stop_strings(sampling.stop),
               sampling.skip_special_tokens, shape.stream, shape.include_usage,
               no_stop_trim=sampling.no_stop_trim or sampling.include_stop_str_in_output,
               structured_param=found.param if found is not None else None,
               stop_regex=_stop_patterns(sampling.stop_regex))


def _job(body: _OpenAI, prompts: List[Prompt], max_n: int, defaults: SamplingDefaults) -> Job:
    """An OpenAI body's job (chat, completions, responses, messages)."""
    n, stream = 1 if body.n is None else body.n, bool(body.stream)
    if body.stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       "stream_options")
    options = body.stream_options
    max_tokens, max_name = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins; errors use it
        max_tokens, max_name = body.max_completion_tokens, "max_completion_tokens"
    logprobs, logit_bias = _logprobs(body), logit_bias_ids(body.logit_bias)
    prompt_logprobs = _prompt_logprobs(body)
    refuse_unsupported(body.model_extra or {}, _UNSUPPORTED)
    if not 1 <= n <= max_n:
        raise ApiError(400, f"n must be between 1 and {max_n}, got {n}", "n")
    shape = JobShape(body, n, stream, bool(options and options.include_usage), max_tokens,
                     max_name, logprobs, logit_bias, body.model_extra or {}, dict(
                         truncate_prompt_tokens=body.truncate_prompt_tokens,
                         cache_salt=body.cache_salt, priority=body.priority,
                         bad_words=tuple(body.bad_words or ())))
    job = shaped_job(shape, prompts, defaults)
    beam_search, length_penalty = _beam_fields(body.model_extra or {})
    if beam_search:
        _refuse_with_beam_search(body, job)
    return dataclasses.replace(
        job, params=dataclasses.replace(job.params, prompt_logprobs=prompt_logprobs,
                                        return_hidden_states=bool(body.return_hidden_states)),
        beam_search=beam_search, length_penalty=length_penalty,
        continuous_usage=bool(options and options.continuous_usage_stats),
        prompt_logprobs=prompt_logprobs, tokens_as_ids=body.return_tokens_as_token_ids,
        logprobs_param="top_logprobs" if isinstance(body, ChatRequest) else "logprobs",
        return_token_ids=bool(body.return_token_ids),
        request_id=checked_id(body.request_id, "request_id"))


def _beam_fields(extra: Dict[str, Any]) -> Tuple[bool, float]:
    """vLLM's use_beam_search (true, false or null) and length_penalty (a number; only with
    beam search, where it ranks the beams); ApiError(400) naming the field otherwise."""
    beam, penalty = extra.get("use_beam_search"), extra.get("length_penalty")
    if beam is not None and not isinstance(beam, bool):
        raise ApiError(400, f"use_beam_search must be true or false, got {json.dumps(beam)}",
                       "use_beam_search")
    if penalty is None:
        return bool(beam), 1.0
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)):
        raise ApiError(400, f"length_penalty must be a number, got {json.dumps(penalty)}",
                       "length_penalty")
    if not beam and penalty != 1:
        raise ApiError(400, "length_penalty ranks beams: it needs use_beam_search true",
                       "length_penalty")
    return bool(beam), float(penalty)


def _refuse_with_beam_search(body: _OpenAI, job: Job) -> None:
    """ApiError(400) naming the first field a beam search does not take that the request sets:
    beams grow by the model's raw log-probabilities, a token at a time, so nothing that
    changes or cuts the sampling (penalties, biases, stop strings, constraints, tool calls)
    and no log-probabilities or echo in the reply. Sampling fields the server's defaults set
    (a model's repetition_penalty) do not count: a beam search ignores them."""
    p = job.params
    asked = [(body.logprobs not in (None, False), job.logprobs_param),
             (body.prompt_logprobs is not None, "prompt_logprobs"),
             (bool(getattr(body, "echo", None)), "echo"), (bool(job.stop), "stop"),
             (bool(job.stop_regex), "stop_regex"),
             (bool(body.stop_token_ids), "stop_token_ids"),
             (p.structured is not None, job.structured_param or "response_format"),
             (bool(getattr(body, "tools", None)), "tools"),
             (bool(body.logit_bias), "logit_bias"),
             (body.allowed_token_ids is not None, "allowed_token_ids"),
             (bool(body.bad_words), "bad_words"), (body.min_tokens > 0, "min_tokens"),
             (bool(body.return_hidden_states), "return_hidden_states"),
             (body.presence_penalty not in (None, 0), "presence_penalty"),
             (body.frequency_penalty not in (None, 0), "frequency_penalty"),
             (body.repetition_penalty not in (None, 1), "repetition_penalty")]
    field = next((name for given, name in asked if given), None)
    if field is not None:
        raise ApiError(400, f"{field} cannot be combined with use_beam_search", field)


def _message_text(i: int, msg: ChatMessage) -> str:
    if msg.role not in _ROLES:
        raise ApiError(400, f"messages.{i}.role: unknown role {msg.role!r}; expected one of "
                            f"{', '.join(_ROLES)}", f"messages.{i}.role")
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages.{i}.content.{j}: only text content parts are "
                                f"supported, got type {part.type!r}", f"messages.{i}.content")
        parts.append(part.text)
    return "\n".join(parts)  # as vLLM joins a message's text parts


def _message(i: int, msg: ChatMessage) -> Dict[str, Any]:
    """A message for the chat template: role and text, an assistant's `tool_calls` (arguments
    as JSON text; the tokenizer hands them to the template as objects) and thinking (as
    `reasoning_content`, the name templates read), and a tool message's `tool_call_id`."""
    out: Dict[str, Any] = {"role": msg.role, "content": _message_text(i, msg)}
    for field in ("reasoning_content", "reasoning"):
        thinking = getattr(msg, field)
        if thinking is not None and msg.role != "assistant":
            raise ApiError(400, f"messages.{i}.{field}: only assistant messages carry "
                                f"thinking, got role {msg.role!r}", f"messages.{i}.{field}")
        if thinking is not None:
            out["reasoning_content"] = thinking
    if msg.tool_calls is not None:
        if msg.role != "assistant":
            raise ApiError(400, f"messages.{i}.tool_calls: only assistant messages make tool "
                                f"calls, got role {msg.role!r}", f"messages.{i}.tool_calls")
        try:
            out["tool_calls"] = assistant_tool_calls(f"messages.{i}.tool_calls", msg.tool_calls)
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from None
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    return out


def _tools(body: Union[ChatRequest, TokenizeBody]) -> Optional[Tools]:
    try:
        return parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolError as e:
        raise ApiError(400, str(e), e.param) from None


def _chat_prompt(body: Union[ChatRequest, TokenizeBody], messages: List[ChatMessage],
                 tools: Optional[Tools] = None) -> Prompt:
    """The prompt of chat messages with the request's template options (vLLM's rules)."""
    if not messages:
        raise ApiError(400, "messages: must be a non-empty list", "messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be "
                            "true (send add_generation_prompt: false)", "continue_final_message")
    if body.continue_final_message and messages[-1].role != "assistant":
        raise ApiError(400, "continue_final_message needs an assistant message last, got "
                            f"{messages[-1].role!r}", "continue_final_message")
    texts = [_message(i, m) for i, m in enumerate(messages)]
    kwargs = template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
    for name in ("chat_template", "documents"):  # vLLM passes them on as the template's
        if getattr(body, name) is not None:
            kwargs = {**(kwargs or {}), name: getattr(body, name)}
    return Prompt(messages=texts, template=Template(
        body.add_generation_prompt, body.continue_final_message, kwargs),
        tools_json=tools.template_json() if tools is not None else None,
        add_special_tokens=bool(body.add_special_tokens))


def chat_job(body: ChatRequest, max_n: int, tool_parser: Optional[str] = None,
             defaults: SamplingDefaults = SamplingDefaults(),
             reasoning_parser: Optional[str] = None) -> Job:
    """A chat request's job. With tools, `tool_parser` (a `tool_calls.TOOL_CALL_PARSERS` name,
    "hermes" when None) is the format calls are read in and, for "required" or a named function,
    enforced in. The output keeps special tokens unless the request sets
    `skip_special_tokens` where a marker to be read is one: the array formats' calls
    (`mistral`, `granite`), the `reasoning_parser`'s tags (reasoning.keeps_special_tokens).
    With a `reasoning_parser`, a constraint (structured output, or the calls' grammar) holds
    after the thinking (core.StructuredOutput.reasoning). `defaults`: the sampling of fields
    the request leaves unset (every job's)."""
    job = _chat_job(body, max_n, tool_parser, defaults, reasoning_parser)
    structured = job.params.structured
    if structured is None or reasoning_parser is None:
        return job
    # a reasoning model's thinking goes free, the constraint holds after it (grammar/reasoning)
    params = dataclasses.replace(job.params, structured=dataclasses.replace(
        structured, reasoning=reasoning_parser))
    return dataclasses.replace(job, params=params)


def constrained_from_the_start(job: Job) -> Job:
    """The job with its constraint holding from the first token, a reasoning model's
    thinking included (vLLM's enable_in_reasoning): no thinking gate."""
    structured = job.params.structured
    if structured is None or not structured.reasoning:
        return job
    params = dataclasses.replace(job.params, structured=dataclasses.replace(
        structured, reasoning=""))
    return dataclasses.replace(job, params=params)


def _chat_job(body: ChatRequest, max_n: int, tool_parser: Optional[str],
              defaults: SamplingDefaults, reasoning_parser: Optional[str]) -> Job:
    tools = _tools(body)
    job = _job(body, [_chat_prompt(body, body.messages, tools)], max_n, defaults)
    if not body.add_generation_prompt:
        job = dataclasses.replace(job, role=body.messages[-1].role)
    if body.echo:
        last = body.messages[-1]
        job = dataclasses.replace(job, echo_message=(last.role, _message_text(
            len(body.messages) - 1, last)))
    fmt = tool_call_format(tool_parser or "hermes")
    # Mistral's [TOOL_CALLS] is a special token: kept in the text (as vLLM does), calls after
    # content are found by it (the parser reads calls without it only at the start)
    special_calls = tools is not None and tools.parsed and fmt.array
    if ((special_calls or keeps_special_tokens(reasoning_parser))
            and "skip_special_tokens" not in body.model_fields_set):
        job = dataclasses.replace(job, skip_special_tokens=False)
    if tools is None:
        return job
    calls = tools.constraint(fmt)
    if calls is not None:
        if job.params.structured is not None:
            raise ApiError(400, f"tool_choice {json.dumps(body.tool_choice)} constrains the "
                                f"output to tool calls: it cannot be combined with "
                                f"{job.structured_param}", "tool_choice")
        # a tool whose parameters xgrammar cannot compile is named by the tokenizer's error
        job = dataclasses.replace(job, params=dataclasses.replace(job.params, structured=calls),
                                  structured_param="tools")
    return dataclasses.replace(job, tools=tools)


def tokenize_prompt(body: TokenizeBody) -> Prompt:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "exactly one of prompt and messages must be given", "prompt")
    if body.messages is None:
        return Prompt(text=body.prompt, add_special_tokens=body.add_special_tokens is not False)
    return _chat_prompt(body, body.messages, _tools(body))


def detokenize_prompt(body: DetokenizeBody) -> Prompt:
    check_ids("tokens", body.tokens)
    return Prompt(input_ids=list(body.tokens))


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) for t in x)


def listed_prompts(raw: Any, param: str, add_special_tokens: bool,
                   limit: int = MAX_PROMPTS) -> List[Prompt]:
    """A body's prompt field (a string, token ids, or a list of either) as prompts; ApiError
    (400) naming `param` for an empty one, more than `limit`, or an id outside int32."""
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        raw = [raw]
    if not raw:
        raise ApiError(400, f"{param}: must not be empty", param)
    if len(raw) > limit:
        raise ApiError(400, f"{param}: at most {limit} prompts, got {len(raw)}", param)
    prompts = [Prompt(text=p, add_special_tokens=add_special_tokens) if isinstance(p, str)
               else Prompt(input_ids=list(p)) for p in raw]
    for p in prompts:
        check_ids(param, p.input_ids or ())
    if any(p.input_ids is not None and not p.input_ids or p.text == "" for p in prompts):
        raise ApiError(400, f"{param}: must not be empty", param)
    return prompts


def completion_job(body: CompletionRequest, max_n: int,
                   defaults: SamplingDefaults = SamplingDefaults()) -> Job:
    prompts = listed_prompts(body.prompt, "prompt", body.add_special_tokens)
    if body.max_tokens is None and body.max_completion_tokens is None:
        body = body.model_copy(update={"max_tokens": COMPLETION_MAX_TOKENS})
    job = _job(body, prompts, max_n, defaults)
    if not body.echo:  # None (null) too
        return job
    # echo with logprobs: the prompt's tokens get theirs too (OpenAI's legacy completions), as
    # many alternatives as either field asks for
    asked = [k for k in (job.params.logprobs, job.prompt_logprobs) if k is not None]
    params = dataclasses.replace(job.params, prompt_logprobs=max(asked) if asked else None)
    return dataclasses.replace(job, params=params, echo=True)
