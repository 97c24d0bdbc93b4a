"""Admission, deadlines and the tokenizer's bounds, without processes: the queued-request and
queued-token counts, the client's timeout header, the prompt-character bound (refused without
tokenizing), long prompts on threads, and the loopback names of the Host check."""

from __future__ import annotations

import math
import select
import threading
import time
from typing import Any, Dict, List

import pytest

from minisgl.core import Limits, SamplingParams, StructuredOutput
from minisgl.message.types import SchedulerStats, TextRequest, TokenizeRequest
from minisgl.server.admission import Deadline, Queued
from minisgl.server.auth import bearer, key_matches
from minisgl.server.hosts import host_name, is_loopback
from minisgl.server.protocol import ApiError
from minisgl.tokenizer.queued import QueuedTokens
from minisgl.tokenizer.slow_requests import LONG_PROMPT_CHARS, SlowRequests
from minisgl.tokenizer.tokenize_worker import Tokenizer, is_slow


def test_queued_requests_limit_counts_choices_until_their_first_chunk() -> None:
    q = Queued(3)
    q.admit([1, 2])
    with pytest.raises(ApiError) as e:
        q.admit([3, 4])  # a request is let in whole or not at all
    assert e.value.status == 429 and e.value.kind == "rate_limit_error"
    assert e.value.headers == {"Retry-After": "1"}
    q.admit([3])
    q.started(1)
    q.started(1)  # idempotent
    q.admit([4])
    assert q.uids == {2, 3, 4}
    Queued(None).admit(range(10_000))


def test_a_request_larger_than_the_queue_limit_is_a_400_not_a_retry() -> None:
    """More choices than the limit could never be admitted: a 400 naming n, not a 429 that
    tells the client to retry forever (even into an empty queue)."""
    with pytest.raises(ApiError) as e:
        Queued(2).admit([1, 2, 3])
    assert e.value.status == 400 and e.value.param == "n" and not e.value.headers
    assert "3 completions" in e.value.message and "2" in e.value.message


def test_deadline_from_the_server_timeout_and_the_client_header() -> None:
    now = 100.0
    assert Deadline.of({}, None, stream=False, now=now) == Deadline()
    assert Deadline.of({}, 5.0, stream=True, now=now) == Deadline(105.0, 105.0)
    header = {"x-stainless-read-timeout": "2.5"}
    assert Deadline.of(header, None, stream=False, now=now) == Deadline(102.5, 102.5)
    assert Deadline.of(header, 1.0, stream=False, now=now) == Deadline(101.0, 101.0)
    # a stream: the client's read timeout bounds the wait for the first event only
    assert Deadline.of(header, None, stream=True, now=now) == Deadline(102.5, math.inf)
    for bad in ("0", "-1", "nan", "inf", "soon"):
        assert Deadline.of({"x-stainless-read-timeout": bad}, None, False, now) == Deadline()
    assert Deadline().timeout(True) is None
    assert Deadline(0.0, 0.0).timeout(False) == 0.0 and Deadline().error().status == 408


def _stats(seq: int, received: int, waiting_tokens: int, replica: int = 0) -> SchedulerStats:
    return SchedulerStats(waiting_tokens=waiting_tokens, requests_received_total=received,
                          seq=seq, replica=replica)


def test_queued_tokens_counts_each_request_once_whatever_the_delays() -> None:
    q = QueuedTokens(2, limit=100)
    assert q.admits(0, 10_000)  # an empty queue takes any request
    q.sent(0, 60)
    q.sent(0, 30)
    assert q.queued(0) == 90 and q.admits(0, 10) and not q.admits(0, 11)
    q.update(_stats(seq=5, received=1, waiting_tokens=0))  # the first admitted at once
    assert q.queued(0) == 30
    q.update(_stats(seq=4, received=0, waiting_tokens=999))  # older stats: ignored
    assert q.queued(0) == 30
    q.update(_stats(seq=6, received=2, waiting_tokens=30))  # the second waits in the queue
    assert q.queued(0) == 30 and q.queued(1) == 0
    q.update(_stats(seq=7, received=2, waiting_tokens=0))
    assert q.queued(0) == 0
    unlimited = QueuedTokens(1, None)
    unlimited.sent(0, 10 ** 9)
    assert unlimited.admits(0, 10 ** 9)


class _Vocab:
    """A tokenizer whose longest vocabulary entry is 5 characters and which must not be asked
    to encode."""

    def __init__(self) -> None:
        self.encoded: List[str] = []

    def __len__(self) -> int:
        return 3

    def get_vocab(self) -> Dict[str, int]:
        return {"a": 0, "hello": 1, "<s>": 2}

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        self.encoded.append(text)
        return [0] * len(text)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> List[int]:
        self.encoded.append(str(messages))
        return [0] * 4


