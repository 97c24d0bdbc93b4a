"""The tokenizer process: the API server's requests in, token ids out to scheduler rank 0.

For each `TokenizeRequest` it builds the prompt's ids (text, chat messages through the model's
chat template, or ids as given), checks the request against the ranks' limits
(`core.check_request`, which also turns an absent max_tokens into as many as fit), and then
sends, in this order, a `DetokenizeInit` to the detokenizer and a `UserMsg` to rank 0. A request
that fails the checks goes back to the API server as an error `ReplyChunk` (status 400) and never
reaches the scheduler; one refused by `--max-queued-tokens` (queued.py) gets status 429. A prompt
longer in characters than the context could ever hold is refused before it is tokenized.
A structured-output constraint is compiled here too (xgrammar, cached by (kind, spec)), so one
that does not compile is refused (error param "structured": the API names the field it came
from) before any rank sees it; the ranks compile it again for their matchers. Long prompts and
constrained requests are prepared on threads (slow_requests.py) while the loop goes on with
the others.
`AbortRequest` becomes an `AbortMsg` to rank 0. `ReplicaChange` (load or unload a LoRA
adapter, reload the weights) becomes its `AdapterMsg` or `WeightsMsg` to the rank 0 of the
replica it names, after a `DetokenizeInit` of its uid (the answer comes back as a prompt's
would).

With data-parallel replicas, "rank 0" is the rank 0 of the replica the router picks
(`router.py`), which learns each replica's load from the `SchedulerStats` the detokenizer forwards
here; an abort goes to every replica (only the one serving the uid has it; the others ignore it),
so no per-request state is kept here.

A model directory without tokenizer files (dummy-weight benchmark shapes) serves token ids only:
text, chat and stop strings are rejected.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import zmq

from minisgl.core import (Limits, NoRoom, RequestError, SamplingParams, StructuredOutput,
                          TooLong, check_request, prompt_error, truncate_prompt)
from minisgl.gc_heap import freeze_startup_heap
from minisgl.grammar import make_checker
from minisgl.grammar.reasoning import think_gate
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.startup import report_startup
from minisgl.message.types import (AbortMsg, AbortRequest, DetokenizeInit, ReplicaChange,
                                   ReplyBatch, ReplyChunk, SchedulerStats, TextRequest,
                                   TokenizeRequest, UserMsg)
from minisgl.tokenizer.incremental import PROMPT_CONTEXT_TOKENS
from minisgl.tokenizer.slow_requests import LONG_PROMPT_CHARS, SlowRequests
from minisgl.tokenizer.queued import QueuedTokens
from minisgl.tokenizer.router import Router
from minisgl.tokenizer.bad_words import with_bad_word_ids
from minisgl.tokenizer.chat_template import chat_prompt_ids
from minisgl.tokenizer.truncation import fewest_dropped
from minisgl.tokenizer.text import load_tokenizer

logger = logging.getLogger("minisgl.tokenizer")


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_path: str  # the model's directory, or --tokenizer's
    # PULL, bound here: TokenizeRequest / AbortRequest from the API server (and the replicas'
    # SchedulerStats from the detokenizer, with several replicas)
    tokenizer_addr: str
    backend_addrs: Tuple[str, ...]  # PUSH to rank 0 of each replica
    detokenizer_addr: str  # PUSH to the detokenizer
    api_addr: str  # PUSH to the API server (rejections)
    chat_template: Optional[str] = None  # Jinja text replacing the model's own
    max_queued_tokens: Optional[int] = None  # per replica (queued.py); None: no limit
    threads: int = 2  # threads for long prompts and constraints (slow_requests.py)
    # JSON object: the chat template's keywords where a request sets none of its own
    default_template_kwargs: Optional[str] = None
    content_format: str = "auto"  # messages' content for the template (chat_template.py)


class _NoTokenizer(Exception):
    message = ("this model has no tokenizer: send token ids (/generate with input_ids, or "
               "/v1/completions with a prompt of token ids) and no stop strings or stop_regex")


class Prepared(NamedTuple):
    input_ids: List[int]
    params: Optional[SamplingParams]  # None when rejected
    error: Optional[str]
    error_param: Optional[str] = None  # the request field the error is about


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token stands for: the longest entry of the
    vocabulary, added tokens included. A vocabulary entry is never shorter than its text
    (byte-level BPE spells each byte as one character, SentencePiece's '▁' is the space it
    stands for, WordPiece adds '##')."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def is_slow(req: Union[TokenizeRequest, TextRequest]) -> bool:
    """A request the loop hands to a thread (slow_requests.py): a long prompt, or a
    constraint to compile."""
    constrained = isinstance(req, TokenizeRequest) and req.params.structured is not None
    return constrained or prompt_chars(req) > LONG_PROMPT_CHARS


def prompt_chars(req: Union[TokenizeRequest, TextRequest]) -> int:
    """The characters of a request's text or chat messages' contents (0 for token ids)."""
    if req.text is not None:
        pair = req.text_pair if isinstance(req, TokenizeRequest) else None
        return len(req.text) + len(pair or "")
    return sum(len(m.get("content") or "") for m in req.messages or ()
               if isinstance(m.get("content"), str))


class Tokenizer:
    """The tokenizer's logic without sockets (unit-testable).

    A prompt of more than `max_prompt_chars` characters (the context times the longest token's
    characters) can never fit the context, whatever its tokens: it is refused without
    tokenizing it, so that no request makes the tokenizer spend minutes and gigabytes."""

    def __init__(self, tokenizer: Optional[Any], limits: Limits,
                 template_defaults: Optional[Dict[str, Any]] = None,
                 content_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        # the chat template's keywords (--default-chat-template-kwargs): a request's own win
        self.template_defaults = dict(template_defaults or {})
        self.content_format = content_format  # --chat-template-content-format
        self.vocab = len(tokenizer) if tokenizer is not None else limits.vocab_size
        # A prompt's ids must be ones the model embeds and the detokenizer can render.
        self.limits = limits._replace(vocab_size=min(self.vocab, limits.vocab_size))
        # The checker's cache builds xgrammar's compiler on its first constraint (its own lock:
        # the slow-request threads may ask at once).
        self._grammar_error: Optional[Callable[[StructuredOutput], Optional[str]]] = (
            None if tokenizer is None else make_checker(tokenizer, self.limits.vocab_size))
        token_chars = longest_token_chars(tokenizer) if tokenizer is not None else 1
        self.max_prompt_chars = limits.max_context * token_chars

    def structured_error(self, structured: StructuredOutput) -> Optional[str]:
        """Why the constraint does not compile for this model's vocabulary, or None."""
        if self._grammar_error is None:
            return "this model has no tokenizer: structured output needs one"
        return self._grammar_error(structured)

    def chars_error(self, req: Union[TokenizeRequest, TextRequest]) -> Optional[str]:
        """Why a prompt is too long in characters to ever fit, or None."""
        n = prompt_chars(req)
        if n <= self.max_prompt_chars:
            return None
        return (f"the prompt has {n} characters: more than this model's maximum context "
                f"length of {self.limits.max_context} tokens can hold (at most "
                f"{self.max_prompt_chars} characters)")

    def encode(self, req: Union[TokenizeRequest, TextRequest]) -> List[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        if self.tokenizer is None:
            raise _NoTokenizer()
        if req.messages is not None:
            kwargs = {**self.template_defaults, **(
                json.loads(req.template_kwargs_json) if req.template_kwargs_json else {})}
            if req.continue_final_message:  # older transformers do not know the keyword
                kwargs["continue_final_message"] = True
            if req.tools_json is not None:
                kwargs["tools"] = json.loads(req.tools_json)
            return chat_prompt_ids(self.tokenizer, req.messages, req.add_special_tokens,
                                   self.content_format,
                                   add_generation_prompt=req.add_generation_prompt, **kwargs)
        if isinstance(req, TokenizeRequest) and req.text_pair is not None:  # a cross-encoder's
            return list(self.tokenizer.encode(req.text or "", req.text_pair,
                                              add_special_tokens=req.add_special_tokens))
        return list(self.tokenizer.encode(req.text or "",
                                          add_special_tokens=req.add_special_tokens))

    def info(self) -> Dict[str, Any]:
        """GET /tokenizer_info: the tokenizer's class, special tokens and chat template."""
        tok = self.tokenizer
        out: Dict[str, Any] = {"tokenizer_class": type(tok).__name__ if tok else None,
                               "vocab_size": self.vocab,
                               "model_max_length": self.limits.max_context}
        if tok is not None:
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = getattr(tok, name, None)
                out[name] = value if isinstance(value, str) else None
            out["chat_template"] = getattr(tok, "chat_template", None)
        return out

    def answer(self, req: TextRequest) -> ReplyChunk:
        """The final reply to a tokenize (text, messages), detokenize (input_ids) or info
        request."""
        if req.info:
            return ReplyChunk(req.uid, json.dumps(self.info()), [], "stop")
        too_long = self.chars_error(req)
        if too_long is not None:
            return ReplyChunk(req.uid, error=too_long, error_param="prompt")
        try:
            if self.tokenizer is None:
                raise _NoTokenizer()
            ids = self.encode(req)
        except _NoTokenizer:
            return ReplyChunk(req.uid, error=_NoTokenizer.message)
        except Exception as e:  # a chat template may reject a conversation (roles, content)
            return ReplyChunk(req.uid, error=f"cannot apply the chat template: {e}")
        error = prompt_error(ids, self.vocab) if ids else None  # empty is fine here
        if error is not None:
            return ReplyChunk(req.uid, error=error,
                              error_param="tokens" if req.input_ids is not None else "prompt")
        if req.input_ids is None:
            strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return ReplyChunk(req.uid, "", ids, "stop", prompt_tokens=len(ids), token_strs=strs)
        return ReplyChunk(req.uid, self.tokenizer.decode(
            ids, skip_special_tokens=req.skip_special_tokens), ids, "stop")

    def prepare(self, req: TokenizeRequest) -> Prepared:
        """The ids and final params (max_tokens resolved) of a request, or why it is rejected:
        `core.check_request`'s verdict, a length error worded as this API always has (OpenAI's
        words for the context: clients match them)."""
        if self.tokenizer is None and (req.stop or req.stop_regex):
            return Prepared([], None, _NoTokenizer.message)
        # A prompt to truncate may be any length: only the body limit bounds its tokenizing.
        asks_truncation = req.params.truncate_prompt_tokens is not None or req.drop_oldest
        too_long = None if asks_truncation else self.chars_error(req)
        if too_long is not None:
            return Prepared([], None, too_long, "prompt")
        try:
            ids = self.encode(req)
        except _NoTokenizer:
            return Prepared([], None, _NoTokenizer.message)
        except Exception as e:  # a chat template may reject a conversation (roles, content)
            return Prepared([], None, f"cannot apply the chat template: {e}", "messages")
        try:
            ids = truncate_prompt(ids, req.params, self.limits)
            params = check_request(ids, with_bad_word_ids(self.tokenizer, req.params),
                                   self.limits)
        except TooLong as e:
            return self._cut(req) or Prepared(ids, None, _too_long(e), e.param)
        except NoRoom as e:
            return self._cut(req) or Prepared(ids, None, str(e), e.param)
        except RequestError as e:
            return Prepared(ids, None, str(e), e.param)
        if params.structured is not None:
            error = self.structured_error(params.structured)
            if error is not None:
                return Prepared(ids, None, error, "structured")
            params = self.gated(params, ids)
        return Prepared(ids, params, None)

    def _cut(self, req: TokenizeRequest) -> Optional[Prepared]:
        """A conversation too long for the context (or the KV pool) prepared with its fewest
        oldest turns dropped (tokenizer/truncation.py), where it asks for that (`drop_oldest`)
        and some cut fits; else None."""
        if not req.drop_oldest or not req.messages:
            return None
        shorter = fewest_dropped(req.messages, lambda ms: self._fits(req, ms))
        if shorter is None:
            return None
        return self.prepare(dataclasses.replace(req, messages=shorter, drop_oldest=False))

    def _fits(self, req: TokenizeRequest, messages: List[dict]) -> bool:
        """Whether `req` with these `messages` fits the context (a template that refuses
        them: no)."""
        try:
            ids = self.encode(dataclasses.replace(req, messages=messages))
            check_request(truncate_prompt(ids, req.params, self.limits), req.params,
                          self.limits)
        except (TooLong, NoRoom):
            return False
        except RequestError:
            return True  # not a length: the final prepare reports it
        except Exception:  # noqa: BLE001  (the template's refusal of this cut)
            return False
        return True

    def gated(self, params: SamplingParams, ids: List[int]) -> SamplingParams:
        """`params` with its constraint's thinking gate resolved for this prompt, where it
        names a reasoning format (grammar/reasoning.think_gate)."""
        structured = params.structured
        if structured is None or not structured.reasoning or self.tokenizer is None:
            return params
        gate = think_gate(self.tokenizer, structured.reasoning, ids)
        return dataclasses.replace(params, structured=dataclasses.replace(
            structured, think_start=gate.start, think_end=gate.end, thinking=gate.thinking))


def _too_long(e: TooLong) -> str:
    n, m = e.prompt_tokens, e.max_tokens
    if e.in_pool:
        return (f"the request needs {n + m} tokens ({n} in the prompt, {m} in the completion) "
                f"but the KV cache holds only {e.limits.kv_capacity} tokens")
    return (f"This model's maximum context length is {e.limits.max_context} tokens. However, "
            f"you requested {n + m} tokens ({n} in the prompt, {m} in the completion). "
            f"Please reduce the length of the prompt or of max_tokens.")


class Sockets(NamedTuple):
    inbox: PullQueue
    to_backends: List[PushQueue]
    to_detok: PushQueue
    to_api: PushQueue


def _sockets(cfg: TokenizerConfig, ctx: zmq.Context) -> Sockets:
    return Sockets(PullQueue(ctx, cfg.tokenizer_addr, bind=True),
                   [PushQueue(ctx, a, bind=False) for a in cfg.backend_addrs],
                   PushQueue(ctx, cfg.detokenizer_addr, bind=False),
                   PushQueue(ctx, cfg.api_addr, bind=False))


class Serving:
    """The tokenizer's loop: messages from the API server (and stats from the detokenizer) in;
    inits to the detokenizer, requests and aborts to the replicas, rejections to the API
    server out. Slow requests (long prompts, constraints) are prepared on `SlowRequests`
    threads meanwhile."""

    def __init__(self, cfg: TokenizerConfig, sockets: Sockets, logic: Tokenizer) -> None:
        self.logic = logic
        self.inbox, self.to_backends, self.to_detok, self.to_api = sockets
        self.router = Router(len(self.to_backends), logic.limits.page_size)
        self.queued = QueuedTokens(len(self.to_backends), cfg.max_queued_tokens)
        self.slow = SlowRequests(cfg.threads)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox.sock, zmq.POLLIN)
        poller.register(self.slow.fileno(), zmq.POLLIN)
        while True:
            poller.poll()
            for msg, result in self.slow.finished():
                self.finish(msg, result)
            while not self.inbox.empty():
                self.handle(self.inbox.get())

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortRequest):
            self.slow.cancel(msg.uid)
            for to_backend in self.to_backends:
                to_backend.put(AbortMsg(msg.uid))
        elif isinstance(msg, ReplicaChange):
            self.to_detok.put(DetokenizeInit(msg.change.uid, []))
            self.to_backends[msg.replica].put(msg.change)
        elif isinstance(msg, SchedulerStats):
            self.router.update(msg)
            self.queued.update(msg)
        elif isinstance(msg, (TextRequest, TokenizeRequest)):
            work: Callable[[Any], Any] = (self.logic.answer if isinstance(msg, TextRequest)
                                          else self.logic.prepare)
            if is_slow(msg):
                self.slow.submit(msg, work)
            else:
                self.finish(msg, work(msg))
        else:
            logger.error("ignoring unexpected message %s", type(msg).__name__)

    def finish(self, msg: Union[TextRequest, TokenizeRequest], result: Any) -> None:
        """Send on what `Tokenizer.answer` or `prepare` made of `msg`."""
        if isinstance(result, BaseException):
            logger.error("tokenizing request %d failed: %r", msg.uid, result)
            self.reject(msg.uid, f"the tokenizer failed: {type(result).__name__}", 500, 0)
        elif isinstance(msg, TextRequest):
            self.to_api.put(ReplyBatch([result]))
        elif result.params is None:
            self.reject(msg.uid, result.error, 400, len(result.input_ids), result.error_param)
        else:
            self.send(msg, result.input_ids, result.params)

    def send(self, msg: TokenizeRequest, ids: List[int], params: SamplingParams) -> None:
        """Route an accepted request (its ids and resolved params) to a replica."""
        replica = self.router.route(ids, len(ids), params.prefix_namespace)
        logger.debug("request %d: %d prompt tokens, %d queued at replica %d", msg.uid, len(ids),
                     self.queued.queued(replica), replica)
        if not self.queued.admits(replica, len(ids)):
            self.reject(msg.uid, f"{self.queued.queued(replica)} prompt tokens queued and this "
                                 f"request's {len(ids)} would pass the limit of "
                                 f"{self.queued.limit}", 429, len(ids))
            return
        whole = msg.echo or params.prompt_logprobs is not None or msg.return_token_ids
        self.to_detok.put(DetokenizeInit(msg.uid, ids[-PROMPT_CONTEXT_TOKENS:], tuple(msg.stop),
                                         msg.skip_special_tokens, ids if whole else None,
                                         msg.no_stop_trim, msg.echo, params.min_tokens,
                                         msg.tokens_as_ids, msg.return_token_ids,
                                         msg.stop_regex, msg.stream_interval,
                                         params.token_ids_logprob))
        self.to_backends[replica].put(UserMsg(msg.uid, ids, params))
        self.queued.sent(replica, len(ids))

    def reject(self, uid: int, error: Optional[str], status: int, prompt_tokens: int,
               param: Optional[str] = None) -> None:
        self.to_api.put(ReplyBatch([ReplyChunk(uid, "", [], error=error, error_status=status,
                                               prompt_tokens=prompt_tokens,
                                               error_param=param)]))


def run_tokenizer(cfg: TokenizerConfig, conn: Any) -> None:
    """Process entry: load the tokenizer, bind, report ("ready", "tokenizer", {}), then take
    ("limits", core.Limits) from the launcher (sent once every rank is ready;
    requests wait in the socket until then) and serve forever (the launcher ends the process)."""
    with report_startup(conn, "tokenizer", logger):
        tokenizer = load_tokenizer(Path(cfg.tokenizer_path), cfg.chat_template)
        sockets = _sockets(cfg, zmq.Context())
    freeze_startup_heap(logger, "tokenizer")
    conn.send(("ready", "tokenizer", {}))
    try:
        _, limits = conn.recv()  # a core.Limits
    except EOFError:  # the launcher is gone
        sys.exit(1)
    defaults = json.loads(cfg.default_template_kwargs or "{}")  # checked by ServerConfig
    Serving(cfg, sockets, Tokenizer(tokenizer, limits, defaults, cfg.content_format)).run()
