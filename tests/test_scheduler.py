"""The scheduler alone, on a fake engine (tests/fake_engine.py: CPU, no model): admission,
chunked prefill, retraction, abort, overlap, deferred frees and page accounting, asserted batch by
batch. The fake's tokens hash the context it reads back through the page table, so a request's
tokens equal `reference` only if every slot the scheduler mapped holds the right token."""

from __future__ import annotations

import logging
import random
import re
from typing import List, Tuple

import pytest

from fake_engine import Harness, Step, fake_logprob, reference
from minisgl.core import Phase
from minisgl.scheduler.cache import PageCounts

P, D = Phase.PREFILL, Phase.DECODE


def _prompt(start: int, n: int) -> List[int]:
    return list(range(start, start + n))


def _decode(*reqs: Tuple[int, int]) -> Step:
    """A decode step of (uid, prefix) pairs."""
    return Step(D, [(uid, prefix, 1, True) for uid, prefix in reqs])


def _at_rest(h: Harness) -> None:
    """Idle, with every resource back: no live request, no row taken, nothing reserved."""
    a = h.accounting()
    assert (a.live_requests, a.free_rows, a.reserved_pages, a.pages.in_use) == \
        (0, a.total_rows, 0, 0)
    assert a.pages.free + a.pages.cached == a.pages.total
    assert not h.engine.pending


# --- admission -------------------------------------------------------------------------------
def test_admission_stops_at_max_running_requests() -> None:
    h = Harness(max_running_requests=2)
    prompts = [_prompt(100 * i + 1, 4) for i in range(3)]
    for uid, prompt in enumerate(prompts):
        h.submit(uid, prompt, max_tokens=3)
    h.step()
    assert [r.uid for r in h.sched.prefill.waiting] == [2]
    assert h.sched.rows.available == 0
    h.run()
    assert h.engine.steps == [
        Step(P, [(0, 0, 4, True), (1, 0, 4, True)]), _decode((0, 4), (1, 4)),
        _decode((0, 5), (1, 5)),
        Step(P, [(2, 0, 4, True)]), _decode((2, 4)), _decode((2, 5))]
    assert h.tokens == {uid: reference(p, 3) for uid, p in enumerate(prompts)}
    _at_rest(h)


def test_admission_reserves_kv_for_the_whole_request_in_arrival_order() -> None:
    """8 pages of 4 tokens: request 0 reserves 4 (8 + 8 tokens), request 1 would need 5 more,
    so it waits; request 2 would fit but does not overtake it."""
    h = Harness(num_pages=8, page_size=4)
    prompts = [_prompt(1, 8), _prompt(1001, 12), _prompt(2001, 4)]
    for uid, (prompt, n) in enumerate(zip(prompts, (8, 8, 4))):
        h.submit(uid, prompt, max_tokens=n)
    h.step()
    a = h.accounting()
    assert (a.reserved_pages, a.pages.free, a.pages.in_use) == (2, 6, 2)  # 4 promised, 2 drawn
    assert [r.uid for r in h.sched.prefill.waiting] == [1, 2]
    h.run()
    assert h.engine.steps[:9] == [Step(P, [(0, 0, 8, True)])] + [
        _decode((0, 8 + i)) for i in range(7)] + [Step(P, [(1, 0, 12, True), (2, 0, 4, True)])]
    assert h.tokens == {uid: reference(p, n) for uid, (p, n) in enumerate(zip(prompts, (8, 8, 4)))}
    _at_rest(h)


def test_priority_policy_admits_the_lowest_priority_value_first() -> None:
    """--scheduling-policy priority (vLLM's): waiting requests are admitted by priority, then
    arrival; a running request is never displaced by a more urgent arrival."""
    h = Harness(max_running_requests=1, scheduling_policy="priority")
    h.submit(0, _prompt(1, 4), max_tokens=2, priority=7)
    h.step()
    for uid, priority in ((1, 5), (2, 1), (3, 1), (4, -1)):
        h.submit(uid, _prompt(100 * uid, 4), max_tokens=2, priority=priority)
    h.step()
    assert [r.uid for r in h.sched.prefill.waiting] == [4, 2, 3, 1]
    h.run()
    admitted = [s.reqs[0][0] for s in h.engine.steps if s.phase is P]
    assert admitted == [0, 4, 2, 3, 1]
    _at_rest(h)


def test_fcfs_refuses_a_priority() -> None:
    """A priority means nothing first come, first served: refused naming the policy, as vLLM
    refuses it, rather than silently ignored."""
    h = Harness()
    h.submit(0, _prompt(1, 4), max_tokens=2, priority=2)
    h.run()
    assert h.outs[-1].error is not None and "--scheduling-policy priority" in h.outs[-1].error
    _at_rest(h)