def test_prompt_longer_than_the_context_can_hold_is_refused_without_tokenizing() -> None:
    vocab = _Vocab()
    t = Tokenizer(vocab, Limits(10, 3, 100, 16, 64))
    assert t.max_prompt_chars == 10 * 5
    p = SamplingParams(max_tokens=1)
    refused = t.prepare(TokenizeRequest(1, p, text="a" * 51))
    assert refused.params is None and refused.error_param == "prompt"
    assert "51 characters" in refused.error and "10 tokens" in refused.error
    chat = t.prepare(TokenizeRequest(2, p, messages=[{"role": "user", "content": "b" * 30},
                                                     {"role": "user", "content": "c" * 21}]))
    assert chat.params is None and "51 characters" in chat.error
    assert t.answer(TextRequest(3, text="a" * 51)).error_param == "prompt"
    assert vocab.encoded == []  # none of them was tokenized
    assert t.prepare(TokenizeRequest(4, p, text="a" * 9)).params is not None
    assert vocab.encoded == ["a" * 9]


def test_long_prompts_and_constraints_are_the_slow_requests() -> None:
    """The loop hands these to its threads: a long prompt (tokenizing it) and any constrained
    request (compiling its grammar: xgrammar's set-up on the first, seconds)."""
    plain = SamplingParams(max_tokens=4)
    json_params = SamplingParams(max_tokens=4, structured=StructuredOutput("json_object"))
    assert not is_slow(TokenizeRequest(1, plain, text="short"))
    assert is_slow(TokenizeRequest(2, json_params, text="short"))
    assert is_slow(TokenizeRequest(3, json_params, input_ids=[1, 2]))
    assert is_slow(TokenizeRequest(4, plain, text="a" * (LONG_PROMPT_CHARS + 1)))
    assert is_slow(TextRequest(5, text="a" * (LONG_PROMPT_CHARS + 1)))
    assert not is_slow(TextRequest(6, text="short"))


def test_slow_requests_run_beside_the_loop_and_aborted_ones_are_dropped() -> None:
    pool = SlowRequests(2)
    gate = threading.Event()

    class Msg:
        def __init__(self, uid: int) -> None:
            self.uid = uid

    def slow(msg: Msg) -> str:
        gate.wait(10)
        return f"done {msg.uid}"

    def boom(msg: Msg) -> str:
        raise ValueError("bad template")

    try:
        pool.submit(Msg(1), slow)
        pool.submit(Msg(2), slow)
        pool.cancel(2)
        assert pool.finished() == [] and pool.running == {1, 2}
        gate.set()
        got: List[Any] = []
        deadline = time.monotonic() + 10
        while len(got) < 1 and time.monotonic() < deadline:
            select.select([pool.fileno()], [], [], 1.0)  # the loop's poller wakes
            got += pool.finished()
        while pool.running and time.monotonic() < deadline:
            time.sleep(0.01)
            got += pool.finished()
        assert [(m.uid, r) for m, r in got] == [(1, "done 1")] and not pool.running
        pool.submit(Msg(3), boom)
        done: List[Any] = []
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            # a wake-up left from the first two may return the select before boom has run
            select.select([pool.fileno()], [], [], 1.0)
            done = pool.finished()
        (msg, result), = done
        assert msg.uid == 3 and isinstance(result, ValueError)
    finally:
        pool.close()


@pytest.mark.parametrize("host,loopback", [
    ("localhost:8000", True), ("LOCALHOST", True), ("app.localhost", True), ("127.0.0.1", True),
    ("127.1.2.3:80", True), ("[::1]:8000", True), ("::1", True), ("evil.example", False),
    ("127.0.0.1.evil.example", False), ("0.0.0.0:8000", False), ("10.0.0.1", False),
    ("[2001:db8::1]:80", False), ("", False)])
def test_loopback_host_names(host: str, loopback: bool) -> None:
    assert is_loopback(host_name(host)) is loopback


def test_bearer_tokens_and_key_comparison() -> None:
    assert bearer("Bearer sk-1") == "sk-1" and bearer("bearer  sk-1 ") == "sk-1"
    assert bearer("Basic abc") is None and bearer("Bearer ") is None and bearer(None) is None
    assert key_matches("sk-1", "sk-1") and not key_matches("sk-2", "sk-1")
    assert not key_matches(None, "sk-1") and not key_matches("", "sk-1")


def test_stream_past_its_deadline_ends_with_an_error_event() -> None:
    """`--request-timeout` mid-stream: an error event (408's body), then [DONE]."""
    import asyncio

    from minisgl.message.types import ReplyChunk
    from minisgl.server.api import _events
    from minisgl.server.protocol import ChatRequest, chat_job
    from minisgl.server.responses import ChatFormatter, Choice
    from minisgl.server.streams import RequestStream

    stream_reason: List[str] = []

    async def run() -> List[str]:
        job = chat_job(ChatRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "stream": True}), 1)
        stream = RequestStream([7])
        first = [ReplyChunk(7, "Hel", [1], prompt_tokens=3, completion_tokens=1)]
        deadline = Deadline(first=math.inf, last=time.monotonic() + 0.2)
        t0 = time.monotonic()
        lines = [line async for line in _events(stream, ChatFormatter("m", job), [Choice()],
                                                 first, deadline)]
        assert 0.15 < time.monotonic() - t0 < 5
        stream_reason.append(stream.abort_reason)
        return lines

    lines = asyncio.run(run())
    assert stream_reason == ["timeout"]  # how the release counts it in /metrics
    assert lines[-1] == "data: [DONE]\n\n"
    assert '"request_timeout"' in lines[-2] and "Hel" in "".join(lines[:-2])


