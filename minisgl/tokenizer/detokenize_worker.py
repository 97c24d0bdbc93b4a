"""The detokenizer process: rank 0's token ids in, text replies out to the API server.

Per-request state (`_Request`) is created by the tokenizer's `DetokenizeInit` and freed when rank
0's final `TokenOut` for the uid arrives (finish, abort or rejection): exactly one final `TokenOut`
comes per request that reached the scheduler. When a stop string ends a request, the reply to the
API is final at once, rank 0 gets an `AbortMsg` (its KV pages are freed), and later tokens of the
uid are dropped until that final `TokenOut`.

`TokenOut`s that overtake their `DetokenizeInit` (they travel different sockets) wait in
`pending` until it arrives.

With data-parallel replicas every replica's rank 0 sends here (uids are unique across them); a
stop string's abort goes to every replica (only the one serving the uid has it). Given the
tokenizer's address, the detokenizer forwards it every replica's `SchedulerStats`: its router
weighs the replicas' loads, its admission counts their queued tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import zmq

from minisgl.core import FinishReason, TokenLogprobs
from minisgl.gc_heap import freeze_startup_heap
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.startup import report_startup
from minisgl.message.types import (AbortMsg, BatchTokenOut, DetokenizeInit, ReplyBatch,
                                   ReplyChunk, TokenLogprobText, TokenOut, WireTensor)
from minisgl.tokenizer.incremental import IncrementalDecoder, StopMatcher
from minisgl.tokenizer.text import load_tokenizer
from minisgl.tokenizer.token_bytes import token_bytes

logger = logging.getLogger("minisgl.detokenizer")


@dataclass(frozen=True)
class DetokenizerConfig:
    tokenizer_path: str  # the model's directory, or --tokenizer's
    detokenizer_addr: str  # PULL, bound here: rank 0's BatchTokenOut, the tokenizer's inits
    backend_addrs: Tuple[str, ...]  # PUSH to each replica's rank 0: aborts of stopped requests
    api_addr: str  # PUSH to the API server: ReplyBatch
    tokenizer_addr: Optional[str] = None  # PUSH to the tokenizer: stats (routing, admission)


@dataclass
class _Request:
    decoder: IncrementalDecoder
    matcher: StopMatcher
    completion_tokens: int = 0
    cached_tokens: int = 0
    stopped: bool = False  # ended by a stop string; waiting for rank 0's final TokenOut
    # The prompt, until the first chunk echoes it or carries its log-probabilities.
    prompt_ids: Optional[List[int]] = None
    echo: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings count only after more tokens than this
    tokens_as_ids: bool = False  # log-probability tokens rendered "token_id:N"
    return_prompt_ids: bool = False  # the first chunk carries the prompt's ids
    interval: int = 1  # DetokenizeInit.stream_interval
    asked_ids: Tuple[int, ...] = ()  # DetokenizeInit.token_ids_logprob
    sent: bool = False  # the first chunk went out
    waiting: Optional[ReplyChunk] = None  # what goes out with the next chunk sent

    def paced(self, chunk: ReplyChunk) -> List[ReplyChunk]:
        """The chunks to send now: the first chunk at once (the first token's latency), then
        one every `interval` tokens holding what came since (0: none until the last); a final
        or an error chunk goes as it is, after what waits (so that a stop token's text-less
        chunk stays one of its own, as every reply's end has it)."""
        if chunk.finish_reason is not None or chunk.error is not None:
            waiting, self.waiting = self.waiting, None
            return [chunk] if waiting is None else [waiting, chunk]
        if self.waiting is not None:
            w = self.waiting
            chunk = dataclasses.replace(
                chunk, text=w.text + chunk.text, token_ids=w.token_ids + chunk.token_ids,
                logprobs=w.logprobs + chunk.logprobs,
                tensor=WireTensor.joined([w.tensor, chunk.tensor]))
            self.waiting = None
        if self.interval == 1 or not self.sent or 0 < self.interval <= len(chunk.token_ids):
            self.sent = True
            return [chunk]
        self.waiting = chunk
        return []


class Rendered(NamedTuple):
    chunks: List[ReplyChunk]
    aborts: List[int]  # uids rank 0 must stop (ended here by a stop string)


@dataclass
class Detokenizer:
    """The detokenizer's logic without sockets (unit-testable)."""

    tokenizer: Optional[Any]  # None: a model without a tokenizer (token ids only, no text)
    requests: Dict[int, _Request] = field(default_factory=dict)
    pending: Dict[int, List[TokenOut]] = field(default_factory=dict)
    # Each token's text alone and, where that is not its bytes, the bytes (token_bytes.py): at
    # most one entry per vocabulary id.
    token_texts: Dict[int, Tuple[str, Optional[bytes]]] = field(default_factory=dict)

    def init(self, msg: DetokenizeInit) -> Rendered:
        self.requests[msg.uid] = _Request(
            IncrementalDecoder(self.tokenizer, msg.prompt_tail, msg.skip_special_tokens),
            StopMatcher(msg.stop, msg.no_stop_trim, msg.stop_regex), prompt_ids=msg.prompt_ids,
            echo=msg.echo,
            skip_special_tokens=msg.skip_special_tokens, min_tokens=msg.min_tokens,
            tokens_as_ids=msg.tokens_as_ids, return_prompt_ids=msg.return_prompt_ids,
            interval=msg.stream_interval, asked_ids=msg.token_ids_logprob)
        return self.render(self.pending.pop(msg.uid, []))

    def render(self, outs: List[TokenOut]) -> Rendered:
        chunks: List[ReplyChunk] = []
        aborts: List[int] = []
        for out in outs:
            if out.uid not in self.requests:
                self.pending.setdefault(out.uid, []).append(out)
                continue
            sent, abort = self._one(out)
            chunks += sent
            if abort:
                aborts.append(out.uid)
        return Rendered(chunks, aborts)

    def _one(self, out: TokenOut) -> Tuple[List[ReplyChunk], bool]:
        """The chunks `out` sends now (Request.paced), and whether rank 0 must stop the
        request (a stop string ended it here)."""
        if out.error is not None:  # rejected by the scheduler: nothing was generated
            del self.requests[out.uid]
            return [ReplyChunk(out.uid, error=out.error, error_status=400,
                               prompt_tokens=out.prompt_tokens)], False
        req = self.requests[out.uid]
        if out.finish_reason is not None:
            del self.requests[out.uid]  # rank 0 is done with it: free the state
        if req.stopped:
            return [], False
        req.cached_tokens = max(req.cached_tokens, out.cached_tokens)
        text, ids, logprobs = "", [], []
        if out.token >= 0:
            req.completion_tokens += 1
            ids = [out.token]
            if out.logprobs is not None:
                logprobs = [self._logprob_text(out.token, out.logprobs, req.tokens_as_ids,
                                               req.asked_ids)]
            if out.finish_reason != FinishReason.STOP.value:  # a stop token is not rendered
                text = req.decoder.push(out.token)
        if out.finish_reason is not None:
            text += req.decoder.flush()
        try:
            text, stopped = req.matcher.feed(text, req.completion_tokens > req.min_tokens)
        except TimeoutError:  # a stop_regex that backtracks: end the request, not the worker
            req.stopped = True
            return [ReplyChunk(out.uid, error=req.matcher.too_slow(), error_status=400,
                               prompt_tokens=out.prompt_tokens,
                               completion_tokens=req.completion_tokens,
                               error_param="stop_regex")], out.finish_reason is None
        reason = out.finish_reason
        stop: Union[None, int, str] = req.matcher.matched
        if stopped:
            req.stopped, reason = True, FinishReason.STOP.value
        elif reason is not None:
            text += req.matcher.flush()
            if reason == FinishReason.STOP.value and out.token >= 0:
                stop = out.token  # an EOS or stop token id ended it
        chunk = ReplyChunk(out.uid, text, ids, reason, out.prompt_tokens, req.completion_tokens,
                           req.cached_tokens, logprobs=logprobs, matched_stop=stop,
                           embedding=out.embedding, times=out.times, tensor=out.tensor)
        if req.prompt_ids is not None:
            chunk = self._with_prompt(chunk, req, out)
        return req.paced(chunk), stopped and out.finish_reason is None

    def _with_prompt(self, chunk: ReplyChunk, req: _Request, out: TokenOut) -> ReplyChunk:
        """`chunk` with the prompt (the request's first chunk only): its text when echoed, and
        its tokens' log-probabilities where rank 0 sent them (null for the first token)."""
        ids, req.prompt_ids = req.prompt_ids or [], None
        # The prompt's tokens decoded, special tokens included (its logprobs list them, and
        # their text_offsets index this text; a BOS the tokenizer added shows too, unlike vLLM,
        # whose offsets then miss the text), without clean-up of spaces.
        text = None if not req.echo else ("" if self.tokenizer is None else
                                          self.tokenizer.decode(ids, skip_special_tokens=False,
                                                                clean_up_tokenization_spaces=False))
        entries: List[TokenLogprobText] = []
        if out.prompt_logprobs is not None and ids:
            first, raw = self._token_text(ids[0], req.tokens_as_ids)
            entries.append(TokenLogprobText(first, None, token_bytes=raw, token_id=ids[0]))
            entries += [self._logprob_text(t, lp, req.tokens_as_ids, req.asked_ids)
                        for t, lp in zip(ids[1:], out.prompt_logprobs)]
        return dataclasses.replace(chunk, prompt_text=text, prompt_logprobs=entries,
                                   prompt_ids=ids if req.return_prompt_ids else None)

    def _logprob_text(self, token: int, lp: TokenLogprobs, as_ids: bool = False,
                      asked_ids: Tuple[int, ...] = ()) -> TokenLogprobText:
        text, raw = self._token_text(token, as_ids)
        tops = [self._token_text(t, as_ids) for t in lp.top_ids]
        asked = tuple(self._token_text(t, as_ids)[0] for t in asked_ids[:len(lp.ids_logprobs)])
        return TokenLogprobText(text, lp.logprob, tuple(t for t, _ in tops), lp.top_logprobs,
                                raw, tuple(b for _, b in tops), token, lp.top_ids, lp.rank,
                                lp.ids_logprobs, asked)

    def _token_text(self, token: int, as_id: bool = False) -> Tuple[str, Optional[bytes]]:
        """One token decoded on its own, special tokens included, and its bytes where the text
        is not them (cached); with `as_id` (or without a tokenizer), "token_id:N"."""
        if as_id:
            return f"token_id:{token}", None
        entry = self.token_texts.get(token)
        if entry is None:
            if self.tokenizer is None:
                entry = (f"token_id:{token}", None)
            else:
                text = self.tokenizer.decode([token], skip_special_tokens=False)
                entry = (text, token_bytes(self.tokenizer, token, text))
            self.token_texts[token] = entry
        return entry


def run_detokenizer(cfg: DetokenizerConfig, conn: Any) -> None:
    """Process entry: load the tokenizer, bind, report ("ready", "detokenizer", {}), loop forever
    (the launcher ends the process)."""
    with report_startup(conn, "detokenizer", logger):
        state = Detokenizer(load_tokenizer(Path(cfg.tokenizer_path)))
        ctx = zmq.Context()
        inbox = PullQueue(ctx, cfg.detokenizer_addr, bind=True)
        to_api = PushQueue(ctx, cfg.api_addr, bind=False)
        to_backends = [PushQueue(ctx, a, bind=False) for a in cfg.backend_addrs]
        to_router = (PushQueue(ctx, cfg.tokenizer_addr, bind=False)
                     if cfg.tokenizer_addr is not None else None)
    freeze_startup_heap(logger, "detokenizer")
    conn.send(("ready", "detokenizer", {}))
    while True:
        msg = inbox.get()
        if isinstance(msg, BatchTokenOut):
            rendered = state.render(list(msg.items))
            stats = msg.stats
            if to_router is not None and stats is not None:
                to_router.put(stats)
        elif isinstance(msg, DetokenizeInit):
            rendered, stats = state.init(msg), None
        else:
            logger.error("ignoring unexpected message %s", type(msg).__name__)
            continue
        for uid in rendered.aborts:
            for to_backend in to_backends:
                to_backend.put(AbortMsg(uid))
        if rendered.chunks or stats is not None:
            to_api.put(ReplyBatch(rendered.chunks, stats))