def test_priority_policy_retracts_the_lowest_priority_first() -> None:
    """Under KV pressure the priority policy retracts the least urgent request (here the
    older one), where first-come-first-served retracts the newest."""
    h = Harness(num_pages=7, page_size=4, decode_reserve_tokens=0, scheduling_policy="priority")
    prompts = [_prompt(1, 8), _prompt(101, 8)]
    for uid, (prompt, priority) in enumerate(zip(prompts, (3, 0))):
        h.submit(uid, prompt, max_tokens=8, priority=priority)
    for _ in range(6):
        h.step()
    assert [r.uid for r in h.sched.prefill.waiting] == [0]
    h.run()
    assert h.tokens == {uid: reference(p, 8) for uid, p in enumerate(prompts)}
    assert h.accounting().retracted_requests == 1
    _at_rest(h)


@pytest.mark.parametrize("prompt_len,max_tokens,num_pages,numbers", [
    (60, 8, 64, ("68", "64")),  # beyond the context length (64)
    (30, 8, 8, ("10", "8")),  # more pages (10) than the pool holds (8)
])
def test_requests_beyond_the_limits_are_rejected(prompt_len: int, max_tokens: int,
                                                 num_pages: int, numbers: Tuple[str, str]) -> None:
    h = Harness(num_pages=num_pages, max_context=64)
    h.submit(7, _prompt(1, prompt_len), max_tokens=max_tokens)
    h.run()
    error = h.finished(7).error
    assert error and all(n in error for n in numbers), error
    assert h.engine.steps == [] and 7 not in h.tokens
    _at_rest(h)


# --- chunked prefill -------------------------------------------------------------------------
def test_long_prompts_are_split_into_chunks_of_max_prefill_tokens() -> None:
    h = Harness(max_prefill_tokens=16)
    prompts = [_prompt(1, 40), _prompt(501, 20)]
    h.submit(0, prompts[0], max_tokens=5)
    h.submit(1, prompts[1], max_tokens=7)
    h.run()
    assert h.engine.steps[:5] == [
        Step(P, [(0, 0, 16, False)]), Step(P, [(0, 16, 16, False)]),
        Step(P, [(0, 32, 8, True), (1, 0, 8, False)]),  # the budget's rest starts request 1
        Step(P, [(1, 8, 12, True)]), _decode((0, 40), (1, 20))]
    assert h.tokens == {0: reference(prompts[0], 5), 1: reference(prompts[1], 7)}
    _at_rest(h)


def test_each_prefill_step_logs_its_launch_and_completion(
        caplog: pytest.LogCaptureFixture) -> None:
    """At debug level a prefill step is two lines: what it launches (before the launch: what a
    first token waited for), then its host launch time and when its results were in, so a
    served log tells a host-bound prefill from a device-bound one."""
    h = Harness(max_prefill_tokens=16)
    h.submit(0, _prompt(1, 20), max_tokens=2)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler.scheduler"):
        h.run()
    lines = [r.getMessage() for r in caplog.records if "prefill of" in r.getMessage()]
    assert len(lines) == 4, lines
    assert lines[0] == ("rank 0: prefill of 16 tokens: requests 0 (16, a chunk); "
                        "0 decoding alongside")
    assert lines[2] == "rank 0: prefill of 4 tokens: requests 0 (4); 0 decoding alongside"
    for done, n in (lines[1], 16), (lines[3], 4):
        m = re.fullmatch(rf"rank 0: prefill of {n} tokens done ([0-9.]+) ms after its launch "
                         r"began \(the host launched it in ([0-9.]+) ms\)", done)
        assert m is not None and 0 <= float(m[2]) <= float(m[1]), done


def test_prompt_logprobs_are_gathered_over_the_chunks() -> None:
    h = Harness(max_prefill_tokens=16)
    prompt = _prompt(3, 40)
    h.submit(0, prompt, max_tokens=1)  # caches the prompt's pages...
    h.run()
    h.submit(1, prompt, max_tokens=2, prompt_logprobs=0)  # ...which this one must not use
    h.run()
    first = [o for o in h.outs if o.uid == 1 and o.token >= 0]
    assert first[0].prompt_logprobs == [fake_logprob(t) for t in prompt[1:]]
    assert first[0].cached_tokens == 0 and first[1].prompt_logprobs is None
    assert [s.reqs for s in h.engine.steps[-4:-1]] == [
        [(1, 0, 16, False)], [(1, 16, 16, False)], [(1, 32, 8, True)]]
    _at_rest(h)


