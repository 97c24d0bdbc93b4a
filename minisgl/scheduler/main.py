"""Entry point of one scheduler rank process (used by the server launcher and by `LLM(tp>1)`).

Order matters: join the process groups, build the engine (loads this rank's weight shard), open
the IO (rank 0 waits for every subscriber), report ready, then loop until a ShutdownMsg. Any
exception is reported through `ready` (if not yet sent) and ends the process non-zero; the
parent then stops the other ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from minisgl.distributed import destroy_process_groups, init_process_groups
from minisgl.engine import Engine
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import ZmqIO
from minisgl.scheduler.scheduler import Scheduler
from minisgl.log import setup_logging


def _alive(pid: int) -> bool:
    """False once `pid` has exited, including as a not-yet-reaped zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _watchdog(parent_pid: int, peers: Dict[int, int], log: logging.Logger) -> None:
    """A rank whose parent or a peer rank died would wait forever on a socket or a collective:
    end it with an error instead (within about a second)."""
    while True:
        if os.getppid() != parent_pid:
            log.error("parent process %d is gone; exiting", parent_pid)
            os._exit(3)
        for rank, pid in peers.items():
            if not _alive(pid):
                log.error("scheduler rank %d (pid %d) is gone; exiting", rank, pid)
                os._exit(4)
        time.sleep(0.5)


def _peer_pids(cpu_group: Any, rank: int, size: int) -> Dict[int, int]:
    if size == 1:
        return {}
    pids: List[Any] = [None] * size
    dist.all_gather_object(pids, os.getpid(), group=cpu_group)
    return {r: pid for r, pid in enumerate(pids) if r != rank}


def run_rank(cfg: SchedulerConfig, ready: Any, log_level: str = "INFO") -> None:
    rank = cfg.engine.tp_info.rank
    setup_logging(f"rank{rank}", log_level)
    log = logging.getLogger("minisgl.scheduler")
    parent = os.getppid()
    if cfg.engine.device == "cpu":  # ranks share the cores; oversubscribing them is slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.engine.tp_info.size))
    try:
        info = cfg.engine.tp_info
        groups = init_process_groups(info, cfg.engine.torch_device, cfg.engine.dist_init_method,
                                     cfg.engine.dist_timeout_s, cfg.engine.allreduce)
        peers = _peer_pids(groups.cpu_group, info.rank, info.size)
        threading.Thread(target=_watchdog, args=(parent, peers, log), daemon=True).start()
        engine = Engine(cfg.engine, groups)
        io = ZmqIO(cfg.engine.tp_info, cfg.backend_addr or "", cfg.detokenizer_addr or "",
                   cfg.broadcast_addr, groups.cpu_group, cfg.subscriber_timeout_s)
        scheduler = Scheduler(cfg, engine, io, groups.cpu_group)
    except BaseException as e:
        log.exception("rank %d failed to start", rank)
        ready.send(("error", rank, f"{type(e).__name__}: {e}"))
        sys.exit(1)
    ready.send(("ready", rank, {"limits": scheduler.limits}))
    try:
        scheduler.run_forever()
    except BaseException:
        log.exception("rank %d failed", rank)
        sys.exit(1)
    io.close()
    destroy_process_groups()
