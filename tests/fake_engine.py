"""A `StepEngine` for scheduler tests: CPU tensors and no model, and a harness that drives a real
`Scheduler` with it one step at a time.

The fake keeps a KV pool of token ids. A batch writes each new token's id into the slot the page
table names for its position, then reads each sampled request's whole context back through the
page table; its next token is a hash of that context (`next_token`). So a request's tokens equal
`reference(prompt, n)` exactly when every page-table entry the scheduler wrote points at the
right KV, through chunking, prefix sharing, eviction and retraction. Like the real engine, a
decode batch's input is the row's last sampled token (`last`), which with overlap the host has
not seen yet; so is a mixed step's decode rows' (Batch.num_decode).

LoRA adapters: `load_adapter` gives the slot a code (a hash of the adapter's path; a path
ending in "bad" fails), and a request bound to the slot writes its tokens into the KV pool
shifted by `SHIFT * code` (`lora_reference`), so its tokens show which adapter each of its
steps saw, and a prefix cached under another adapter (or another load) gives other tokens.
Weights: `reload_weights(path)` shifts every request's tokens alike, by the code of `path`
(`lora_reference(prompt, n, path)`; the start-up path "fake": none); a path ending in "bad"
is refused before anything changes (WeightsRefused), one ending in "broken" fails after the
weights changed.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch

from minisgl.core import (Batch, Phase, Req, SamplingParams, StepResult, TokenLogprobs,
                          WeightsRefused)
from minisgl.distributed import DistributedInfo
from minisgl.engine import EngineConfig
from minisgl.engine.logprobs import prompt_rows
from minisgl.message import AbortMsg, TokenOut, UserMsg
from minisgl.message.types import AdapterMsg, SleepMsg, WakeMsg, WeightsMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import LocalIO
from minisgl.scheduler.scheduler import Accounting, Scheduler

VOCAB = 50_000


def next_token(context: Sequence[int]) -> int:
    """The fake model: a hash of every token of the context, in order."""
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) % VOCAB
    return h


def reference(prompt: Sequence[int], n: int) -> List[int]:
    """The `n` tokens the fake generates after `prompt` when nothing goes wrong."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


SHIFT = 7_919  # prime, so no adapter's shift vanishes in next_token's modulo


def adapter_code(path: str) -> int:
    """The code the fake engine gives an adapter loaded from `path`."""
    return 1 + zlib.crc32(path.encode()) % 997


def lora_reference(prompt: Sequence[int], n: int, path: Optional[str]) -> List[int]:
    """The `n` tokens the fake generates after `prompt` with the adapter of `path` (None:
    none) bound throughout."""
    shift = SHIFT * adapter_code(path) if path is not None else 0
    seq = [t + shift for t in prompt]
    out: List[int] = []
    for _ in range(n):
        out.append(next_token(seq))
        seq.append(out[-1] + shift)
    return out


def fake_logprob(token: int) -> TokenLogprobs:
    """The log-probability the fake reports for `token` (sampled or a prompt target)."""
    return TokenLogprobs(-float(token))


class Step(NamedTuple):
    """One launched batch as the engine saw it: per request (uid, prefix, extend, sample), and
    how many of them (the last) decode alongside a prefill."""

    phase: Phase
    reqs: List[Tuple[int, int, int, bool]]
    num_decode: int = 0


class FakeLaunch(NamedTuple):
    step: int  # index into FakeEngine.steps
    result: StepResult