def test_a_full_tokenizer_queue_is_a_429(tmp_path: Any) -> None:
    """The API server's socket to the tokenizer holds a bounded number of messages: past it a
    request is told to retry (429), not failed with a 5xx. A request refused so, or while the
    server drains (503), counts in /metrics once per choice by that answer (rejected, error),
    not as aborted, and no abort is sent for a choice that never went out (before: each
    counted "abort", with an abort sent, or logged as unsendable, for every choice)."""
    import zmq

    from minisgl.message.codec import decode
    from minisgl.message.types import AbortRequest
    from minisgl.server.metrics import Metrics
    from minisgl.server.protocol import CompletionRequest, completion_job
    from minisgl.server.streams import RequestStreams

    streams = RequestStreams(f"ipc://{tmp_path}/nobody", f"ipc://{tmp_path}/api", Metrics())
    job = completion_job(CompletionRequest.model_validate({"prompt": "hi", "n": 2}), 2)
    ctx = zmq.Context()
    tokenizer = ctx.socket(zmq.PULL)
    try:
        with pytest.raises(ApiError) as e:
            for _ in range(100_000):  # nobody reads: the socket's high-water mark is reached
                streams.submit(job)
        assert e.value.status == 429 and e.value.kind == "rate_limit_error"
        assert "tokenizer" in e.value.message and e.value.headers["Retry-After"] == "1"
        assert streams.metrics.finished == {"rejected": 2}

        tokenizer.bind(f"ipc://{tmp_path}/nobody")  # the tokenizer comes: the queue empties
        while tokenizer.poll(1000):
            tokenizer.recv()
        streams.draining = True
        with pytest.raises(ApiError) as e:
            streams.submit(job)
        assert e.value.status == 503
        assert streams.metrics.finished == {"rejected": 2, "error": 2}
        sent = []
        while tokenizer.poll(200):
            sent.append(decode(tokenizer.recv()))
        assert not any(isinstance(m, AbortRequest) for m in sent), sent
    finally:
        streams.close()
        tokenizer.close(linger=0)
        ctx.term()


def test_an_abort_the_full_tokenizer_queue_refuses_goes_out_later(tmp_path: Any) -> None:
    """A client that leaves while the API server's socket to the tokenizer is full: the abort
    waits and goes out as soon as the socket takes messages, before the next request (before:
    it was dropped with an error line, and the request ran on to its end, holding its KV
    pages)."""
    import zmq

    from minisgl.message.codec import decode
    from minisgl.message.types import AbortRequest
    from minisgl.server.metrics import Metrics
    from minisgl.server.protocol import CompletionRequest, completion_job
    from minisgl.server.streams import RequestStreams

    streams = RequestStreams(f"ipc://{tmp_path}/tok", f"ipc://{tmp_path}/api", Metrics())
    job = completion_job(CompletionRequest.model_validate({"prompt": "hi"}), 1)
    ctx = zmq.Context()
    tokenizer = ctx.socket(zmq.PULL)
    try:
        left = streams.submit(job)
        with pytest.raises(ApiError):
            for _ in range(100_000):  # nobody reads: the socket's high-water mark is reached
                streams.submit(job)
        streams.release(left)  # the client goes away: the socket takes no abort now
        tokenizer.bind(f"ipc://{tmp_path}/tok")  # the tokenizer catches up
        got = []
        while tokenizer.poll(1000):
            got.append(decode(tokenizer.recv()))
        assert got and not any(isinstance(m, AbortRequest) for m in got)
        after = streams.submit(job)
        got = []
        while tokenizer.poll(200):
            got.append(decode(tokenizer.recv()))
        assert [(type(m).__name__, m.uid) for m in got] == [
            ("AbortRequest", left.uids[0]), ("TokenizeRequest", after.uids[0])]
    finally:
        streams.close()
        tokenizer.close(linger=0)
        ctx.term()


def test_scheduler_posts_its_state_before_a_prefill_and_after_each_step() -> None:
    """What rank 0's stats timer sends: before a prefill's forward its request is counted
    (waiting, pages held) although no reply carries that; the numbers only grow (`seq`), and
    rank 0 counts the requests it took (the tokenizer's queued tokens)."""
    from fake_engine import Harness

    h = Harness()
    posted: List[SchedulerStats] = []
    h.sched.on_stats = posted.append
    h.submit(1, list(range(1, 9)), max_tokens=2)
    h.step()
    before = posted[0]
    assert (before.waiting, before.waiting_tokens, before.requests_received_total) == (1, 0, 1)
    assert before.kv_pages_used == 2 and before.kv_pages_total == 64
    h.run()
    assert [s.seq for s in posted] == sorted({s.seq for s in posted})
    assert posted[-1].kv_pages_used == 0 and posted[-1].running == 0
    assert sum(1 for s in posted if s.waiting) == 1  # decode steps post no stats before launch
