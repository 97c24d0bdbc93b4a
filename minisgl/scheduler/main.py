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
from typing import Any

from minisgl.distributed import destroy_process_groups, init_process_groups
from minisgl.engine import Engine
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import ZmqIO
from minisgl.scheduler.scheduler import Scheduler


def setup_logging(tag: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), force=True, stream=sys.stderr,
                        format=f"%(asctime)s [{tag}] %(levelname)s %(name)s: %(message)s")


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose parent died would wait forever on its sockets: end it instead."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def run_rank(cfg: SchedulerConfig, ready: Any, log_level: str = "INFO") -> None:
    rank = cfg.engine.tp_info.rank
    setup_logging(f"rank{rank}", log_level)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    log = logging.getLogger("minisgl.scheduler")
    try:
        groups = init_process_groups(cfg.engine.tp_info, cfg.engine.torch_device,
                                     cfg.engine.dist_init_method, cfg.engine.dist_timeout_s)
        engine = Engine(cfg.engine, groups)
        io = ZmqIO(cfg.engine.tp_info, cfg.backend_addr or "", cfg.detokenizer_addr or "",
                   cfg.broadcast_addr, groups.cpu_group, cfg.subscriber_timeout_s)
        scheduler = Scheduler(cfg, engine, io)
    except BaseException as e:
        log.exception("rank %d failed to start", rank)
        ready.send(("error", rank, f"{type(e).__name__}: {e}"))
        sys.exit(1)
    ready.send(("ready", rank, {"num_pages": engine.num_pages,
                                "max_context": engine.max_context}))
    try:
        scheduler.run_forever()
    except BaseException:
        log.exception("rank %d failed", rank)
        sys.exit(1)
    io.close()
    destroy_process_groups()
