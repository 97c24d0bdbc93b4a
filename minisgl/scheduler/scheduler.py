"""One rank's scheduler: messages in, batches through the engine, tokens out.

Every rank runs this same loop on the same messages (see io.py), so every decision below must be
a pure function of those messages: no clocks, no unordered iteration, no per-rank readings.
Resources of a request (page-table row, pages, prefix lock) are taken at admission and released
exactly once, by `_retire`, on finish or abort.

Structured output (a request with `params.structured`): the rank compiles its grammar in a
worker thread (grammar/compiler.py); the request waits in `compiling`, holding nothing, while
the others keep decoding. When it is queued for admission must not depend on this rank's timing,
so each step every rank reads which compilations it has finished and the ranks take the
conjunction (`true_on_all_ranks`): a request is queued at the first step at which it has compiled
on every rank, the same step everywhere. Its tokens are masked by its grammar: with a masked
batch the engine runs the forward at launch and samples only when the scheduler hands it the
bitmask (`_sample_masked`), which it fills after processing the previous batch's tokens, so with
overlap the mask for step N+1 is built on the CPU while the device runs step N+1's forward.

Speculative decoding (`--speculative-config`, speculative.py): a decode batch whose requests
find drafts in their own tokens becomes a verify batch (ngram.Drafter); `_verified` keeps each
request's tokens up to its first rejected draft and sets its lengths to what it kept.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from concurrent.futures import Future
from typing import (Any, Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional,
                    Tuple, Union)

import torch
from torch.distributed import ProcessGroup

from minisgl.core import (Batch, FinishReason, Limits, Phase, Req, RequestError, SamplingParams,
                          StepResult, check_request)
from minisgl.distributed import check_same_across_ranks, min_over_ranks, true_on_all_ranks
from minisgl.grammar import GrammarCache, TokenizerSource
from minisgl.grammar.matcher import RequestGrammar, fill_bitmask, fill_verify_bitmask
from minisgl.grammar.reasoning import ThinkGate
from minisgl.utils import offline_prefill_tokens, rows_to_device
from minisgl.kvcache import make_cache_manager
from minisgl.message import AbortMsg, SchedulerStats, ShutdownMsg, TokenOut, UserMsg
from minisgl.message.types import (AccountingMsg, AccountingReply, AdapterMsg, FlushCacheMsg,
                                   GroupMsg, GroupWeightsMsg, PauseMsg, PhaseTimes, ProfileMsg,
                                   SleepMsg, TensorWeightsMsg, WakeMsg, WeightReadMsg, WeightsMsg,
                                   WireTensor)
from minisgl.message.pulse import Pulse
from minisgl.message.tensors import to_wire
from minisgl.scheduler.adapters import AdapterTable
from minisgl.scheduler.cache import PageCache, PageCounts
from minisgl.scheduler.changes import WEIGHTS_ASLEEP, Changes
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.engine_api import StepEngine
from minisgl.scheduler.io import SchedulerIO
from minisgl.scheduler.ngram import Drafter, ModelDrafter
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.weight_read import read_weight
from minisgl.scheduler.profiler import RankProfiler
from minisgl.scheduler.speculative import SpecCounts, kept
from minisgl.scheduler.table import TableRows

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """A launched batch whose results are not processed yet, with its requests' uids: whether a
    request is in it is a set lookup, not a scan of the batch (nothing iterates the set)."""

    launched: Any  # the engine's handle, for StepEngine.collect
    batch: Batch
    uids: FrozenSet[int]
    launch_s: float  # the host's time in StepEngine.launch (all of an eager forward's)


class Accounting(NamedTuple):
    """Where one scheduler's resources are (Scheduler.accounting): the KV pages by place, the
    pages promised to admitted requests, the free page-table rows, the live requests (admitted
    or waiting), and how many pages the prefix cache evicted and how many requests were
    retracted so far. At rest, with no request live, reserved_pages is 0 and every row is free."""

    pages: PageCounts
    reserved_pages: int
    free_rows: int
    total_rows: int
    live_requests: int
    evicted_pages: int
    retracted_requests: int

    def reply(self, seq: int) -> AccountingReply:
        """These numbers as rank 0's answer to AccountingMsg `seq`."""
        p = self.pages
        return AccountingReply(seq, p.free, p.in_use, p.cached, p.total, self.reserved_pages,
                               self.free_rows, self.total_rows, self.live_requests,
                               self.evicted_pages, self.retracted_requests)

    @classmethod
    def of_reply(cls, reply: AccountingReply) -> "Accounting":
        counts = (reply.free_pages, reply.in_use_pages, reply.cached_pages, reply.total_pages)
        return cls(PageCounts(*counts), reply.reserved_pages, reply.free_rows, reply.total_rows,
                   reply.live_requests, reply.evicted_pages, reply.retracted_requests)


def _hidden_out(req: Req, first: bool, rows: Optional[torch.Tensor]) -> Optional[WireTensor]:
    """The hidden states a token of `req` goes out with (params.return_hidden_states): the
    first token, every prompt position's (gathered chunk by chunk: Req.prompt_hidden); a
    later one, the state of the position it was sampled from (a request prefilled again after
    a retraction ran more). None where none were asked or this rank computed none."""
    if not req.params.return_hidden_states or rows is None:
        return None
    if first:
        whole, req.prompt_hidden = torch.cat(req.prompt_hidden), []
        return to_wire(whole)
    return to_wire(rows[-1:])