# --- retraction ------------------------------------------------------------------------------
@pytest.mark.parametrize("cache,readmitted", [("radix", (1, 12, 1, True)),
                                              ("naive", (1, 0, 13, True))])
def test_kv_pressure_retracts_the_newest_request(cache: str,
                                                readmitted: Tuple[int, int, int, bool]) -> None:
    """7 pages of 4: two 8-token prompts reserve no outputs (decode_reserve_tokens=0); when both
    need a fourth page, the newer one is retracted and re-queued first, and comes back once the
    older finishes (radix: on its cached pages, recomputing one token)."""
    h = Harness(num_pages=7, page_size=4, cache=cache, decode_reserve_tokens=0)
    prompts = [_prompt(1, 8), _prompt(101, 8)]
    for uid, prompt in enumerate(prompts):
        h.submit(uid, prompt, max_tokens=8)
    for _ in range(6):
        h.step()
    assert [r.uid for r in h.sched.prefill.waiting] == [1]
    retracted = h.sched.reqs[1]
    assert (retracted.cached_len, retracted.device_len, retracted.table_row) == (0, 13, -1)
    assert h.accounting().retracted_requests == 1
    h.run()
    assert h.engine.steps == [
        Step(P, [(0, 0, 8, True), (1, 0, 8, True)])] + [
        _decode((0, 8 + i), (1, 8 + i)) for i in range(4)] + [
        _decode((0, 12)), _decode((0, 13)), _decode((0, 14)),
        Step(P, [readmitted]), _decode((1, 13)), _decode((1, 14))]
    assert h.tokens == {uid: reference(p, 8) for uid, p in enumerate(prompts)}
    assert h.accounting().retracted_requests == 1
    _at_rest(h)


@pytest.mark.parametrize("cache,overlap,mixed", [("radix", False, False), ("radix", True, False),
                                                 ("naive", True, False), ("radix", True, True)])
def test_retraction_under_pressure_keeps_every_token(cache: str, overlap: bool,
                                                     mixed: bool) -> None:
    rng = random.Random(5)
    system = _prompt(7, 12)
    prompts = [system + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 12))]
               for _ in range(16)]
    h = Harness(num_pages=40, page_size=4, max_running_requests=12, cache=cache,
                overlap=overlap, mixed=mixed, decode_reserve_tokens=4)
    for uid, prompt in enumerate(prompts):
        h.submit(uid, prompt, max_tokens=30)
    h.run()
    assert h.tokens == {uid: reference(p, 30) for uid, p in enumerate(prompts)}
    assert h.accounting().retracted_requests > 0
    _at_rest(h)


# --- mixed steps -----------------------------------------------------------------------------
def _prefill_part(step: Step) -> List[Tuple[int, int, int, bool]]:
    return step.reqs[:len(step.reqs) - step.num_decode] if step.phase is P else []


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_decode_alongside_a_chunked_prompt(overlap: bool) -> None:
    """Requests already decoding advance in every step of a later prompt's prefill: each
    chunk takes the budget less their rows, and every token is the reference's."""
    h = Harness(mixed=True, overlap=overlap, max_prefill_tokens=16)
    early = [_prompt(3, 5), _prompt(40, 6)]
    for uid, prompt in enumerate(early):
        h.submit(uid, prompt, max_tokens=20)
    for _ in range(4):
        h.step()
    late = _prompt(90, 40)
    h.submit(2, late, max_tokens=3)
    h.run()
    assert h.tokens == {0: reference(early[0], 20), 1: reference(early[1], 20),
                        2: reference(late, 3)}
    chunks = [s for s in h.engine.steps if any(r[0] == 2 for r in _prefill_part(s))]
    assert [[r[2] for r in _prefill_part(s)] for s in chunks] == [[14], [14], [12]]
    assert all(s.phase is P and s.num_decode == 2 for s in chunks)
    assert all(r[2] == 1 and r[3] for s in chunks for r in s.reqs[-2:])
    _at_rest(h)


def test_too_many_decoding_requests_get_a_step_of_their_own() -> None:
    """Decode rows ride along a prefill only while they take at most half its budget."""
    h = Harness(mixed=True, max_prefill_tokens=4, max_running_requests=4)
    early = [_prompt(3 + 10 * i, 3) for i in range(3)]
    for uid, prompt in enumerate(early):
        h.submit(uid, prompt, max_tokens=12)
    for _ in range(3):
        h.step()
    h.submit(3, _prompt(90, 8), max_tokens=2)
    h.run()
    assert h.tokens == {**{uid: reference(p, 12) for uid, p in enumerate(early)},
                        3: reference(_prompt(90, 8), 2)}
    assert all(s.num_decode * 2 <= 4 for s in h.engine.steps)
    late = [s for s in h.engine.steps if any(r[0] == 3 for r in _prefill_part(s))]
    assert len(late) == 2 and all(s.num_decode == 0 for s in late)  # three decode meanwhile
    _at_rest(h)


