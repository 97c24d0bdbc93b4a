"""Where `LLM`'s scheduler runs: in the caller's process (tp=1: `InProcessRank`, one step per
poll) or in one spawned process per rank (tp>1: `RankProcesses`, rank 0 reached over ZMQ as
the service's tokenizer reaches it). Both take messages (`submit`), hand back token outputs
(`poll`) and release everything they hold on `close`, after which they raise RuntimeError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import shutil
import tempfile
from typing import Any, List, Optional

import torch
import zmq

from minisgl.core import Limits
from minisgl.distributed import DistributedInfo, ProcessGroups
from minisgl.distributed.bind import free_port
from minisgl.distributed.comm import Communicator
from minisgl.engine import Engine
from minisgl.message import BatchTokenOut, SchedulerStats, ShutdownMsg, TokenOut
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.types import AccountingMsg, AccountingReply
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import LocalIO
from minisgl.scheduler.main import run_rank, set_cpu_threads
from minisgl.scheduler.scheduler import Accounting, Scheduler
from minisgl.server.proc import (Child, ChildStartupError, first_dead, spawn, stop_children,
                                 wait_ready)

logger = logging.getLogger(__name__)


class InProcessRank:
    """tp=1: drive the scheduler directly, one step per poll."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        info = cfg.engine.tp_info
        if cfg.engine.cpu_threads is not None:  # this is the caller's process: only when asked
            set_cpu_threads(cfg.engine, 1, logger)  # the only rank on this host
        self.engine = Engine(cfg.engine, ProcessGroups(Communicator(info), None),
                             mixed_rows=cfg.mixed_rows, verify_tokens=cfg.verify_tokens,
                             verify_requests=cfg.verify_requests,
                             draft_path=cfg.draft_model_path, draft_method=cfg.draft_method)
        self.io = LocalIO()
        self.scheduler = Scheduler(cfg, self.engine, self.io)
        self.limits: Limits = self.scheduler.limits
        self.closed = False

    def submit(self, msg: Any) -> None:
        self._check_open()
        self.io.inbox.append(msg)

    def poll(self) -> List[TokenOut]:
        self._check_open()
        s = self.scheduler
        s.iterate(s.io.receive(blocking=False, on_idle=s.check_idle))
        if not s.has_work:
            s.check_idle()
        outs, self.io.outbox = self.io.outbox, []
        return outs

    def drain(self) -> None:
        """Finish the in-flight batch (overlap keeps one) so the scheduler rests idle."""
        while self.scheduler.has_work:
            self.poll()

    @property
    def stats(self) -> Optional[SchedulerStats]:
        return self.io.stats

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed")

    def close(self) -> None:
        """Release the engine (weights, KV pool, CUDA graphs): a closed LLM holds no device
        memory, so that the next one in this process sizes its KV pool from all of it (it
        got a fifth less with the first's pool still held). Later calls raise RuntimeError."""
        if self.closed:
            return
        self.closed = True
        on_cuda = self.engine.device.type == "cuda"
        del self.scheduler, self.engine
        gc.collect()  # the engine's tensors sit in reference cycles (modules, graphs)
        if on_cuda:
            torch.cuda.empty_cache()