class FakeEngine:
    """Satisfies minisgl.scheduler.engine_api.StepEngine on the CPU (see the module doc)."""

    def __init__(self, num_pages: int, page_size: int, max_running_requests: int,
                 max_context: int, mix_limit: Optional[int] = None) -> None:
        """`mix_limit`: the most decode rows `mixes` accepts along a one-prompt batch (as a
        GPU engine's mixed graphs do); None: every mixed step."""
        self.device = torch.device("cpu")
        self.mix_limit = mix_limit
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_context = max_context
        self.vocab_size = VOCAB
        self.hidden_size = 8
        self.eos_token_ids: Tuple[int, ...] = ()
        self.long_rope_from = 0
        rows = max_running_requests + 1
        self.page_table = torch.zeros((rows, max_context), dtype=torch.int32)
        self.kv = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
        self.last = [-1] * rows  # each row's newest sampled token
        self.row_owner = [-1] * rows  # uid start_request last set each row up for
        self.steps: List[Step] = []
        self.pending: Deque[FakeLaunch] = deque()  # launched, not yet collected
        self.most_pending = 0
        self.slot_codes: Dict[int, int] = {}  # LoRA slot -> its adapter's code (loaded ones)
        self.weights_code = 0  # the weights' (reload_weights)
        self.reloads: List[Optional[str]] = []  # every reload_weights path, in order
        self.asleep: FrozenSet[str] = frozenset()  # sleep mode's parts asleep
        self.sleeps: List[Tuple[int, Tuple[str, ...]]] = []  # every sleep's (level, parts)
        self.levels: Dict[str, int] = {}  # each part asleep: the level it sleeps at
        self.wake_error: Optional[str] = None  # what the next wake_up raises (once)

    def sleep(self, level: int, tags: Tuple[str, ...] = ()) -> int:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        awake = tuple(t for t in tags or ("weights", "kv_cache") if t not in self.asleep)
        self.asleep |= frozenset(awake)
        self.levels.update({t: level for t in awake})
        self.sleeps.append((level, awake))
        if level == 2 and "weights" in awake:
            self.weights_code = -1  # forgotten: a reload must come before serving again
        return 1 << 20

    def wake_up(self, tags: Tuple[str, ...] = ()) -> None:
        if self.wake_error is not None:
            error, self.wake_error = self.wake_error, None
            raise RuntimeError(error)
        self.asleep -= frozenset(tags or ("weights", "kv_cache"))

    def sleep_level(self, tag: str) -> int:
        return self.levels.get(tag, 0) if tag in self.asleep else 0

    def load_adapter(self, slot: int, name: str, path: str) -> None:
        if path.endswith("bad"):
            raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
        self.slot_codes[slot] = adapter_code(path)

    def clear_adapter(self, slot: int) -> None:
        self.slot_codes.pop(slot, None)

    def reload_weights(self, path: Optional[str]) -> None:
        self.reloads.append(path)
        if path is not None and path.endswith("bad"):
            raise WeightsRefused(f"{path}: the checkpoint's hidden_size is 8; the served "
                                 f"model's is 64")
        self.weights_code = 0 if path in (None, "fake") else adapter_code(path)
        if path is not None and path.endswith("broken"):
            raise OSError(f"{path}: a truncated file")

    def _shift(self, req: Req) -> int:
        lora = 0 if req.lora is None else SHIFT * self.slot_codes[req.lora.slot]
        return lora + SHIFT * self.weights_code

    def start_request(self, req: Req) -> None:
        self.row_owner[req.table_row] = req.uid

    def mixes(self, prefill: Batch, num_decode: int) -> bool:
        return self.mix_limit is None or (prefill.size == 1 and num_decode <= self.mix_limit)

    def launch(self, batch: Batch) -> FakeLaunch:
        assert not self.asleep, f"a batch launched while {sorted(self.asleep)} sleep"
        assert batch.out_slots is not None and len(batch.out_slots) == sum(batch.extend_lens)
        ps = self.page_size  # position p of a request sits in its page p // ps, at p % ps
        assert batch.out_slots.tolist() == [
            req.pages[p // ps] * ps + p % ps for req, start, n in
            zip(batch.reqs, batch.prefix_lens, batch.extend_lens) for p in range(start, start + n)]
        for req in batch.reqs:
            assert self.row_owner[req.table_row] == req.uid, "start_request was not called"
        self._write_kv(batch)
        tokens = [self._sample(req, p + e) if s else -1 for req, p, e, s in
                  zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample)]
        logprobs = [fake_logprob(t) if s and r.params.logprobs is not None else None
                    for r, t, s in zip(batch.reqs, tokens, batch.sample)]
        self.steps.append(Step(batch.phase, [(r.uid, p, e, s) for r, p, e, s in zip(
            batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample)], batch.num_decode))
        launched = FakeLaunch(len(self.steps) - 1,
                              StepResult(tokens, logprobs, self._prompt_logprobs(batch)))
        self.pending.append(launched)
        self.most_pending = max(self.most_pending, len(self.pending))
        return launched

    def collect(self, launched: FakeLaunch) -> StepResult:
        assert self.pending and self.pending[0] is launched, "collected out of launch order"
        self.pending.popleft()
        return launched.result

    def _write_kv(self, batch: Batch) -> None:
        new: List[int] = []
        for i, (req, prefix, ext) in enumerate(zip(batch.reqs, batch.prefix_lens,
                                                   batch.extend_lens)):
            if i >= batch.first_decode:
                assert ext == 1 and prefix == req.device_len - 1, "a decode row's one new token"
                new.append(self.last[req.table_row] + self._shift(req))
            else:
                new.extend(t + self._shift(req) for t in req.token_ids[prefix:prefix + ext])
        self.kv[batch.out_slots.long()] = torch.tensor(new, dtype=torch.int64)

    def _sample(self, req: Req, seq_len: int) -> int:
        context = self.kv[self.page_table[req.table_row, :seq_len].long()].tolist()
        token = next_token(context)
        self.last[req.table_row] = token
        return token

    @staticmethod
    def _prompt_logprobs(batch: Batch) -> Dict[int, List[TokenLogprobs]]:
        prompt = prompt_rows(batch)  # the engine's own choice of rows
        if prompt is None:
            return {}
        out: Dict[int, List[TokenLogprobs]] = {}
        start = 0
        for owner, n in zip(prompt.owners, prompt.counts):
            out[owner] = [fake_logprob(t) for t in prompt.targets[start:start + n]]
            start += n
        return out