def test_steps_mix_only_where_the_engine_says_they_run_well() -> None:
    """StepEngine.mixes decides (on a GPU: whether a prefill graph replays the step): with the
    engine accepting one prompt and at most two decode rows, three running requests get a
    decode step of their own beside every chunk, two ride along; tokens unchanged."""
    h = Harness(mixed=True, mix_limit=2, max_prefill_tokens=64, max_running_requests=4)
    early = [_prompt(3 + 10 * i, 3) for i in range(3)]
    for uid, prompt in enumerate(early):
        h.submit(uid, prompt, max_tokens=12 + 20 * (uid == 0))
    for _ in range(3):
        h.step()
    h.submit(3, _prompt(90, 8), max_tokens=4)
    for _ in range(12):
        h.step()
    h.submit(4, _prompt(50, 8), max_tokens=4)
    h.run()
    assert h.tokens == {**{uid: reference(p, 12 + 20 * (uid == 0))
                           for uid, p in enumerate(early)},
                        3: reference(_prompt(90, 8), 4), 4: reference(_prompt(50, 8), 4)}
    assert all(s.num_decode <= 2 for s in h.engine.steps)
    first = [s for s in h.engine.steps if any(r[0] == 3 for r in _prefill_part(s))]
    second = [s for s in h.engine.steps if any(r[0] == 4 for r in _prefill_part(s))]
    assert [s.num_decode for s in first] == [0]  # three running: apart
    assert [s.num_decode for s in second] == [1]  # uid 0 alone still running: mixed
    _at_rest(h)


# --- abort -----------------------------------------------------------------------------------
def test_abort_of_a_waiting_request_frees_nothing_it_never_took() -> None:
    h = Harness(max_running_requests=1)
    h.submit(0, _prompt(1, 4), max_tokens=4)
    h.submit(1, _prompt(51, 4), max_tokens=4)
    h.step()
    h.abort(1)
    h.run()
    assert h.finished(1).finish_reason == "abort" and 1 not in h.tokens
    assert all(uid == 0 for s in h.engine.steps for uid, *_ in s.reqs)
    assert h.tokens == {0: reference(_prompt(1, 4), 4)}
    _at_rest(h)


def test_abort_while_prefilling_frees_the_chunks() -> None:
    h = Harness(max_prefill_tokens=8)
    h.submit(0, _prompt(1, 30), max_tokens=4)
    h.step()
    h.abort(0)
    h.run()
    assert h.engine.steps == [Step(P, [(0, 0, 8, False)])]
    assert h.finished(0).finish_reason == "abort"
    assert h.accounting().pages == PageCounts(62, 0, 2, 64)  # the chunk's 2 pages stay cached
    _at_rest(h)


def test_abort_while_decoding_stops_its_tokens_only() -> None:
    h = Harness()
    prompts = [_prompt(1, 6), _prompt(201, 6)]
    for uid, prompt in enumerate(prompts):
        h.submit(uid, prompt, max_tokens=10)
    for _ in range(3):  # prefill and two decode steps: 3 tokens each
        h.step()
    h.abort(0)
    h.abort(99)  # unknown (or already finished): ignored
    h.run()
    assert h.tokens == {0: reference(prompts[0], 3), 1: reference(prompts[1], 10)}
    assert h.finished(0).finish_reason == "abort" and all(o.uid != 99 for o in h.outs)
    assert [s.reqs for s in h.engine.steps[3:5]] == [[(1, 8, 1, True)], [(1, 9, 1, True)]]
    _at_rest(h)


def test_abort_of_a_request_in_flight_frees_it_after_the_batch() -> None:
    """With overlap, request 0 is aborted while a decode batch holding it runs: that batch's token
    for it is dropped, and its row is free only once the batch completes, so request 2, arriving
    with the abort, is admitted a step later into row 0."""
    h = Harness(overlap=True, max_running_requests=2)
    prompts = [_prompt(1, 4), _prompt(101, 4), _prompt(201, 4)]
    h.submit(0, prompts[0], max_tokens=10)
    h.submit(1, prompts[1], max_tokens=10)
    for _ in range(3):  # prefill, decode 1 launched; decode 2 launched, decode 1 collected
        h.step()
    aborted = h.sched.reqs[0]
    h.abort(0)
    h.submit(2, prompts[2], max_tokens=3)
    h.step()  # abort; decode 3 (request 1 alone) launched; decode 2 collected; 0 freed
    assert aborted.table_row == -1 and [r.uid for r in h.sched.prefill.waiting] == [2]
    h.step()
    assert h.engine.steps[3:5] == [_decode((1, 6)), Step(P, [(2, 0, 4, True)])]
    assert h.sched.reqs[2].table_row == 0
    h.run()
    assert h.tokens[0] == reference(prompts[0], 2)  # decode 2's token was dropped
    assert h.tokens[1] == reference(prompts[1], 10) and h.tokens[2] == reference(prompts[2], 3)
    assert h.finished(0).finish_reason == "abort"
    _at_rest(h)


