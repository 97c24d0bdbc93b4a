"""The tokenizer process: the API server's requests in, token ids out to scheduler rank 0.

For each `TokenizeRequest` it builds the prompt's ids (text, chat messages through the model's
chat template, or ids as given), checks the request against the ranks' limits
(`core.check_request`, which also turns an absent max_tokens into as many as fit), and then
sends, in this order, a `DetokenizeInit` to the detokenizer and a `UserMsg` to rank 0. A request
that fails the checks goes back to the API server as an error `ReplyChunk` (status 400) and never
reaches the scheduler. `AbortRequest` becomes an `AbortMsg` to rank 0.

With data-parallel replicas, "rank 0" is the rank 0 of the replica the router picks
(`router.py`), which learns each replica's load from the `SchedulerStats` the detokenizer forwards
here; an abort goes to every replica (only the one serving the uid has it; the others ignore it),
so no per-request state is kept here.

A model directory without tokenizer files (dummy-weight benchmark shapes) serves token ids only:
text, chat and stop strings are rejected.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import zmq

from minisgl.core import (Limits, RequestError, SamplingParams, TooLong, check_request,
                          prompt_error)
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.startup import report_startup
from minisgl.message.types import (AbortMsg, AbortRequest, DetokenizeInit, ReplyBatch, ReplyChunk,
                                   SchedulerStats, TextRequest, TokenizeRequest, UserMsg)
from minisgl.tokenizer.incremental import PROMPT_CONTEXT_TOKENS
from minisgl.tokenizer.router import Router
from minisgl.tokenizer.text import load_tokenizer

logger = logging.getLogger("minisgl.tokenizer")


@dataclass(frozen=True)
class TokenizerConfig:
    model_path: str
    # PULL, bound here: TokenizeRequest / AbortRequest from the API server (and the replicas'
    # SchedulerStats from the detokenizer, with several replicas)
    tokenizer_addr: str
    backend_addrs: Tuple[str, ...]  # PUSH to rank 0 of each replica
    detokenizer_addr: str  # PUSH to the detokenizer
    api_addr: str  # PUSH to the API server (rejections)
    chat_template: Optional[str] = None  # Jinja text replacing the model's own


class _NoTokenizer(Exception):
    message = ("this model has no tokenizer: send token ids (/generate with input_ids, or "
               "/v1/completions with a prompt of token ids) and no stop strings")


class Prepared(NamedTuple):
    input_ids: List[int]
    params: Optional[SamplingParams]  # None when rejected
    error: Optional[str]
    error_param: Optional[str] = None  # the request field the error is about


class Tokenizer:
    """The tokenizer's logic without sockets (unit-testable)."""

    def __init__(self, tokenizer: Optional[Any], limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer) if tokenizer is not None else limits.vocab_size
        # A prompt's ids must be ones the model embeds and the detokenizer can render.
        self.limits = limits._replace(vocab_size=min(self.vocab, limits.vocab_size))

    def encode(self, req: Union[TokenizeRequest, TextRequest]) -> List[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        if self.tokenizer is None:
            raise _NoTokenizer()
        if req.messages is not None:
            kwargs = json.loads(req.template_kwargs_json) if req.template_kwargs_json else {}
            if req.continue_final_message:  # older transformers do not know the keyword
                kwargs["continue_final_message"] = True
            out = self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=req.add_generation_prompt, tokenize=True,
                **kwargs)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return list(self.tokenizer.encode(req.text or "", add_special_tokens=False))

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
        return ReplyChunk(req.uid, self.tokenizer.decode(ids), ids, "stop")

    def prepare(self, req: TokenizeRequest) -> Prepared:
        """The ids and final params (max_tokens resolved) of a request, or why it is rejected:
        `core.check_request`'s verdict, a length error worded as this API always has (OpenAI's
        words for the context: clients match them)."""
        if self.tokenizer is None and req.stop:
            return Prepared([], None, _NoTokenizer.message)
        try:
            ids = self.encode(req)
        except _NoTokenizer:
            return Prepared([], None, _NoTokenizer.message)
        except Exception as e:  # a chat template may reject a conversation (roles, content)
            return Prepared([], None, f"cannot apply the chat template: {e}", "messages")
        try:
            return Prepared(ids, check_request(ids, req.params, self.limits), None)
        except TooLong as e:
            return Prepared(ids, None, _too_long(e), e.param)
        except RequestError as e:
            return Prepared(ids, None, str(e), e.param)


def _too_long(e: TooLong) -> str:
    n, m = e.prompt_tokens, e.max_tokens
    if e.in_pool:
        return (f"the request needs {n + m} tokens ({n} in the prompt, {m} in the completion) "
                f"but the KV cache holds only {e.limits.kv_capacity} tokens")
    return (f"This model's maximum context length is {e.limits.max_context} tokens. However, "
            f"you requested {n + m} tokens ({n} in the prompt, {m} in the completion). "
            f"Please reduce the length of the prompt or of max_tokens.")


def run_tokenizer(cfg: TokenizerConfig, conn: Any) -> None:
    """Process entry: load the tokenizer, bind, report ("ready", "tokenizer", {}), then take
    ("limits", core.Limits) from the launcher (sent once every rank is ready;
    requests wait in the socket until then) and serve forever (the launcher ends the process)."""
    with report_startup(conn, "tokenizer", logger):
        tokenizer = load_tokenizer(Path(cfg.model_path), cfg.chat_template)
        ctx = zmq.Context()
        inbox = PullQueue(ctx, cfg.tokenizer_addr, bind=True)
        to_backends = [PushQueue(ctx, a, bind=False) for a in cfg.backend_addrs]
        to_detok = PushQueue(ctx, cfg.detokenizer_addr, bind=False)
        to_api = PushQueue(ctx, cfg.api_addr, bind=False)
    conn.send(("ready", "tokenizer", {}))
    try:
        _, limits = conn.recv()  # a core.Limits
    except EOFError:  # the launcher is gone
        sys.exit(1)
    logic = Tokenizer(tokenizer, limits)
    router = Router(len(to_backends), limits.page_size)
    while True:
        msg = inbox.get()
        if isinstance(msg, AbortRequest):
            for to_backend in to_backends:
                to_backend.put(AbortMsg(msg.uid))
        elif isinstance(msg, SchedulerStats):
            router.update(msg)
        elif isinstance(msg, TextRequest):
            to_api.put(ReplyBatch([logic.answer(msg)]))
        elif isinstance(msg, TokenizeRequest):
            prep = logic.prepare(msg)
            if prep.params is None:
                to_api.put(ReplyBatch([ReplyChunk(msg.uid, "", [], error=prep.error,
                                                  error_status=400,
                                                  prompt_tokens=len(prep.input_ids),
                                                  error_param=prep.error_param)]))
                continue
            whole = msg.echo or prep.params.prompt_logprobs is not None
            to_detok.put(DetokenizeInit(msg.uid, prep.input_ids[-PROMPT_CONTEXT_TOKENS:],
                                        tuple(msg.stop), msg.skip_special_tokens,
                                        prep.input_ids if whole else None, msg.no_stop_trim,
                                        msg.echo))
            replica = router.route(prep.input_ids, len(prep.input_ids))
            to_backends[replica].put(UserMsg(msg.uid, prep.input_ids, prep.params))
        else:
            logger.error("ignoring unexpected message %s", type(msg).__name__)
