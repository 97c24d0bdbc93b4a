"""Entry point of one scheduler rank process (used by the server launcher and by `LLM(tp>1)`).

Order matters: join the process groups, build the engine (loads this rank's weight shard), open
the IO (rank 0 waits for every subscriber), report ready, then loop until a ShutdownMsg. A
start-up exception is reported on the pipe (`message.startup`); any exception ends the process
non-zero, and the parent then stops the other ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from minisgl.cpu_threads import choose_threads
from minisgl.distributed import destroy_process_groups, init_process_groups
from minisgl.engine import Engine, EngineConfig
from minisgl.message.startup import report_startup
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import ZmqIO
from minisgl.scheduler.scheduler import Scheduler


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


def _watch_peers(peers: Dict[int, int], log: logging.Logger) -> None:
    """A rank whose peer rank died would wait forever on a socket or a collective: end it with
    an error instead (within about a second). The parent is watched by `server.proc`."""
    while True:
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


def set_cpu_threads(cfg: EngineConfig, log: logging.Logger) -> None:
    """Size torch's thread pool (`cpu_threads.choose_threads`): on the CPU device, where the
    ranks share the cores, or wherever `cpu_threads` is given."""
    if cfg.device != "cpu" and cfg.cpu_threads is None:
        return
    choice = choose_threads(cfg.cpu_threads, cfg.tp_info.size)
    torch.set_num_threads(choice.threads)
    log.debug("%d torch threads (%s)", choice.threads, choice.source)


def _progress(conn: Any, name: str) -> Callable[[str], None]:
    """Start-up steps to the parent, which shows them (`server.proc.wait_ready`)."""
    return lambda text: conn.send(("progress", name, text))


def run_rank(cfg: SchedulerConfig, conn: Any) -> None:
    """Process entry, started through `server.proc.spawn` (which names the process, sets up its
    logging and watches its parent); `conn` carries the start-up report."""
    rank = cfg.engine.tp_info.rank
    name = f"rank{rank}"
    log = logging.getLogger("minisgl.scheduler")
    set_cpu_threads(cfg.engine, log)
    # A rank fails deep in a device or a weight file: its traceback is worth an error line.
    with report_startup(conn, name, log, logging.ERROR):
        info = cfg.engine.tp_info
        groups = init_process_groups(info, cfg.engine.torch_device, cfg.engine.dist_init_method,
                                     cfg.engine.dist_timeout_s, cfg.engine.allreduce)
        peers = _peer_pids(groups.cpu_group, info.rank, info.size)
        threading.Thread(target=_watch_peers, args=(peers, log), daemon=True).start()
        engine = Engine(cfg.engine, groups, _progress(conn, name) if info.rank == 0
                        else lambda text: None)
        io = ZmqIO(cfg.engine.tp_info, cfg.backend_addr or "", cfg.detokenizer_addr or "",
                   cfg.broadcast_addr, groups.cpu_group, cfg.subscriber_timeout_s)
        scheduler = Scheduler(cfg, engine, io, groups.cpu_group)
    conn.send(("ready", name, {"limits": scheduler.limits,
                               "torch_threads": torch.get_num_threads()}))
    try:
        scheduler.run_forever()
    except BaseException:
        log.exception("rank %d failed", rank)
        sys.exit(1)
    io.close()
    destroy_process_groups()