@dataclass
class Harness:
    """A real Scheduler on a FakeEngine behind in-process queues, stepped as `LLM` steps it.
    Every step checks the page accounting (free + in use + cached = total)."""

    num_pages: int = 64
    page_size: int = 4
    max_running_requests: int = 4
    max_prefill_tokens: int = 64
    overlap: bool = False
    mixed: bool = False  # mixed steps (SchedulerConfig.mixed_steps)
    mix_limit: Optional[int] = None  # FakeEngine.mixes
    decode_reserve_tokens: Optional[int] = None
    cache: str = "radix"
    scheduling_policy: str = "fcfs"
    max_loras: int = 0  # LoRA adapter slots (EngineConfig.max_loras)
    enable_sleep_mode: bool = True
    max_context: int = 1024
    tokens: Dict[int, List[int]] = field(default_factory=dict)  # every token sent, by uid
    outs: List[TokenOut] = field(default_factory=list)  # everything sent, in order

    def __post_init__(self) -> None:
        engine_cfg = EngineConfig("fake", DistributedInfo(0, 1), page_size=self.page_size,
                                  max_running_requests=self.max_running_requests,
                                  max_loras=self.max_loras,
                                  enable_sleep_mode=self.enable_sleep_mode)
        cfg = SchedulerConfig(engine_cfg, max_prefill_tokens=self.max_prefill_tokens,
                              cache=self.cache, overlap=self.overlap,
                              mixed_steps=self.mixed,
                              decode_reserve_tokens=self.decode_reserve_tokens,
                              scheduling_policy=self.scheduling_policy)
        self.engine = FakeEngine(self.num_pages, self.page_size, self.max_running_requests,
                                 self.max_context, self.mix_limit)
        self.io = LocalIO()
        self.sched = Scheduler(cfg, self.engine, self.io)

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int = 8,
               **params: object) -> None:
        self.io.inbox.append(UserMsg(uid, list(prompt),
                                     SamplingParams(max_tokens=max_tokens, **params)))

    def abort(self, uid: int) -> None:
        self.io.inbox.append(AbortMsg(uid))

    def adapter(self, uid: int, name: str, path: Optional[str] = None) -> None:
        """Load LoRA adapter `name` from `path` (None: unload it), as message `uid`."""
        self.io.inbox.append(AdapterMsg(uid, name, path))

    def weights(self, uid: int, path: str) -> None:
        """Reload the weights from `path`, as message `uid`."""
        self.io.inbox.append(WeightsMsg(uid, path))

    def sleep(self, uid: int, level: int = 1, *tags: str) -> None:
        self.io.inbox.append(SleepMsg(uid, level, tags))

    def wake(self, uid: int, *tags: str) -> None:
        self.io.inbox.append(WakeMsg(uid, tags))

    def step(self) -> List[TokenOut]:
        s = self.sched
        s.iterate(self.io.receive(blocking=False, on_idle=s.check_idle))
        if not s.has_work:
            s.check_idle()
        s.accounting()
        outs, self.io.outbox = self.io.outbox, []
        for out in outs:
            if out.token >= 0:
                self.tokens.setdefault(out.uid, []).append(out.token)
        self.outs.extend(outs)
        return outs

    def run(self, max_steps: int = 10_000) -> Dict[int, List[int]]:
        """Step until the scheduler rests idle; every token sent, by uid."""
        for _ in range(max_steps):
            if not (self.sched.has_work or self.io.inbox):
                return self.tokens
            self.step()
        raise AssertionError(f"the scheduler was still busy after {max_steps} steps")

    def finished(self, uid: int) -> TokenOut:
        """The message that ended request `uid` (its finish reason or error)."""
        ends = [o for o in self.outs if o.uid == uid and (o.finish_reason or o.error)]
        assert len(ends) == 1, f"request {uid} ended {len(ends)} times"
        return ends[0]

    def reply(self, uid: int) -> str:
        """'ok' or the error of change message `uid`'s one final TokenOut."""
        end = self.finished(uid)
        return "ok" if end.error is None and end.finish_reason == "stop" else str(end.error)

    def accounting(self) -> Accounting:
        return self.sched.accounting()
