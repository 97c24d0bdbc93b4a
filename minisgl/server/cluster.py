"""The launchers of a service spread over nodes: their meeting, and how each learns of a failure.

Node 0's launcher hosts the torch.distributed TCP store at `--dist-init-addr`
(`distributed/store.py`); the other launchers connect to it, in any order, within
`--dist-timeout`. Each writes its node's fingerprint (the model's shape and every setting the
ranks must share: `fingerprint`) under `node/N`, waits until every node has, and compares them
with node 0's: a node that never arrives or a fingerprint that differs is a `StartupError` on
every node that came, naming the address and the missing nodes, or both values.

While the service runs, a watcher thread per launcher (its own store connection) beats
`beat/nodeN` every `BEAT_INTERVAL_S` and finds, in this order of precedence:
- a failure report under `failure`: the first launcher to see a failure writes it (`report`,
  compare-and-set: later reports keep the first) and every other launcher reads it;
- a launcher that stopped beating for `dist_timeout` (node 0 watches every node, the others
  node 0), or one of this node's ranks that did (a hung rank: `distributed/store.py` beats);
- the store gone (only node 0's launcher can take it away: node 0 is gone).
Node 0 writes `shutdown` before a clean stop, so its ranks ending is no failure elsewhere; each
other node answers `left/N` once it saw it, and node 0 keeps the store up until they all have
(`await_departures`, bounded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional

from minisgl.distributed.bind import listening_socket
from minisgl.distributed.store import BEAT_INTERVAL_S, connect
from minisgl.models.config import ModelConfig
from minisgl.server.proc import StartupError
from minisgl.server.topology import ClusterConfig, resolve_host

if TYPE_CHECKING:  # imported when node 0 opens the store: a one-node launcher never needs torch
    import torch.distributed as dist

logger = logging.getLogger("minisgl.launcher")
FAILURE_KEY = "failure"
SHUTDOWN_KEY = "shutdown"
_MET_WAIT_S = 5.0  # node 0 waits this long for every node to have compared, before failing
_LEAVE_WAIT_S = 3.0  # and this long, on a clean stop, for every node to have seen it
# Settings a node may choose for itself: the KV pool is agreed at start-up (the minimum over
# ranks), and GEMM tuning only picks a library per rank.
NODE_LOCAL_SETTINGS = frozenset({"mem_fraction", "max_kv_tokens", "tune_gemms"})


def fingerprint(settings: Mapping[str, Any], model: ModelConfig) -> Dict[str, str]:
    """What every node must agree on: `settings` (the scheduler's, resolved device and dtype,
    the cluster's shape) but the node-local ones, and the model's shape (not its path)."""
    out = {k: repr(v) for k, v in settings.items() if k not in NODE_LOCAL_SETTINGS}
    out.update({f"model {k}": repr(v) for k, v in dataclasses.asdict(model).items()})
    return out


def mismatch(prints: Mapping[int, Mapping[str, str]]) -> Optional[str]:
    """The first difference between a node's fingerprint and node 0's, in words, or None."""
    head = prints[0]
    for node in sorted(prints):
        for key in sorted(set(head) | set(prints[node])):
            ours, theirs = head.get(key, "unset"), prints[node].get(key, "unset")
            if ours != theirs:
                return (f"node {node} was started with {key} {theirs} but node 0 with {key} "
                        f"{ours}: every node needs the same model and settings")
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class Cluster:
    """One launcher's link to the others. `meet` once, then `start_watch`; `failure` is what
    the watcher found (None while all is well); `close` last (node 0's closes the store)."""

    def __init__(self, cfg: ClusterConfig, prints: Dict[str, str]) -> None:
        self.cfg = cfg
        self.node = cfg.node_rank
        self.host, self.port = cfg.store_addr
        self.addr = cfg.dist_init_addr
        self.prints = prints
        self.store: Optional[dist.TCPStore] = None
        self._found: Optional[str] = None  # the watcher's finding
        self._shutdown = False
        self._closed = threading.Event()
        self._ranks: Dict[str, str] = {}  # beat key -> "rank3 (pid 1234)"
        self._beats: Dict[str, List[float]] = {}  # beat key -> [value, when it last changed]

    # --- start-up ------------------------------------------------------------------------------
    def meet(self, should_stop: Callable[[], bool]) -> None:
        """Join the other nodes and compare fingerprints (StartupError on a failure)."""
        deadline = time.monotonic() + self.cfg.dist_timeout
        self.store = self._open_store(deadline, should_stop)
        self.store.set(f"node/{self.node}", json.dumps(self.prints))
        self._wait_for("node", deadline, should_stop)
        prints = {n: json.loads(self.store.get(f"node/{n}")) for n in range(self.cfg.nnodes)}
        self.store.set(f"met/{self.node}", "1")
        if self.cfg.is_head:  # keep the store up until every node has read the fingerprints
            with contextlib.suppress(StartupError, RuntimeError):
                self._wait_for("met", time.monotonic() + _MET_WAIT_S, should_stop)
        problem = mismatch(prints)
        if problem is not None:
            raise StartupError(problem)

    def _open_store(self, deadline: float, should_stop: Callable[[], bool]) -> dist.TCPStore:
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=self.cfg.dist_timeout)
        if self.cfg.is_head:
            try:  # on the given address only (torch's own socket would take every address)
                fd = listening_socket(resolve_host(self.host), self.port).detach()
                return dist.TCPStore(self.host, self.port, is_master=True,
                                     wait_for_workers=False, timeout=timeout,
                                     master_listen_fd=fd)
            except (OSError, RuntimeError, ValueError) as e:
                raise StartupError(f"cannot listen for the other nodes on {self.addr}: "
                                   f"{_first_line(e)}") from None
        while True:  # short attempts, so that a signal is noticed
            if should_stop():
                raise StartupError("interrupted during start-up")
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupError(f"node {self.node} could not reach node 0 at {self.addr} "
                                   f"within {self.cfg.dist_timeout:g} s (dist_timeout)")
            try:
                store = connect(self.host, self.port, min(1.0, left))
            except (RuntimeError, ValueError):  # torch's DistError is a RuntimeError
                continue
            store.set_timeout(timeout)
            return store

    def _wait_for(self, prefix: str, deadline: float, should_stop: Callable[[], bool]) -> None:
        assert self.store is not None
        while True:
            missing = [n for n in range(self.cfg.nnodes)
                       if not self.store.check([f"{prefix}/{n}"])]
            if not missing:
                return
            if should_stop():
                raise StartupError("interrupted during start-up")
            if time.monotonic() > deadline:
                came = [n for n in range(self.cfg.nnodes) if n not in missing]
                raise StartupError(
                    f"{_nodes(missing)} of {self.cfg.nnodes} did not arrive at {self.addr} "
                    f"within {self.cfg.dist_timeout:g} s (dist_timeout; arrived: "
                    f"{_nodes(came)})")
            time.sleep(0.1)

    # --- while serving -------------------------------------------------------------------------
    def start_watch(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="cluster watch").start()

    def watch_ranks(self, ranks: Dict[str, str]) -> None:
        """Also watch these local ranks' beats ({beat key: how to name the rank})."""
        self._ranks = dict(ranks)

    def failure(self) -> Optional[str]:
        return self._found

    @property
    def shutting_down(self) -> bool:
        """Node 0 announced a clean stop."""
        return self._shutdown or self._read_shutdown()

    def report(self, message: str) -> str:
        """Tell every node about a failure; the first report any node made (maybe this one)."""
        if self.store is None:
            return message
        try:
            return self.store.compare_set(FAILURE_KEY, "", message).decode()
        except RuntimeError:  # the store is gone: nobody else to tell
            return message

    def announce_shutdown(self) -> None:
        with contextlib.suppress(RuntimeError):  # the store is gone: nobody else to tell
            if self.store is not None:
                self.store.set(SHUTDOWN_KEY, "1")

    def await_departures(self) -> None:
        """Node 0, stopping cleanly: wait (bounded) until every node saw the announcement."""
        with contextlib.suppress(StartupError, RuntimeError):
            if self.store is not None:
                self.store.set(f"left/{self.node}", "1")
                self._wait_for("left", time.monotonic() + _LEAVE_WAIT_S, lambda: False)

    def silent_nodes(self, for_s: float) -> List[int]:
        """The watched nodes whose launcher has not beaten for `for_s` seconds."""
        now = time.monotonic()
        return [int(key.rsplit("node", 1)[1]) for key, (_, since) in list(self._beats.items())
                if key.startswith("beat/node") and now - since > for_s]

    def close(self) -> None:
        self._closed.set()
        self.store = None  # node 0: the store closes with the last reference

    def _read_shutdown(self) -> bool:
        try:
            return self.store is not None and self.store.check([SHUTDOWN_KEY])
        except Exception:
            return False

    def _watch(self) -> None:
        try:
            store = connect(self.host, self.port, self.cfg.dist_timeout)
            peers = (range(1, self.cfg.nnodes) if self.cfg.is_head else [0])
            while not self._closed.is_set():
                store.add(f"beat/node{self.node}", 1)
                if not self._shutdown and store.check([SHUTDOWN_KEY]):
                    store.set(f"left/{self.node}", "1")
                    self._shutdown = True
                if store.check([FAILURE_KEY]):
                    self._found = store.get(FAILURE_KEY).decode()
                    return
                named = {f"beat/node{n}": f"node {n}'s launcher" for n in peers}
                named.update({k: f"node {self.node}: {v}" for k, v in self._ranks.items()})
                stale = self._stale(store, named)
                if stale is not None:
                    self._found = (f"{stale} stopped answering for "
                                   f"{self.cfg.dist_timeout:g} s (dist_timeout)")
                    return
                self._closed.wait(BEAT_INTERVAL_S)
        except Exception as e:
            if not self._closed.is_set():
                logger.debug("the store at %s failed: %s", self.addr, _first_line(e))
                self._found = f"lost the connection to node 0 at {self.addr}: node 0 is gone"

    def _stale(self, store: dist.TCPStore, named: Dict[str, str]) -> Optional[str]:
        """The first of the watched beats that stood still for dist_timeout, by its name."""
        now = time.monotonic()
        for key, name in named.items():
            if not store.check([key]):
                continue  # not beating yet (still starting)
            value = float(store.add(key, 0))
            seen = self._beats.get(key)
            if seen is None or seen[0] != value:
                self._beats[key] = [value, now]
            elif now - seen[1] > self.cfg.dist_timeout:
                return name
        return None


def _nodes(nodes: List[int]) -> str:
    if not nodes:
        return "none"
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(map(str, nodes))

