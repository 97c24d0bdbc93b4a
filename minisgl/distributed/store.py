"""The TCP store of a service spread over nodes (torch.distributed's `TCPStore`, hosted by node
0's launcher at `--dist-init-addr`): connecting to it, and the heartbeats every launcher and
every rank process write into it.

A heartbeat is a counter under its own key that the beating process adds 1 to every
`BEAT_INTERVAL_S`; a watcher that sees a counter stand still for longer than its timeout knows
the process is dead or hung (no clock is compared between hosts). Each thread that talks to the
store opens its own connection (`connect`).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import TYPE_CHECKING, Callable, Tuple

from minisgl.distributed.bind import split_host_port

if TYPE_CHECKING:  # imported on the first connection: a one-node launcher never needs torch
    import torch.distributed as dist

BEAT_INTERVAL_S = 0.5


def parse_tcp(init_method: str) -> Tuple[str, int]:
    """("host", port) of "tcp://host:port" ("tcp://[v6]:port" too); ValueError naming it when
    it is not one."""
    return split_host_port(init_method.removeprefix("tcp://"), "the rendezvous init_method")


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection to the store at host:port, retried until it is up or `timeout_s`
    passes (then torch's DistStoreError / DistNetworkError); `timeout_s` also bounds every
    later call."""
    import torch.distributed as dist
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def rank_beat_key(replica: int, rank: int) -> str:
    return f"beat/replica{replica}/rank{rank}"


def start_heartbeat(host: str, port: int, key: str, timeout_s: float,
                    on_lost: Callable[[BaseException], None]) -> threading.Thread:
    """Beat under `key` from a daemon thread with its own connection until the store goes away,
    then call `on_lost` with the error (once) and stop."""
    def beat() -> None:
        try:
            store = connect(host, port, timeout_s)
            while True:
                store.add(key, 1)
                time.sleep(BEAT_INTERVAL_S)
        except Exception as e:  # the store (node 0's launcher) is gone
            on_lost(e)

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat {key}")
    thread.start()
    return thread