class RankProcesses:
    """tp>1: one process per rank, spawned, awaited and stopped by `server.proc` as the
    launcher's are; rank 0 talks to us over ZMQ. A rank that fails to start, or dies later,
    raises RuntimeError naming it once the other ranks are stopped."""

    def __init__(self, cfg: SchedulerConfig, tp: int, log_level: str,
                 forkserver: bool = False) -> None:
        """`forkserver`: the ranks fork from this process's fork server (proc.prestart)."""
        self.run_dir = tempfile.mkdtemp(prefix="minisgl-llm-")
        addr = lambda name: f"ipc://{self.run_dir}/{name}"  # noqa: E731
        port = free_port()
        self.ctx = zmq.Context()
        self.results = PullQueue(self.ctx, addr("detokenizer"), bind=True)
        self.children: List[Child] = []
        for rank in range(tp):
            engine = dataclasses.replace(cfg.engine, tp_info=DistributedInfo(rank, tp),
                                         dist_init_method=f"tcp://127.0.0.1:{port}")
            rank_cfg = dataclasses.replace(
                cfg, engine=engine, backend_addr=addr("backend"),
                detokenizer_addr=addr("detokenizer"), broadcast_addr=addr("broadcast"))
            self.children.append(spawn(f"rank{rank}", run_rank, (rank_cfg,), log_level,
                                       self.run_dir, forkserver=forkserver))
        self.requests = PushQueue(self.ctx, addr("backend"), bind=False)
        self.stats: Optional[SchedulerStats] = None  # rank 0's latest
        self.accounting_seq = 0  # AccountingMsg numbers, so a reply meets its request
        self.closed = False
        try:
            wait_ready(self.children, should_stop=lambda: False)
        except ChildStartupError as e:
            rank = self.children.index(e.child)
            self.close(graceful=False)
            raise RuntimeError(f"scheduler rank {rank} failed to start: {e.reason}") from None
        except BaseException:  # interrupted: leave no rank behind
            self.close(graceful=False)
            raise
        self.limits: Limits = (self.children[0].info or {})["limits"]

    @property
    def torch_threads(self) -> List[int]:
        """Each rank's torch thread count, as it reported it when ready."""
        return [(c.info or {})["torch_threads"] for c in self.children]

    @property
    def procs(self) -> List[Any]:
        """The rank processes (multiprocessing.Process), rank r at index r."""
        return [c.process for c in self.children]

    def check_alive(self) -> None:
        dead = first_dead(self.children)
        if dead is not None:
            self.close(graceful=False)
            raise RuntimeError(f"scheduler rank process {dead.process.name} died "
                               f"(exit code {dead.process.exitcode}); stopped the other ranks")

    def submit(self, msg: Any) -> None:
        self._check_open()
        self.requests.put(msg)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed")

    def drain(self) -> None:
        """Nothing to wait for: the rank processes finish their in-flight batch by themselves."""

    def _receive(self) -> object:
        """Rank 0's next message within half a second (None: none came, and every rank is
        alive); a BatchTokenOut's stats are kept."""
        try:
            msg = self.results.get(timeout_ms=500)
        except TimeoutError:
            self.check_alive()
            return None
        if isinstance(msg, BatchTokenOut) and msg.stats is not None and (
                self.stats is None or msg.stats.seq > self.stats.seq):
            self.stats = msg.stats  # the newest: rank 0's timer sends them too
        return msg

    def poll(self) -> List[TokenOut]:
        msg = self._receive()
        return list(msg.items) if isinstance(msg, BatchTokenOut) else []

    def accounting(self, reset_prefix_cache: bool = False) -> Accounting:
        """Every rank checks its KV pages at its next rest (a rank whose pages do not balance
        raises, ends, and the others are stopped: RuntimeError here), having first dropped its
        prefix cache where `reset_prefix_cache`; rank 0's numbers."""
        self.accounting_seq += 1
        self.requests.put(AccountingMsg(self.accounting_seq, reset_prefix_cache))
        while True:
            msg = self._receive()
            if isinstance(msg, AccountingReply) and msg.seq == self.accounting_seq:
                return Accounting.of_reply(msg)
            if isinstance(msg, BatchTokenOut) and msg.items:
                raise RuntimeError(f"check_accounting runs between generate calls; rank 0 "
                                   f"sent {len(msg.items)} token outputs meanwhile")

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks (gracefully: a ShutdownMsg ends them all at the same step) and remove
        the runtime directory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if graceful and self.children[0].alive:
            with contextlib.suppress(zmq.ZMQError):
                self.requests.put(ShutdownMsg())
        if graceful:
            stop_children(self.children, 10.0, 5.0)
        else:  # a rank died: the others may be stuck in a collective with it
            stop_children(self.children, 0.0, 1.0)
        self.results.close()
        self.requests.close()
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