# --- overlap and deferred frees ----------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_keeps_one_batch_in_flight_and_drops_the_extra_token(overlap: bool) -> None:
    """Request 0 finishes with its 2nd token, a stop token (which no rule can foresee). With
    overlap the scheduler decides one step behind: 0 sits in the next decode batch too, that
    token is dropped, and its row and pages stay taken until that batch completes."""
    h = Harness(overlap=overlap)
    prompts = [_prompt(1, 4), _prompt(5, 4)]
    h.submit(0, prompts[0], max_tokens=9, stop_token_ids=(reference(prompts[0], 2)[1],))
    h.submit(1, prompts[1], max_tokens=5)
    h.step()
    finishing = h.sched.reqs[0]
    while not any(o.uid == 0 and o.finish_reason for o in h.outs):
        h.step()
        assert len(h.engine.pending) == (1 if overlap else 0)
    assert 0 not in h.sched.reqs
    held = 2 if overlap else 1  # rows still taken: the finished request's waits for its batch
    assert h.sched.rows.available == 4 - held
    assert h.accounting().pages.in_use == 2 * held
    assert finishing.table_row == (0 if overlap else -1)
    h.step()
    assert finishing.table_row == -1 and h.sched.rows.available == 3
    h.run()
    extra = [_decode((0, 5), (1, 5))] if overlap else [_decode((1, 5))]
    assert h.engine.steps == [Step(P, [(0, 0, 4, True), (1, 0, 4, True)]),
                              _decode((0, 4), (1, 4))] + extra + [
        _decode((1, 6)), _decode((1, 7))]  # 1 ends by length: no step after its last
    assert h.tokens == {0: reference(prompts[0], 2), 1: reference(prompts[1], 5)}
    assert h.engine.most_pending == (2 if overlap else 1)
    _at_rest(h)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_request_whose_tokens_are_all_launched_joins_no_more_batches(overlap: bool,
                                                                        max_tokens: int) -> None:
    """A request that will end by length once its in-flight token lands is left out of the next
    decode batch even with overlap: with max_tokens=1 the prefill's token is the answer, and a
    decode step launched first would only delay it."""
    h = Harness(overlap=overlap)
    prompt = _prompt(1, 4)
    h.submit(0, prompt, max_tokens=max_tokens)
    h.run()
    decodes = [_decode((0, 4 + i)) for i in range(max_tokens - 1)]
    assert h.engine.steps == [Step(P, [(0, 0, 4, True)])] + decodes
    assert h.tokens == {0: reference(prompt, max_tokens)}
    _at_rest(h)


# --- accounting ------------------------------------------------------------------------------
def test_an_accounting_message_is_answered_at_rest() -> None:
    """AccountingMsg (the offline API's check at tp > 1, reaching every rank at one step) taken
    while requests run, with a batch in flight: no reply until the scheduler rests (check_idle),
    then one per message, with the at-rest numbers."""
    from minisgl.message.types import AccountingMsg
    from minisgl.scheduler.scheduler import Accounting
    h = Harness(overlap=True)
    h.submit(0, _prompt(1, 5), max_tokens=4)
    h.step()
    h.io.inbox.append(AccountingMsg(7))
    h.step()  # taken mid-work
    assert h.sched.has_work and not h.io.posted
    h.io.inbox.append(AccountingMsg(8))
    h.run()  # its last step finds no work left: the idle check answers both
    assert [r.seq for r in h.io.posted] == [7, 8]
    assert {Accounting.of_reply(r) for r in h.io.posted} == {h.accounting()}
    _at_rest(h)


def test_a_leaked_page_fails_the_idle_check() -> None:
    h = Harness(cache="naive")
    h.submit(0, _prompt(1, 5), max_tokens=3)
    h.run()
    _at_rest(h)
    h.sched.cache.allocate(1)  # a page taken and never given to a request
    with pytest.raises(RuntimeError, match=r"free 63 \+ in use 0 \+ cached 0 != total 64"):
        h.sched.check_idle()
