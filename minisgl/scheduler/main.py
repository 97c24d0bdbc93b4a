"""Entry point of one scheduler rank process (used by the server launcher and by `LLM(tp>1)`).

Order matters: join the process groups, build the engine (loads this rank's weight shard), open
the IO (rank 0 waits for every subscriber), report ready, then loop until a ShutdownMsg. A
start-up exception is reported on the pipe (`message.startup`); any exception ends the process
non-zero, and the parent then stops the other ranks.

Exit status: 1 for a failure of this rank's own, `PEER_EXIT` (4) when it ends because another
rank failed (a peer process gone, a collective broken or timed out, the store of a multi-node
service gone), so that a supervisor can name the rank that failed first rather than the ones
that followed it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from minisgl.cpu_threads import choose_threads
from minisgl.distributed import destroy_process_groups, init_process_groups
from minisgl.distributed.store import parse_tcp, rank_beat_key, start_heartbeat
from minisgl.engine import Engine, EngineConfig
from minisgl.gc_heap import freeze_startup_heap
from minisgl.log import exit_now
from minisgl.message.pulse import Pulse
from minisgl.message.startup import PEER_EXIT, report_startup
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import ZmqIO
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.stats_timer import StatsTimer


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
    an error instead (within about a second). Only peers on this host are watched (a PID means
    nothing elsewhere); those on other nodes are their launchers' to watch. The parent is
    watched by `server.proc`."""
    while True:
        for rank, pid in peers.items():
            if not _alive(pid):
                log.error("scheduler rank %d (pid %d) is gone; exiting", rank, pid)
                os._exit(PEER_EXIT)
        time.sleep(0.5)


def _host_id() -> str:
    """Names this host's PID space: the host name and its boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class Peers(NamedTuple):
    pids: Dict[int, int]  # rank -> pid of every other rank on this host
    on_host: int  # ranks of this group on this host, this one included


def _peers(cpu_group: Any, rank: int, size: int) -> Peers:
    if size == 1:
        return Peers({}, 1)
    everyone: List[Any] = [None] * size
    dist.all_gather_object(everyone, (_host_id(), os.getpid()), group=cpu_group)
    here = _host_id()
    local = {r: pid for r, (host, pid) in enumerate(everyone) if host == here}
    return Peers({r: pid for r, pid in local.items() if r != rank}, len(local))


def is_peer_failure(e: BaseException) -> bool:
    """True for the errors another rank's failure causes here: torch.distributed's own (a
    store or an NCCL communicator gone) and gloo's (a peer's connection closed, a timeout)."""
    return isinstance(e, dist.DistError) or "gloo" in str(e)


def log_failure(log: logging.Logger, rank: int, e: BaseException) -> int:
    """Log why this rank's loop ended, one event, and return its exit status: a failure of its
    own with its traceback (1); one that only followed another rank's (`is_peer_failure`) in
    one line (`PEER_EXIT`): its traceback shows only a broken connection, on every follower."""
    if is_peer_failure(e):
        text = str(e).strip()
        log.error("rank %d failed (another rank failed first): %s", rank,
                  text.splitlines()[0] if text else type(e).__name__)
        return PEER_EXIT
    log.error("rank %d failed", rank, exc_info=e)
    return 1


def _beat(cfg: SchedulerConfig, log: logging.Logger) -> None:
    """Multi-node: this rank's heartbeat in node 0's store, which its launcher watches (a hung
    rank stops beating). Losing the store means node 0 is gone: exit."""
    def lost(e: BaseException) -> None:
        log.error("lost node 0's store (%s); exiting", str(e).splitlines()[0] if str(e) else e)
        os._exit(PEER_EXIT)

    host, port = parse_tcp(cfg.engine.dist_init_method)
    start_heartbeat(host, port, rank_beat_key(cfg.replica, cfg.engine.tp_info.rank),
                    cfg.engine.dist_timeout_s, lost)


def set_cpu_threads(cfg: EngineConfig, ranks_on_host: int, log: logging.Logger) -> None:
    """Size torch's thread pool (`cpu_threads.choose_threads`) for `ranks_on_host` ranks
    sharing this host's cores: on the CPU device, or wherever `cpu_threads` is given."""
    if cfg.device != "cpu" and cfg.cpu_threads is None:
        return
    choice = choose_threads(cfg.cpu_threads, ranks_on_host)
    torch.set_num_threads(choice.threads)
    log.debug("%d torch threads (%s)", choice.threads, choice.source)


def _progress(conn: Any, name: str) -> Callable[[str], None]:
    """Start-up steps to the parent, which shows them (`server.proc.wait_ready`)."""
    return lambda text: conn.send(("progress", name, text))


def run_rank(cfg: SchedulerConfig, conn: Any, pulse: Optional[Pulse] = None) -> None:
    """Process entry, started through `server.proc.spawn` (which names the process, sets up its
    logging and watches its parent); `conn` carries the start-up report; the scheduler tells
    `pulse` (the one `spawn` beats, if given) when its steps begin and end."""
    rank = cfg.engine.tp_info.rank
    name = f"rank{rank}"
    log = logging.getLogger("minisgl.scheduler")
    set_cpu_threads(cfg.engine, cfg.node_ranks or cfg.engine.tp_info.size, log)
    # A rank fails deep in a device or a weight file: its traceback is worth an error line.
    with report_startup(conn, name, log, logging.ERROR):
        info = cfg.engine.tp_info
        groups = init_process_groups(info, cfg.engine.torch_device, cfg.engine.dist_init_method,
                                     cfg.engine.dist_timeout_s, cfg.engine.allreduce_mode,
                                     store_prefix=cfg.engine.dist_store_prefix)
        if cfg.engine.dist_store_prefix is not None:
            _beat(cfg, log)
        peers = _peers(groups.cpu_group, info.rank, info.size)
        if peers.on_host > (cfg.node_ranks or info.size):  # nodes sharing a host
            set_cpu_threads(cfg.engine, peers.on_host, log)
        threading.Thread(target=_watch_peers, args=(peers.pids, log), daemon=True).start()
        engine = Engine(cfg.engine, groups, _progress(conn, name) if info.rank == 0
                        else lambda text: None, mixed_rows=cfg.mixed_rows,
                        verify_tokens=cfg.verify_tokens, verify_requests=cfg.verify_requests,
                        draft_path=cfg.draft_model_path, draft_method=cfg.draft_method)
        io = ZmqIO(cfg.engine.tp_info, cfg.backend_addr or "", cfg.detokenizer_addr or "",
                   cfg.broadcast_addr, groups.cpu_group, cfg.subscriber_timeout_s,
                   cfg.broadcast_remote_addr)
        timer = (StatsTimer(cfg.detokenizer_addr, cfg.stats_interval)
                 if info.is_primary and cfg.detokenizer_addr else None)
        scheduler = Scheduler(cfg, engine, io, groups.cpu_group,
                              timer.post if timer is not None else None)
        if timer is not None:
            timer.start()
    freeze_startup_heap(log, name)
    conn.send(("ready", name, {"limits": scheduler.limits,
                               "torch_threads": torch.get_num_threads()}))
    try:
        scheduler.run_forever(pulse)
    except BaseException as e:
        # Not sys.exit: the interpreter's teardown runs beside daemon threads (heartbeats, the
        # peer watch, gloo's) still busy with the broken groups, and can abort the process
        # (SIGABRT), which its launcher would then blame on this rank, not on the cause.
        exit_now(log_failure(log, rank, e))
    if timer is not None:
        timer.close()
    io.close()
    destroy_process_groups()
    exit_now(0)  # released all it holds: the launcher need not wait for torch's teardown
