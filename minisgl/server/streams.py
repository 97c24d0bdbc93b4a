"""The API server's request streams: requests out to the tokenizer, replies routed back per uid.

`RequestStreams.submit(job)` gives every choice of the job a fresh uid, sends one
`TokenizeRequest` per choice to the tokenizer and returns a `RequestStream` on which the replies
arrive, in order, per uid. The caller owns the stream and must `release` it when done (in a
`finally`): release sends an `AbortRequest` for every uid that has not finished (client gone,
error in a sibling choice), which frees the request's KV pages in the scheduler. Sends are
synchronous and never await, so release is safe inside cancelled tasks. An abort the
tokenizer's full socket does not take waits, in order, and goes out before anything else is
sent and whenever a reply comes (a request left running keeps replying), so none is lost.

`serve_replies` (one task per app) reads `ReplyBatch`es from the detokenizer and tokenizer,
updates the metrics (time to first token, inter-token latency, scheduler stats) and routes chunks.
Requests accepted and not started count against `--max-queued-requests` (admission.py):
past it, or when the tokenizer's socket is full, `submit` refuses with a 429.
A `ServiceDown` from the launcher (a process failed, or a second signal) ends every request in
flight with an error chunk (status 503) and makes every later submit fail with 503. A `Drain`
(SIGTERM) makes every later submit fail with 503 at once and gives the requests in flight its
timeout to finish before the rest get that error chunk. Either way `finished` is set once every
request in flight has its last chunk: the server can then close and exit.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple, Union

import zmq
import zmq.asyncio

from minisgl.message.codec import decode, encode
from minisgl.message.types import (AbortRequest, AdapterMsg, Drain, FlushCacheMsg, GroupMsg,
                                   GroupWeightsMsg, PauseMsg, PhaseTimes, ProfileMsg,
                                   ReplicaChange, ReplyBatch, ReplyChunk, ServiceDown,
                                   SleepMsg, TensorWeightsMsg, TextRequest, TokenizeRequest,
                                   WakeMsg, WeightReadMsg, WeightsMsg)
from minisgl.server.admission import Queued, overloaded
from minisgl.server.metrics import Metrics
from minisgl.server.protocol import ApiError, Job, Prompt
from minisgl.server.tracing import SpanRecord, Traces

logger = logging.getLogger("minisgl.api")
ReplicaChangeMsg = Union[AdapterMsg, WeightsMsg, FlushCacheMsg, SleepMsg, WakeMsg, GroupMsg,
                         GroupWeightsMsg, PauseMsg, TensorWeightsMsg, ProfileMsg, WeightReadMsg]


@dataclass(eq=False)
class RequestStream:
    uids: List[int]
    created: float = field(default_factory=time.perf_counter)
    queue: "asyncio.Queue[ReplyChunk]" = field(default_factory=asyncio.Queue)
    unfinished: Set[int] = field(default_factory=set)
    last_token_at: Dict[int, float] = field(default_factory=dict)
    # uid -> the scheduler's queue and prefill times and when its first token arrived
    phases: Dict[int, Tuple[PhaseTimes, float]] = field(default_factory=dict)
    measured: bool = True  # generation (abortable, in /load), not a text or a change round trip
    # counts in the latency and finish metrics (a measured stream's; a beam search's steps do
    # not: the search counts once, as its request: api.run_beam_search)
    counted: bool = True

    @property
    def in_metrics(self) -> bool:
        return self.measured and self.counted
    request_id: Optional[str] = None  # the client's (SGLang's rid, X-Request-Id): abort_request
    # how `release` counts the uids still running: "timeout" once the request's deadline passed
    abort_reason: str = "abort"
    trace: Optional[SpanRecord] = None  # its span as it goes (tracing.py), where traced
    choices: int = 1  # uids a prompt (its n): a prompt's tokens count once in the trace

    def __post_init__(self) -> None:
        self.unfinished = set(self.uids)
        self.index = {uid: i for i, uid in enumerate(self.uids)}

    async def get(self, timeout: Optional[float] = None) -> Optional[ReplyChunk]:
        """The next chunk of any of the uids; None after `timeout` seconds without one."""
        if not self.queue.empty():  # the common case when many chunks arrive: no timer task
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


class RequestStreams:
    def __init__(self, tokenizer_addr: str, api_addr: str, metrics: Metrics,
                 max_queued: Optional[int] = None, stream_interval: int = 1) -> None:
        """`stream_interval`: a streamed reply's tokens a chunk (after the first), where its
        request sets none (--stream-interval)."""
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.queued = Queued(max_queued)
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(tokenizer_addr)
        self._actx = zmq.asyncio.Context()
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.bind(api_addr)
        self._uids = itertools.count()
        self._streams: Dict[int, RequestStream] = {}
        self._unsent_aborts: Deque[int] = collections.deque()  # uids, oldest first
        self.down: Optional[str] = None  # why the service stopped (ServiceDown), if it did
        self.draining = False  # a Drain came: no new requests
        self.finished = asyncio.Event()  # set once stopped or drained: nothing is in flight
        self.traces: Optional[Traces] = None  # a span per generation request (tracing.py)

    def _send(self, msg: object) -> None:
        if self.down is not None:
            raise ApiError(503, _down_message(self.down), kind="server_error")
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        if not self._flush_aborts():
            raise overloaded("the tokenizer's queue is full")
        try:
            self._push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise overloaded("the tokenizer's queue is full") from None

    def _pace(self, job: Job) -> int:
        """DetokenizeInit.stream_interval for `job`: its own or the server's when streamed;
        0 (the first chunk and the last) when the client waits for the whole reply."""
        if not job.stream:
            return 0
        return job.stream_interval or self.stream_interval

    def submit(self, job: Job, counted: bool = True) -> RequestStream:
        """`job` sent, a uid a choice; `counted`: in the metrics (RequestStream.counted)."""
        stream = RequestStream([next(self._uids) for _ in range(len(job.prompts) * job.n)],
                               request_id=job.request_id, choices=job.n, counted=counted)
        if self.traces is not None:
            stream.trace = self.traces.begin(dict(job.trace_headers), _span_attributes(job))
        try:
            self.queued.admit(stream.uids)
        except ApiError as e:
            if e.status == 429:  # counted as the tokenizer's overload refusals are
                self.metrics.count_finished("rejected", len(stream.uids))
            raise
        for uid in stream.uids:
            self._streams[uid] = stream
        sent = 0
        try:
            for k, uid in enumerate(stream.uids):
                p = job.prompts[k // job.n]
                t = p.template
                self._send(TokenizeRequest(uid, job.choice_params(k % job.n), p.text,
                                           p.messages, p.input_ids, job.stop,
                                           job.skip_special_tokens, job.echo, job.no_stop_trim,
                                           t.add_generation_prompt, t.continue_final_message,
                                           _kwargs_json(t.kwargs), p.tools_json,
                                           p.add_special_tokens, bool(job.tokens_as_ids),
                                           job.return_token_ids, p.text_pair,
                                           p.drop_oldest, job.stop_regex,
                                           self._pace(job)))
                sent += 1
        except BaseException as e:  # a request that cannot be sent must not hold its place
            self._refuse(stream, sent, e.status if isinstance(e, ApiError) else 500)
            raise
        return stream

    @property
    def in_flight(self) -> int:
        """The generation jobs not yet released (each HTTP request's job once)."""
        return len({id(s) for s in self._streams.values() if s.measured})

    def submit_text(self, prompt: Optional[Prompt], return_token_strs: bool = False,
                    skip_special_tokens: bool = False) -> RequestStream:
        """A tokenize / detokenize request (message.TextRequest), or with no prompt the
        tokenizer's description: one final reply, outside the generation metrics."""
        stream = RequestStream([next(self._uids)], measured=False)
        self._streams[stream.uids[0]] = stream
        p = prompt or Prompt()
        try:
            self._send(TextRequest(stream.uids[0], p.text, p.messages, p.input_ids,
                                   p.template.add_generation_prompt,
                                   p.template.continue_final_message,
                                   _kwargs_json(p.template.kwargs), p.tools_json,
                                   return_token_strs, p.add_special_tokens,
                                   info=prompt is None,
                                   skip_special_tokens=skip_special_tokens))
        except ApiError:
            self.release(stream)
            raise
        return stream

    async def apply_change(self, change: Callable[[int], ReplicaChangeMsg],
                           replicas: List[int]) -> List[Optional[str]]:
        """`change(uid)` (a LoRA adapter's, the weights' or the prefix cache's:
        message.ReplicaChange) sent to each of `replicas` (`ask_replicas`); each replica's
        error, or None where it made the change."""
        return [chunk.error for chunk in await self.ask_replicas(change, replicas)]

    async def ask_replicas(self, change: Callable[[int], ReplicaChangeMsg],
                           replicas: List[int]) -> List[ReplyChunk]:
        """`change(uid)` sent to each of `replicas`, a uid each, in that order, outside the
        generation metrics; each replica's final chunk once all came."""
        stream = RequestStream([next(self._uids) for _ in replicas], measured=False)
        for uid in stream.uids:
            self._streams[uid] = stream
        answers: Dict[int, ReplyChunk] = {}
        try:
            for replica, uid in zip(replicas, stream.uids):
                self._send(ReplicaChange(replica, change(uid)))
            while len(answers) < len(replicas):
                chunk = await stream.get()
                if chunk is not None:
                    answers[stream.index[chunk.uid]] = chunk
        finally:
            self.release(stream)
        return [answers[i] for i in range(len(replicas))]

    def abort_all(self, request_id: Optional[str] = None) -> int:
        """Abort every running generation request, or (`request_id`) those of the client's
        request of that id; their clients get finish_reason "abort". How many."""
        uids = sorted({uid for stream in self._streams.values() if stream.measured
                       and (request_id is None or stream.request_id == request_id)
                       for uid in stream.unfinished})
        self._abort(uids)
        return len(uids)

    def release(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished uids (each counted as finished by its
        `abort_reason`) and forget the stream (idempotent)."""
        unfinished = sorted(stream.unfinished if stream.measured else ())  # text: nothing runs
        self._abort(unfinished)
        if unfinished and stream.counted:
            self.metrics.count_finished(stream.abort_reason, len(unfinished))
        self._forget(stream)
        if unfinished and stream.trace is not None and stream.trace.error is None:
            stream.trace.error = stream.abort_reason
        self._end_trace(stream)

    def _end_trace(self, stream: RequestStream) -> None:
        """The stream's span ended, once: at its last final chunk, or as it is released."""
        trace, stream.trace = stream.trace, None
        if trace is not None and self.traces is not None:
            self.traces.end(trace, stream.created)

    def _refuse(self, stream: RequestStream, sent: int, status: int) -> None:
        """`submit` could not send the whole request (its answer: `status`): abort the first
        `sent` uids, which went out, count every uid once as that refusal (`status_reason`:
        not an abort, nothing was served) and forget the stream."""
        self._abort(stream.uids[:sent])
        if stream.in_metrics:
            self.metrics.count_finished(status_reason(status), len(stream.uids))
        self._forget(stream)

    def _abort(self, uids: List[int]) -> None:
        """Tell the tokenizer (and through it the scheduler) to stop `uids`: now, or those its
        full socket does not take as soon as it does (`_flush_aborts`)."""
        waited = bool(self._unsent_aborts)
        self._unsent_aborts.extend(uids)
        if not self._flush_aborts() and not waited:
            logger.warning("the tokenizer's queue is full: %d abort(s) wait to be sent",
                           len(self._unsent_aborts))

    def _flush_aborts(self) -> bool:
        """Send the waiting aborts, oldest first, as far as the socket takes them; True once
        none is left."""
        while self._unsent_aborts:
            try:
                self._push.send(encode(AbortRequest(self._unsent_aborts[0])), zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._unsent_aborts.popleft()
        return True

    def _forget(self, stream: RequestStream) -> None:
        """Drop the stream's uids: later replies for them are dropped, none counts as queued."""
        stream.unfinished.clear()
        for uid in stream.uids:
            self._streams.pop(uid, None)
            self.queued.started(uid)

    async def serve_replies(self) -> None:
        while True:
            msg = decode(await self._pull.recv())
            self._flush_aborts()
            if isinstance(msg, ServiceDown):
                self.fail_all(msg.reason)
                self.finished.set()
                continue
            if isinstance(msg, Drain):
                if not self.draining:
                    self.draining = True
                    asyncio.ensure_future(self.drain(msg.timeout_s))
                continue
            if not isinstance(msg, ReplyBatch):
                logger.error("ignoring unexpected message %s", type(msg).__name__)
                continue
            self.metrics.update(msg.stats)
            now = time.perf_counter()
            for chunk in msg.chunks:
                self._route(chunk, now)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the requests in flight to finish, end the rest with an
        error chunk, then set `finished`."""
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self._streams:
            logger.warning("shutting down: ending %d request(s) still in flight after %g s "
                           "(shutdown_timeout)", len(self._streams), timeout_s)
            self.fail_all(f"it shut down before the request finished (shutdown_timeout "
                          f"{timeout_s:g} s)")
        self.finished.set()

    def fail_all(self, reason: str) -> None:
        """The service is stopping: an error chunk (503) for every uid in flight."""
        self.down = reason
        now = time.perf_counter()
        for uid in sorted(self._streams):
            self._route(ReplyChunk(uid, error=_down_message(reason), error_status=503), now)

    def _route(self, chunk: ReplyChunk, now: float) -> None:
        stream = self._streams.get(chunk.uid)
        if stream is None:
            return  # released already (client gone): drop
        self.queued.started(chunk.uid)
        if chunk.token_ids and stream.in_metrics:
            last = stream.last_token_at.get(chunk.uid)
            if last is None:
                self.metrics.ttft.observe(now - stream.created)
                if chunk.times is not None:
                    stream.phases[chunk.uid] = (chunk.times, now)
            else:
                self.metrics.itl.observe((now - last) / len(chunk.token_ids))
            stream.last_token_at[chunk.uid] = now
        if stream.trace is not None:
            _trace(stream.trace, chunk, now, stream.index[chunk.uid] % stream.choices == 0)
        if chunk.error is not None or chunk.finish_reason is not None:
            stream.unfinished.discard(chunk.uid)
            del self._streams[chunk.uid]
            if not stream.unfinished:
                self._end_trace(stream)
            if stream.in_metrics:
                self.metrics.count_finished(_reason(chunk))
                if chunk.finish_reason in ("stop", "length") and chunk.error is None:
                    self.metrics.observe_completed(now - stream.created, chunk.prompt_tokens,
                                                   chunk.completion_tokens)
                    phases = stream.phases.get(chunk.uid)
                    if phases is not None:
                        self.metrics.observe_phases(phases[0], now - phases[1])
        stream.queue.put_nowait(chunk)

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._actx.term()


def first_replica_error(errors: List[Optional[str]]) -> Optional[str]:
    """The first replica's error of `apply_change`'s answers, naming that replica where there
    are several ("replica 1: ..."); None where every replica made the change."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return None
    r, error = failed[0]
    return f"replica {r}: {error}" if len(errors) > 1 else error


def _reason(chunk: ReplyChunk) -> str:
    """How a request ended, for /metrics: its finish reason, or for an error whether the
    service refused it for load (rejected: 429), for what it asked (invalid: another 4xx), or
    failed it (error)."""
    if chunk.error is None:
        return chunk.finish_reason or ""
    return status_reason(chunk.error_status)


def status_reason(status: int) -> str:
    """How a request answered with error `status` ended, for /metrics: rejected for load (429),
    invalid input (another 4xx) or error."""
    if status == 429:
        return "rejected"
    return "invalid" if 400 <= status < 500 else "error"


def _down_message(reason: str) -> str:
    return f"the service stopped: {reason}"


def _kwargs_json(kwargs: Optional[dict]) -> Optional[str]:
    return None if kwargs is None else json.dumps(kwargs)


def _span_attributes(job: Job) -> Dict[str, Any]:
    """A generation request's span attributes known at its arrival (vLLM's names)."""
    p = job.params
    attributes: Dict[str, Any] = {"gen_ai.request.temperature": p.temperature,
                                  "gen_ai.request.top_p": p.top_p,
                                  "gen_ai.request.top_k": p.top_k, "gen_ai.request.n": job.n}
    if p.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = p.max_tokens
    if job.request_id is not None:
        attributes["gen_ai.request.id"] = job.request_id
    return attributes


def _trace(record: SpanRecord, chunk: ReplyChunk, now: float, counts_prompt: bool) -> None:
    """What a reply chunk adds to its request's span: the first token's time, a finished
    choice's token counts (a prompt's once, by its first choice), an error or abort."""
    if chunk.token_ids and record.first_token is None:
        record.first_token, record.times = now, chunk.times
    if chunk.error is not None or chunk.finish_reason is not None:
        record.prompt_tokens += chunk.prompt_tokens if counts_prompt else 0
        record.completion_tokens += chunk.completion_tokens
        if chunk.error is not None:
            record.error = chunk.error
        elif chunk.finish_reason == "abort" and record.error is None:
            record.error = "abort"