def _phase_times(req: Req) -> PhaseTimes:
    """A request's queue and prefill times, as its first token is processed (rank 0's clock)."""
    scheduled = req.scheduled_s or req.arrived_s
    return PhaseTimes(scheduled - req.arrived_s, time.perf_counter() - scheduled)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, engine: StepEngine, io: SchedulerIO,
                 cpu_group: Optional[ProcessGroup] = None,
                 on_stats: Optional[Callable[[SchedulerStats], None]] = None) -> None:
        """`on_stats` (rank 0 of a service: its StatsTimer) gets the stats before each prefill
        launch (a long forward) and after each completed step; it must not affect scheduling."""
        self.cfg = cfg
        self.cpu_group = cpu_group
        self.engine = engine
        self.io = io
        self.rank = cfg.engine.tp_info.rank
        page_size = cfg.engine.page_size
        manager = make_cache_manager(cfg.cache, page_size)
        self.cache = PageCache(engine.num_pages, page_size, manager)
        self.rows = TableRows(cfg.engine.max_running_requests)
        # Every rank must agree on the chunk size (batches are built alike on every rank).
        chunk = cfg.max_prefill_tokens or min_over_ranks(offline_prefill_tokens(engine.device),
                                                         cpu_group)
        by_priority = cfg.scheduling_policy == "priority"
        self.limits = Limits(engine.max_context, engine.vocab_size, engine.num_pages, page_size,
                             chunk, by_priority, cfg.engine.lora_slots,
                             cfg.logprobs_cap(engine.vocab_size), engine.hidden_size)
        self.adapters = AdapterTable(cfg.engine.lora_slots,
                                     [name for name, _ in cfg.engine.lora_adapters])
        self.long_rope_from = engine.long_rope_from  # 0: no longrope (_restart_long_rope)
        self.prefill = PrefillManager(self.cache, self.rows, chunk, cfg.decode_reserve_tokens,
                                      by_priority)
        self.decode = DecodeManager()
        self.reqs: Dict[int, Req] = {}  # every live request by uid
        # Constrained requests whose grammar compiles, in arrival order (not yet queued).
        self.compiling: List[Tuple[Req, "Future[Any]"]] = []
        self.grammars = GrammarCache(TokenizerSource(
            model_path=cfg.tokenizer_path or cfg.engine.model_path, vocab_size=engine.vocab_size,
            stop_ids=engine.eos_token_ids))
        self._batch_matcher: Any = None  # an xgrammar.BatchGrammarMatcher, made on first use
        self.stopped = False
        speculative = cfg.speculative
        drafter = Drafter if speculative is None or speculative.model is None else ModelDrafter
        self.drafter = (drafter(speculative, page_size, engine.long_rope_from)
                        if speculative is not None else None)
        self.spec = SpecCounts()
        # A verify step reads the newest token on the host: no overlap while speculating.
        self.overlap = cfg.overlap if cfg.overlap is not None else (
            engine.device.type == "cuda" and self.drafter is None)
        if speculative is not None:
            logger.info("rank %d: speculative decoding by %s: up to %d drafts%s; overlap off",
                        self.rank, f"draft model {speculative.model}" if speculative.model else
                        f"n-gram lookup (matches of {speculative.prompt_lookup_min} to "
                        f"{speculative.prompt_lookup_max} tokens)",
                        speculative.num_speculative_tokens,
                        "" if speculative.disable_by_batch_size is None else
                        f", none past {speculative.disable_by_batch_size} running requests")
        self.mixed = cfg.mixed
        self.inflight: Optional[InFlight] = None
        self.deferred: List[Req] = []  # finished, retired once the in-flight batch completes
        self.totals = {"prompt": 0, "generated": 0, "cached": 0, "prefilled": 0, "retracted": 0}
        # Per phase: forward passes and their busy seconds (statistics only: never scheduling
        # input, since clocks differ between ranks).
        self.steps = {Phase.PREFILL: 0, Phase.DECODE: 0, Phase.VERIFY: 0}
        self.busy_s = {Phase.PREFILL: 0.0, Phase.DECODE: 0.0, Phase.VERIFY: 0.0}
        self._last_done = 0.0
        self.wait_s = 0.0
        self.received = 0  # UserMsgs taken so far
        self.accounting_asked: List[AccountingMsg] = []  # check_idle answers them
        # A reload, a sleep or a pause waiting for the live requests to finish (WeightsMsg,
        # GroupWeightsMsg, SleepMsg, PauseMsg with wait), and the requests that arrived since,
        # while asleep or while paused (taken after it, the wake-up or the resume, in order).
        self.at_rest: Optional[Union[WeightsMsg, SleepMsg, GroupWeightsMsg, TensorWeightsMsg,
                                     PauseMsg]] = None
        self.paused = False  # PauseMsg: no batch runs until a resume
        self.held: List[UserMsg] = []
        global_rank = cfg.replica * cfg.engine.tp + self.rank  # among every replica's
        self.changes = Changes(engine, self.adapters, cfg.engine.lora_runtime, self.rank,
                               global_rank, cpu_group,
                               None if cfg.engine.load_format == "dummy"
                               else cfg.engine.model_path)
        self.profiler = RankProfiler(self.rank, global_rank, cfg.resolved_profile_dir,
                                     cpu_group)
        self._stats_seq = 0
        self.on_stats = on_stats
        if on_stats is not None:
            on_stats(self.stats())

    # --- the loop ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Something to step: live requests (not while paused) or a batch in flight."""
        return (bool(self.reqs) and not self.paused) or self.inflight is not None

    @property
    def _only_compiling(self) -> bool:
        """Nothing to run but requests whose grammar still compiles."""
        return (self.inflight is None and not self.decode.running
                and self.prefill.num_waiting == 0)

    def run_forever(self, pulse: Optional[Pulse] = None) -> None:
        """Step until a ShutdownMsg. `pulse` (a rank process's, `message/pulse.py`) is told
        when each step begins and when the loop waits for input, for the launcher's watchdog."""
        while not self.stopped:
            blocking = not self.has_work
            if pulse is not None:
                pulse.idle() if blocking else pulse.step_begins()
            msgs = self.io.receive(blocking=blocking, on_idle=self.check_idle)
            if pulse is not None and blocking:
                pulse.step_begins()
            self.iterate(msgs)
        logger.info("rank %d: scheduler stopped", self.rank)

    def iterate(self, msgs: List[object]) -> None:
        """One step: take the messages, launch the next batch, then finish the previous one.

        With overlap the previous batch's results are processed while the device runs the new
        one, so the scheduler decides one step behind: a request that finished in the previous
        batch may sit in the new one too (its extra token is dropped, and its resources are
        freed only after that batch completes).
        """
        for msg in msgs:
            self.handle(msg)
        if self.compiling and not self.stopped:
            self._queue_compiled()
        batch = None if self.stopped or self.paused else self.schedule()
        if batch is not None and batch.phase is Phase.PREFILL and self.on_stats is not None:
            self.on_stats(self.stats())  # what a long prefill shows on rank 0's stats timer
        launched = self._launch(batch) if batch is not None else None
        previous, self.inflight = self.inflight, launched
        if previous is not None:
            self._complete(previous)
        if self.inflight is not None and self.inflight.batch.masked:
            self.inflight = self._sample_masked(self.inflight)
        if not self.overlap or self.stopped:
            self._finish_inflight()
        if launched is not None:
            self.profiler.stepped()
        if self.at_rest is not None and not self.has_work and not self.stopped:
            change, self.at_rest = self.at_rest, None
            if isinstance(change, SleepMsg):
                self._sleep(change)
            elif isinstance(change, PauseMsg):
                self.paused = True
                self._answer(change.uid, None)
            elif isinstance(change, (GroupWeightsMsg, TensorWeightsMsg)):
                self._pushed_weights(change)
            else:
                self._update_weights(change)

    def _finish_inflight(self) -> None:
        """Wait for the in-flight batch (if any) and process its results."""
        if self.inflight is not None:
            done, self.inflight = self.inflight, None
            self._complete(done)

    def _launch(self, batch: Batch) -> InFlight:
        batch.launched_at = time.perf_counter()
        batch.masked = any(s and r.grammar is not None for r, s in zip(batch.reqs, batch.sample))
        first_decode = batch.first_decode
        if batch.phase is Phase.PREFILL and logger.isEnabledFor(logging.DEBUG):
            # what a first token waited for
            logger.debug("rank %d: prefill of %d tokens: requests %s; %d decoding alongside",
                         self.rank, sum(batch.extend_lens[:first_decode]), ", ".join(
                             f"{r.uid} ({ext}{'' if s else ', a chunk'})" for r, ext, s in
                             list(zip(batch.reqs, batch.extend_lens, batch.sample))[
                                 :first_decode]), batch.num_decode)
        launched = self.engine.launch(batch)
        launch_s = time.perf_counter() - batch.launched_at
        for i, (req, ext, sample) in enumerate(zip(batch.reqs, batch.extend_lens, batch.sample)):
            req.cached_len += ext
            if i >= first_decode or batch.phase is Phase.VERIFY:  # (`_verified` settles it)
                req.device_len += 1
            elif sample:  # last prompt chunk: the request decodes from the next step on
                req.device_len += 1
                self.prefill.prefilling.remove(req)
                self.decode.add(req)
        return InFlight(launched, batch, frozenset(r.uid for r in batch.reqs), launch_s)

    def _sample_masked(self, inflight: InFlight) -> InFlight:
        """Hand the engine the bitmask of a launched masked batch, built from the matchers
        after every earlier token was accepted. A request that finished meanwhile (its token
        is dropped) is not masked."""
        batch = inflight.batch
        grammars = [r.grammar if r.finish_reason is None else None
                    for r, s in zip(batch.reqs, batch.sample) if s]
        if batch.phase is Phase.VERIFY:  # a row per position, each after the drafts before it
            bitmask = fill_verify_bitmask(grammars,  # type: ignore[arg-type]
                                          batch.drafts or [], self.engine.vocab_size,
                                          pin=self.engine.device.type == "cuda")
            return inflight._replace(launched=self.engine.sample(inflight.launched, bitmask))
        if self._batch_matcher is None:
            import xgrammar as xgr
            self._batch_matcher = xgr.BatchGrammarMatcher()
        bitmask = fill_bitmask(grammars, self.engine.vocab_size,  # type: ignore[arg-type]
                               pin=self.engine.device.type == "cuda",
                               batch_matcher=self._batch_matcher)
        return inflight._replace(launched=self.engine.sample(inflight.launched, bitmask))

    def _queue_compiled(self) -> None:
        """Queue for admission the constrained requests whose grammar has compiled on every
        rank (see the module doc); with nothing else to run, wait a little for one first."""
        if self._only_compiling:
            concurrent.futures.wait([f for _, f in self.compiling], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready = true_on_all_ranks([f.done() for _, f in self.compiling], self.cpu_group)
        still: List[Tuple[Req, "Future[Any]"]] = []
        for (req, future), ok in zip(self.compiling, ready):
            if not ok:
                still.append((req, future))
                continue
            try:
                s = req.params.structured
                gate = (ThinkGate(s.think_start, s.think_end, s.thinking) if s is not None
                        else ThinkGate())
                req.grammar = RequestGrammar(future.result(), self.engine.eos_token_ids, gate)
            except Exception as e:  # the tokenizer compiled it: a different vocabulary?
                # (the same failure on every rank: compiling is deterministic)
                logger.error("rank %d: request %d: %s", self.rank, req.uid, e)
                del self.reqs[req.uid]
                self.io.send([TokenOut(req.uid, error=str(e))], None)
                continue
            self.prefill.add(req)
        self.compiling = still

    def _complete(self, inflight: InFlight) -> None:
        batch = inflight.batch
        ready, self.deferred = self.deferred, []  # waited for exactly this batch
        waited = time.perf_counter()
        result = self.engine.collect(inflight.launched)
        now = time.perf_counter()
        self.wait_s += now - waited
        self.steps[batch.phase] += 1
        self.busy_s[batch.phase] += now - max(self._last_done, batch.launched_at)
        self._last_done = now
        if batch.phase is Phase.PREFILL and logger.isEnabledFor(logging.DEBUG):
            # host-bound (launch ~ done) or device-bound: what the first tokens waited for
            logger.debug("rank %d: prefill of %d tokens done %.1f ms after its launch began "
                         "(the host launched it in %.1f ms)", self.rank,
                         sum(batch.extend_lens[:batch.first_decode]),
                         (now - batch.launched_at) * 1e3, inflight.launch_s * 1e3)
        if self.cfg.check_lockstep:
            uids = [r.uid for r in batch.reqs]
            slots = batch.out_slots.tolist() if batch.out_slots is not None else []
            check_same_across_ranks(uids + slots + result.tokens, self.cpu_group,
                                    "batch and tokens")
        outs = self.process(batch, result)
        for req in ready:
            self._retire(req, admitted=True)
        self.io.send(outs, self._posted_stats())  # after the retires: they see the freed pages

    def check_idle(self) -> None:
        """Called before blocking for input (no work, nothing in flight; every rank at the same
        step): every page must be accounted for. AccountingMsgs taken since get their reply
        now, at rest, as the offline API's tp=1 check sees it after its drain; one that asks
        drops the prefix cache first."""
        if any(m.reset_prefix_cache for m in self.accounting_asked):
            dropped = self.cache.drop_unused()
            logger.info("rank %d: prefix cache reset (%d pages freed)", self.rank, dropped)
        accounting = self.accounting()
        for msg in self.accounting_asked:
            self.io.post(accounting.reply(msg.seq))
        self.accounting_asked.clear()

    def accounting(self) -> Accounting:
        """The scheduler's resources, between steps; raises RuntimeError naming the numbers
        when the KV pages do not balance (free + in use + cached != total). Requests retired
        only once the in-flight batch completes still hold their pages and rows."""
        pages = self.cache.check([*self.reqs.values(), *self.deferred])
        return Accounting(pages, self.cache.reserved_pages, self.rows.available,
                          self.rows.num_rows, len(self.reqs), self.cache.evicted_pages,
                          self.totals["retracted"])

    # --- input ---------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, UserMsg) and (self.at_rest is not None or self.engine.asleep
                                         or self.paused):
            self.held.append(msg)  # taken after the reload or the wake-up (_take_held)
        elif isinstance(msg, UserMsg):
            self.received += 1
            self._add(msg)
        elif isinstance(msg, AbortMsg):
            self._abort_held(msg.uid)
            self.abort(msg.uid)
        elif isinstance(msg, ShutdownMsg):
            self.stopped = True
        elif isinstance(msg, AccountingMsg):  # answered at rest (check_idle)
            self.accounting_asked.append(msg)
        elif isinstance(msg, AdapterMsg):
            error = (self.changes.unload_adapter(msg.name) if msg.path is None else
                     self.changes.load_adapter(msg.name, msg.path, (
                         r.lora for r in [*self.reqs.values(), *self.deferred])))
            self._answer(msg.uid, error)
        elif isinstance(msg, (WeightsMsg, SleepMsg, GroupWeightsMsg, TensorWeightsMsg)):
            error = self._at_rest_refusal(msg)
            if error is not None:
                self._answer(msg.uid, error)
            else:
                self.at_rest = msg  # done once no request is live (iterate)
        elif isinstance(msg, WakeMsg):
            self._answer(msg.uid, self._wake(msg))
        elif isinstance(msg, GroupMsg):
            self._answer(msg.uid, self.changes.group(msg))
        elif isinstance(msg, PauseMsg):
            self._pause(msg)
        elif isinstance(msg, ProfileMsg):
            self._answer(msg.uid, self.profiler.start(msg) if msg.start
                         else self.profiler.stop())
        elif isinstance(msg, WeightReadMsg):
            read = read_weight(self.engine, msg, self.rank, self.cpu_group)
            self._answer(msg.uid, read.error, read.tensor)
        elif isinstance(msg, FlushCacheMsg):
            dropped = self.cache.drop_unused()
            logger.info("rank %d: prefix cache flushed (%d pages freed)", self.rank, dropped)
            self._answer(msg.uid, None)
        else:
            logger.error("rank %d: ignoring unknown message %r", self.rank, type(msg).__name__)

    def validate(self, msg: UserMsg) -> SamplingParams:
        """The params to serve the request with (`core.check_request`); RequestError why it
        cannot be served."""
        if msg.uid in self.reqs:
            raise RequestError(f"duplicate request id {msg.uid}")
        return check_request(msg.input_ids, msg.params, self.limits)

    def _answer(self, uid: int, error: Optional[str], tensor: Optional[WireTensor] = None
                ) -> None:
        """The one final reply to a change (AdapterMsg, WeightsMsg, FlushCacheMsg) or a weight
        read (its `tensor`): done, or why not; with the stats, which a dropped cache changed."""
        self.io.send([TokenOut(uid, finish_reason=FinishReason.STOP.value, tensor=tensor)
                      if error is None else TokenOut(uid, error=error)], self._posted_stats())

    def _abort_held(self, uid: int) -> None:
        """A request held behind a weight reload is aborted before it was taken."""
        held = [m for m in self.held if m.uid == uid]
        if held:
            self.held = [m for m in self.held if m.uid != uid]
            self.io.send([TokenOut(uid, finish_reason=FinishReason.ABORT.value,
                                   prompt_tokens=len(held[0].input_ids))], None)

    def _update_weights(self, msg: WeightsMsg) -> None:
        """The waiting reload, with no request live (every rank at the same step): the
        weights from `msg.path` on every rank or, where some rank failed, those served before
        again on every rank; the prefix cache dropped either way; then the held requests."""
        error = self.changes.reload(msg.path)
        dropped = self.cache.drop_unused()
        logger.info("rank %d: weights %s (%d cached pages dropped)", self.rank,
                    f"reloaded from {msg.path}" if error is None else "kept", dropped)
        self._answer(msg.uid, error)
        self._take_held()

    def _take_held(self) -> None:
        """The requests held behind a reload or a sleep, in order (held again while asleep)."""
        held, self.held = self.held, []
        for user in held:
            self.handle(user)

    def _pause(self, msg: PauseMsg) -> None:
        """Pause now (the in-flight batch finished first: nothing runs while paused), or once
        the live requests finished (`wait`: queued as a sleep is), or resume (the held
        requests taken)."""
        if msg.resume:
            if isinstance(self.at_rest, PauseMsg):
                self._answer(msg.uid, "a pause is waiting for the running requests to finish")
                return
            self.paused = False
            self._answer(msg.uid, None)
            self._take_held()
            return
        error = self._at_rest_refusal(msg)
        if error is not None:
            self._answer(msg.uid, error)
        elif msg.wait:
            self.at_rest = msg  # paused once no request is live (iterate)
        else:
            self._finish_inflight()
            self.paused = True
            self._answer(msg.uid, None)

    def _at_rest_refusal(self, msg: Union[WeightsMsg, SleepMsg, GroupWeightsMsg,
                                          TensorWeightsMsg, PauseMsg]) -> Optional[str]:
        """Why a reload, a sleep or a pause is not queued (None: it is)."""
        if self.at_rest is not None:
            what = ("a sleep" if isinstance(self.at_rest, SleepMsg) else "a pause"
                    if isinstance(self.at_rest, PauseMsg) else "a weight reload")
            return f"{what} is already waiting for the running requests to finish"
        if isinstance(msg, PauseMsg):
            return None
        if isinstance(msg, SleepMsg) and self.paused and self.reqs:
            return (f"generation is paused with {len(self.reqs)} requests kept: resume or "
                    f"abort them before sleeping (their KV cache would be forgotten)")
        if isinstance(msg, SleepMsg) and not self.cfg.engine.enable_sleep_mode:
            return "sleep mode is off: start the server with --enable-sleep-mode"
        if not isinstance(msg, SleepMsg) and "weights" in self.engine.asleep:
            return WEIGHTS_ASLEEP
        return None

    def _pushed_weights(self, msg: Union[GroupWeightsMsg, TensorWeightsMsg]) -> None:
        """The waiting update a trainer pushed (broadcast by its group, or handed over by
        reference), with no request live (every rank at the same step: Changes.from_group,
        from_tensors); the prefix cache dropped; then the held requests."""
        if isinstance(msg, GroupWeightsMsg):
            error, what = self.changes.from_group(msg), (f"{len(msg.names)} tensors from weight "
                                                         f"update group {msg.group_name!r}")
        else:
            error, what = self.changes.from_tensors(msg), "tensors handed over"
        dropped = self.cache.drop_unused()
        logger.info("rank %d: %s %s (%d cached pages dropped)", self.rank, what,
                    "loaded" if error is None else "not loaded", dropped)
        self._answer(msg.uid, error)
        self._take_held()

    def _sleep(self, msg: SleepMsg) -> None:
        """The waiting sleep, with no request live (every rank at the same step): the prefix
        cache dropped (its K/V is forgotten), then every rank's engine asleep (Changes.sleep).
        Requests wait while anything is asleep (held)."""
        error = self.changes.sleep(msg, self.cache.drop_unused())
        self._answer(msg.uid, error)
        if error is not None:
            self._take_held()

    def _wake(self, msg: WakeMsg) -> Optional[str]:
        """Wake the parts `msg.tags` names on every rank (Changes.wake): None, or why not.
        Once nothing is asleep, the held requests are taken."""
        if isinstance(self.at_rest, SleepMsg):
            return "a sleep is waiting for the running requests to finish"
        error = self.changes.wake(msg)
        if error is None and not self.engine.asleep:
            self._take_held()
        return error

    def _add(self, msg: UserMsg) -> None:
        try:
            params = self.validate(msg)
            lora = self.adapters.bind(params.lora_name)
        except RequestError as e:
            logger.info("rank %d: rejected request %d: %s", self.rank, msg.uid, e)
            self.io.send([TokenOut(msg.uid, error=str(e))], None)
            return
        logger.debug("rank %d: request %d queued (%d prompt tokens, max_tokens %d)", self.rank,
                     msg.uid, len(msg.input_ids), params.max_tokens)
        req = Req(msg.uid, list(msg.input_ids), len(msg.input_ids), params,
                  self.engine.eos_token_ids, lora=lora,
                  long_rope=0 < self.long_rope_from < len(msg.input_ids),
                  arrived_s=time.perf_counter())
        self.reqs[req.uid] = req
        if params.structured is not None:
            self.compiling.append((req, self.grammars.submit(params.structured)))
        else:
            self.prefill.add(req)
        self.totals["prompt"] += req.prompt_len

    def abort(self, uid: int) -> None:
        req = self.reqs.get(uid)
        if req is None:
            return  # already finished: nothing to free
        self.compiling = [(r, f) for r, f in self.compiling if r is not req]
        admitted = self.prefill.remove(req) or self.decode.remove(req)
        req.finish_reason = FinishReason.ABORT
        logger.debug("rank %d: request %d aborted after %d tokens", self.rank, uid, req.output_len)
        if admitted:
            self._release(req)
        else:
            self._retire(req, admitted=False)
        self.io.send([TokenOut(uid, finish_reason=FinishReason.ABORT.value,
                               prompt_tokens=req.prompt_len)], self._posted_stats())

    # --- batches -------------------------------------------------------------------------------
    def schedule(self) -> Optional[Batch]:
        """Prefill first (new requests get their first token soon), else decode everyone. With
        mixed steps the running requests decode in the prefill's step too (`_mix`): a prompt
        then never holds back the tokens of those already answering."""
        self._restart_long_rope()
        decoding = self.decode.schedule() if self.mixed and self.prefill.num_waiting else None
        share = decoding.size if decoding is not None else 0
        if share * 2 > self.prefill.budget:  # too many to ride along: a step of their own
            decoding, share = None, 0
        batch = self.prefill.schedule(self._admitted, share)
        if batch is None:
            self._make_room()
            batch = self.decode.schedule()
            if batch is None:
                return None
            if self.drafter is not None:
                batch = self.drafter.with_drafts(batch)
            for req, ext in zip(batch.reqs, batch.extend_lens):
                self.cache.grow(req, req.device_len + ext - 1)  # a verify's drafts: ext - 1
        elif decoding is not None:
            batch = self._mix(batch, decoding)
        self._write_slots(batch)
        return batch

    def _mix(self, prefill: Batch, decoding: Batch) -> Batch:
        """The prefill batch with the decode batch's requests appended (a mixed step,
        Batch.num_decode), where their new tokens' pages fit without retracting anyone (the
        pages they need beyond their reservations are free) and the engine runs such a step
        well (StepEngine.mixes); else the prefill alone, and a decode step of their own
        follows (which may retract, `_make_room`)."""
        if (self._new_pages(decoding.reqs) > self.cache.unreserved_pages
                or not self.engine.mixes(prefill, decoding.size)):
            return prefill
        for req in decoding.reqs:
            self.cache.grow(req, req.device_len)
        return Batch(Phase.PREFILL, prefill.reqs + decoding.reqs,
                     prefill.prefix_lens + decoding.prefix_lens,
                     prefill.extend_lens + decoding.extend_lens,
                     prefill.sample + decoding.sample, num_decode=decoding.size)

    def _admitted(self, req: Req) -> None:
        """A request just got its page-table row: map its cached prefix there, and let the
        engine set up the row's sampling state."""
        self._rewrite_pages(req, list(range(req.num_prefix_pages)))
        self.engine.start_request(req)
        req.scheduled_s = req.scheduled_s or time.perf_counter()

    def _make_room(self) -> None:
        """Before a decode step: when the running requests' pages beyond their reservations do
        not fit, retract the last admitted request in queue order (`PrefillManager.order`:
        the newest, by largest uid; by priority, the lowest-priority one first): deterministic,
        and the first request always fits alone, so it always progresses."""
        while True:
            running = self.decode.running.values()
            if self._new_pages(self.decode.decoding()) <= self.cache.unreserved_pages:
                return
            if self.inflight is not None:  # retraction needs every batch using it finished
                self._finish_inflight()
                continue
            admitted = sorted([*running, *self.prefill.prefilling], key=self.prefill.order)
            if len(admitted) <= 1:
                return
            self._retract(admitted[-1])

    def _new_pages(self, decoding: List[Req]) -> int:
        """Pages a decode step of `decoding` takes beyond their reservations: one for each
        request whose next token starts a page and that has none reserved."""
        ps = self.cache.page_size
        return sum(1 for r in decoding
                   if r.device_len > len(r.pages) * ps and r.reserved_pages == 0)

    def _retract(self, req: Req, for_room: bool = True) -> None:
        """Free an admitted request's resources and queue it again at the front: its computed
        KV goes to the prefix cache, so re-admission recomputes little (with radix).
        `for_room`: counted and logged as a retraction for KV pages (else the caller says
        why)."""
        if not self.decode.remove(req):
            self.prefill.prefilling.remove(req)
        self._free_admitted(req)
        req.prompt_hidden = []  # a prompt computed again is sent again whole
        req.cached_len = 0
        req.device_len = len(req.token_ids)
        self.prefill.requeue(req)
        if for_room:
            self.totals["retracted"] += 1
            logger.info("rank %d: retracted request %d (%d tokens) to free KV pages",
                        self.rank, req.uid, req.device_len)

    def _restart_long_rope(self) -> None:
        """Longrope (StepEngine.long_rope_from k): a running request whose next decode would
        make its sequence longer than k is prefilled again, every token then rotating with
        the long factors, as transformers' Phi-3 generation recomputes its cache there (the
        K/V so far rotated with the short ones). A function of the requests' lengths, so every
        rank restarts the same requests at the same step."""
        k = self.long_rope_from
        if not k:  # every other model: nothing to look at, every step
            return
        crossing = [r for r in self.decode.running.values()
                    if not r.long_rope and r.device_len > k and not r.all_launched]
        if not crossing:
            return
        self._finish_inflight()  # retraction needs every batch using it finished
        for req in sorted(crossing, key=self.prefill.order):
            if req.finish_reason is None and req.uid in self.decode.running:
                self._retract(req, for_room=False)
                req.long_rope = True
                logger.debug("rank %d: request %d passed %d tokens: prefilled again with "
                             "longrope's long factors", self.rank, req.uid, k)

    def _write_slots(self, batch: Batch) -> None:
        """Map the batch's new tokens to KV slots in the page table; set `batch.out_slots`."""
        ps = self.cache.page_size
        rows: List[int] = []
        cols: List[int] = []
        slots: List[int] = []
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            rows.extend([req.table_row] * n)
            cols.extend(range(start, start + n))
            pages, end = req.pages, start + n
            for page in range(start // ps, (end - 1) // ps + 1):  # a run of slots a page
                base = (pages[page] - page) * ps  # position p of this page: slot base + p
                slots.extend(range(base + max(start, page * ps), base + min(end, page * ps + ps)))
        # One host-to-device copy for all three (aligned rows: the slots go to Triton kernels);
        # int32 indexes the page table directly.
        packed = rows_to_device([rows, cols, slots], torch.int32, self.engine.device)
        self.engine.page_table[packed[0], packed[1]] = packed[2]
        batch.out_slots = packed[2]

    def _rewrite_pages(self, req: Req, page_indices: List[int]) -> None:
        """Point the page table at `req.pages[i]` for each listed page index (one copy)."""
        if not page_indices:
            return
        ps = self.cache.page_size
        cols = [i * ps + j for i in page_indices for j in range(ps)]
        slots = [req.pages[i] * ps + j for i in page_indices for j in range(ps)]
        packed = rows_to_device([cols, slots], torch.int32, self.engine.device)
        self.engine.page_table[req.table_row, packed[0]] = packed[1]

    def process(self, batch: Batch, result: StepResult) -> List[TokenOut]:
        """Record the batch's tokens and return what goes out."""
        if batch.phase is Phase.VERIFY:
            return self._verified(batch, result)
        for i, entries in result.prompt_logprobs.items():  # (usually none: no per-request lookup)
            batch.reqs[i].prompt_logprobs.extend(entries)
        out: List[TokenOut] = []
        first_decode = batch.first_decode
        states = result.hidden_states or {}
        for i, (req, ext, sample, tok, lp) in enumerate(zip(
                batch.reqs, batch.extend_lens, batch.sample, result.tokens, result.logprobs)):
            if req.finish_reason is not None:
                continue  # finished or aborted while this batch was in flight
            if i < first_decode:
                self.totals["prefilled"] += ext
            if req.wants_prompt_hidden and i in states:
                req.prompt_hidden.append(states[i])
            if not sample:  # a chunk of a long prompt: share its finished pages already
                self._rewrite_pages(req, self.cache.share_prefix(req))
                continue
            first = req.output_len == 0
            if first:
                self.totals["cached"] += req.prefix_hit
            reason = self._take_token(req, tok)
            prompt_lp = None
            if req.output_len == 1 and req.params.prompt_logprobs is not None:
                prompt_lp, req.prompt_logprobs = req.prompt_logprobs, []
            out.append(TokenOut(req.uid, tok, reason.value if reason else None, req.prompt_len,
                                req.prefix_hit, logprobs=lp, prompt_logprobs=prompt_lp,
                                embedding=(result.embeddings or {}).get(i),
                                times=_phase_times(req) if first else None,
                                tensor=_hidden_out(req, first, states.get(i))))
            if reason is not None:
                self._finished(req, reason)
        return out

    def _take_token(self, req: Req, tok: int) -> Optional[FinishReason]:
        """Record one new token of `req` (its grammar advanced by it); why it finished, if
        it did."""
        reason = req.append_token(tok)
        if req.grammar is not None and reason is None:
            reason = self._advance_grammar(req, tok)
        self.totals["generated"] += 1
        return reason

    def _finished(self, req: Req, reason: FinishReason) -> None:
        logger.debug("rank %d: request %d finished (%s, %d tokens, %d cached)", self.rank,
                     req.uid, reason.value, req.output_len, req.prefix_hit)
        self.decode.remove(req)
        self._release(req)

    def _verified(self, batch: Batch, result: StepResult) -> List[TokenOut]:
        """A verify batch's tokens: each request keeps the tokens sampled up to its first
        rejected draft (`speculative.kept`), one after another as decode steps would have
        given them (a stop ends it there); its lengths then count only the kept tokens (its
        KV is valid up to its newest token), and the engine learns what each running request
        kept (`StepEngine.keep`)."""
        out: List[TokenOut] = []
        running: List[Req] = []
        kept_tokens: List[List[int]] = []
        states = result.hidden_states or {}
        for i, (req, draft, verified, lps) in enumerate(zip(batch.reqs, batch.drafts or [],
                                                            result.verified or [],
                                                            result.verified_logprobs or [])):
            if req.finish_reason is not None:
                continue  # aborted meanwhile
            start = req.device_len - 1  # its length at launch (the launch counted one token)
            n = kept(draft, verified)
            self.spec.add(len(draft), n)
            reason = None
            rows = states.get(i)  # position j's state: token j's
            for j, (tok, lp) in enumerate(zip(verified[:n + 1], lps)):
                reason = self._take_token(req, tok)
                out.append(TokenOut(req.uid, tok, reason.value if reason else None,
                                    req.prompt_len, req.prefix_hit, logprobs=lp,
                                    tensor=None if rows is None else to_wire(rows[j:j + 1])))
                if reason is not None:
                    break
            req.device_len = len(req.token_ids)
            req.cached_len = min(start + n, req.device_len)
            if reason is not None:
                self._finished(req, reason)
            else:
                running.append(req)
                kept_tokens.append(verified[:n + 1])
        self.engine.keep(running, kept_tokens)
        return out

    def _advance_grammar(self, req: Req, tok: int) -> Optional[FinishReason]:
        """Accept a constrained request's new token; a grammar that has ended ends the request
        ("stop")."""
        grammar: RequestGrammar = req.grammar  # type: ignore[assignment]
        if not grammar.accept(tok):
            logger.error("rank %d: request %d: token %d is outside its grammar; stopping it",
                         self.rank, req.uid, tok)
            req.finish_reason = FinishReason.STOP
        elif grammar.terminated:
            req.finish_reason = FinishReason.STOP
        return req.finish_reason

    def _release(self, req: Req) -> None:
        """Retire a finished or aborted request now, or after the in-flight batch using it."""
        if self.inflight is not None and req.uid in self.inflight.uids:
            self.deferred.append(req)
            del self.reqs[req.uid]
        else:
            self._retire(req, admitted=True)

    def _retire(self, req: Req, admitted: bool) -> None:
        self.reqs.pop(req.uid, None)
        if admitted:
            self._free_admitted(req)

    def _free_admitted(self, req: Req) -> None:
        """Give back an admitted request's unused reservation and KV pages (to the page cache)
        and page-table row."""
        self.cache.retire(req)
        self.rows.free(req.table_row)
        req.table_row = -1

    def _posted_stats(self) -> SchedulerStats:
        """The stats, also given to `on_stats`."""
        stats = self.stats()
        if self.on_stats is not None:
            self.on_stats(stats)
        return stats

    def stats(self) -> SchedulerStats:
        cache = self.cache.manager.stats()
        self._stats_seq += 1
        return SchedulerStats(
            running=len(self.decode.running),
            # held behind a weight reload: waiting too (the router and /metrics see them)
            waiting=self.prefill.num_waiting + len(self.compiling) + len(self.held),
            waiting_tokens=self.prefill.waiting_tokens + sum(len(m.input_ids)
                                                             for m in self.held),
            kv_pages_used=self.cache.num_pages - self.cache.free_pages - cache.cached_pages,
            kv_pages_total=self.cache.num_pages, kv_pages_cached=cache.cached_pages,
            prompt_tokens_total=self.totals["prompt"],
            generated_tokens_total=self.totals["generated"],
            cached_tokens_total=self.totals["cached"],
            prefilled_tokens_total=self.totals["prefilled"],
            retracted_requests_total=self.totals["retracted"],
            evicted_pages_total=self.cache.evicted_pages,
            prefill_steps_total=self.steps[Phase.PREFILL],
            decode_steps_total=self.steps[Phase.DECODE] + self.steps[Phase.VERIFY],
            prefill_seconds_total=self.busy_s[Phase.PREFILL],
            decode_seconds_total=self.busy_s[Phase.DECODE] + self.busy_s[Phase.VERIFY],
            wait_seconds_total=self.wait_s, verify_steps_total=self.steps[Phase.VERIFY],
            spec_tokens=self.drafter.cfg.num_speculative_tokens if self.drafter else 0,
            spec_drafts_total=self.spec.drafts, spec_draft_tokens_total=self.spec.draft_tokens,
            spec_accepted_tokens_total=self.spec.accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec.accepted_per_pos),
            replica=self.cfg.replica, requests_received_total=self.received,
            seq=self._stats_seq, **self._adapter_stats())

    def _adapter_stats(self) -> Dict[str, Any]:
        """The LoRA fields of the stats: the adapters running and waiting (names), the slots
        and the time; none without LoRA slots (no scan of the requests per step)."""
        slots = self.cfg.engine.lora_slots
        if not slots:
            return {}
        def names(reqs: Iterable[Req]) -> Tuple[str, ...]:  # noqa: E306
            return tuple(sorted({r.params.lora_name for r in reqs if r.params.lora_name}))
        waiting = [*self.prefill.waiting, *(req for req, _ in self.compiling)]
        queued = {r.uid for r in waiting}
        return {"running_adapters": names(r for r in self.reqs.values() if r.uid not in queued),
                "waiting_adapters": names(waiting), "lora_slots": slots,
                "stats_time": time.time()}
