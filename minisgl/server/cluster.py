"""The launchers of a service spread over nodes: their meeting, and how each learns of a failure.

Node 0's launcher hosts the torch.distributed TCP store at `--dist-init-addr`
(`distributed/store.py`); the other launchers connect to it, in any order, within
`--dist-timeout`. A node waiting for node 0's store probes its port with a plain socket
before it connects (torch's client logs a warning and a C++ stack for every failed attempt).
Each writes its node's fingerprint (the model's shape and every setting the ranks must share:
`fingerprint`) under `node/N`, waits until every node has, and compares them with node 0's: a
node that never arrives or a fingerprint that differs is a `StartupError` on every node that
came, naming the address and the missing nodes, or both values. Node 0 giving up writes its
reason under `failure` and keeps the store up until the nodes that came have read it (they
answer `left/N`), so that none sees the store close under it.

While the service runs, a watcher thread per launcher (its own store connection) beats
`beat/nodeN` every `BEAT_INTERVAL_S` and finds, in this order of precedence:
- a failure report under `failure`: the first launcher to see a failure writes it (`report`,
  compare-and-set: later reports keep the first) and every other launcher reads it;
- a launcher that stopped beating for `dist_timeout` (node 0 watches every node, the others
  node 0), or one of this node's ranks that did (a hung rank: `distributed/store.py` beats);
- the store gone (only node 0's launcher can take it away: node 0 is gone).
A node whose rank only followed another's failure (`PEER_EXIT`) and that found no cause itself
does not report that follower: it writes it under `secondary` (`report_secondary`) and waits for
node 0, the one launcher that watches every node's heartbeat, to decide (`_decide`): a node
whose launcher went silent (the usual cause: that node was killed and its ranks with it), else,
after `_DECIDE_S`, that report. So a follower never wins over the node that failed first.
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
import socket
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
SECONDARY_KEY = "secondary"  # the first report of a failure that only followed another's
SHUTDOWN_KEY = "shutdown"
_MET_WAIT_S = 5.0  # node 0 waits this long for every node to have compared, before failing
_LEAVE_WAIT_S = 3.0  # and this long, on a clean stop or a failed meeting, for every node to see it
_PROBE_EVERY_S = 0.2  # a node waiting for node 0's store probes its port this often
_SILENT_S = 3 * BEAT_INTERVAL_S  # a launcher this long without a beat, amid a failure, is gone
_DECIDE_S = 2.0  # node 0 names a follower's report after this long with no silent node
_AWAIT_DECISION_S = 3 * _DECIDE_S  # a follower's node waits this long for node 0's decision
# Settings a node may choose for itself: the KV pool is agreed at start-up (the minimum over
# ranks), and GEMM tuning only picks a library per rank.
NODE_LOCAL_SETTINGS = frozenset({"mem_fraction", "gpu_memory_utilization", "max_kv_tokens",
                                 "kv_cache_memory", "tune_gemms"})


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


def node_gone(node: int) -> str:
    """The failure named when node `node`'s launcher went silent while ranks failed."""
    return f"node {node}'s launcher stopped answering (the node is gone)"


def _accepts(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at host:port (the probe is closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


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
        self._secondary_since: Optional[float] = None  # node 0: when it saw a follower's report
        self._shutdown = False
        self._closed = threading.Event()
        self._ranks: Dict[str, str] = {}  # beat key -> "rank3 (pid 1234)"
        self._beats: Dict[str, List[float]] = {}  # beat key -> [value, when it last changed]

    # --- start-up ------------------------------------------------------------------------------
    def meet(self, should_stop: Callable[[], bool],
             show: Callable[[str], None] = logger.info) -> None:
        """Join the other nodes and compare fingerprints (StartupError on a failure, with a
        one-line reason, also when node 0 gives up or goes away meanwhile). `show` gets one line
        for each wait that does not end at once: node 0 not up yet, nodes not arrived yet."""
        deadline = time.monotonic() + self.cfg.dist_timeout
        self.store = self._open_store(deadline, should_stop, show)
        try:
            prints = self._exchange(deadline, should_stop, show)
        except StartupError as e:
            if self.cfg.is_head:
                self._give_up(str(e))
            else:
                self._leave()
            raise
        except RuntimeError as e:  # torch's DistError: node 0's store closed under this node
            if self.cfg.is_head:
                raise
            raise StartupError(f"node 0 closed the meeting at {self.addr} before every node "
                               f"arrived (node 0 is gone): {_first_line(e)}") from None
        problem = mismatch(prints)
        if problem is not None:
            raise StartupError(problem)

    def _exchange(self, deadline: float, should_stop: Callable[[], bool],
                  show: Callable[[str], None]) -> Dict[int, Dict[str, str]]:
        """Write this node's fingerprint, wait for every node's, and return them by node."""
        assert self.store is not None
        self.store.set(f"node/{self.node}", json.dumps(self.prints))
        self._wait_for("node", deadline, should_stop, show)
        prints = {n: json.loads(self.store.get(f"node/{n}")) for n in range(self.cfg.nnodes)}
        self.store.set(f"met/{self.node}", "1")
        if self.cfg.is_head:  # keep the store up until every node has read the fingerprints
            with contextlib.suppress(StartupError, RuntimeError):
                self._wait_for("met", time.monotonic() + _MET_WAIT_S, should_stop)
        return prints

    def _give_up(self, message: str) -> None:
        """Node 0 failing the meeting: tell the nodes that came why (else they would see the
        store close under them) and keep the store up until they have read it (bounded)."""
        assert self.store is not None
        with contextlib.suppress(StartupError, RuntimeError):
            came = [n for n in range(1, self.cfg.nnodes) if self.store.check([f"node/{n}"])]
            self.store.set(FAILURE_KEY, message)
            self._wait_for("left", time.monotonic() + _LEAVE_WAIT_S, lambda: False, nodes=came)

    def _leave(self) -> None:
        """A node other than 0 failing the meeting: node 0 need not wait for it to read why."""
        with contextlib.suppress(RuntimeError):
            if self.store is not None:
                self.store.set(f"left/{self.node}", "1")

    def _open_store(self, deadline: float, should_stop: Callable[[], bool],
                    show: Callable[[str], None]) -> dist.TCPStore:
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
        shown = False
        while True:  # short attempts, so that a signal is noticed
            if should_stop():
                raise StartupError("interrupted during start-up")
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupError(f"node {self.node} could not reach node 0 at {self.addr} "
                                   f"within {self.cfg.dist_timeout:g} s (dist_timeout)")
            if not _accepts(self.host, self.port, min(1.0, left)):
                if not shown:
                    show(f"waiting for node 0 at {self.addr} (up to "
                         f"{self.cfg.dist_timeout:g} s, dist_timeout)")
                    shown = True
                time.sleep(min(_PROBE_EVERY_S, left))
                continue
            try:
                store = connect(self.host, self.port, min(1.0, left))
            except (RuntimeError, ValueError):  # torch's DistError is a RuntimeError
                continue
            store.set_timeout(timeout)
            return store

    def _wait_for(self, prefix: str, deadline: float, should_stop: Callable[[], bool],
                  show: Optional[Callable[[str], None]] = None,
                  nodes: Optional[List[int]] = None) -> None:
        """Until each of `nodes` (every node by default) has written `prefix/N`; `show` gets one
        line if some have not at the first look. StartupError once `should_stop`, past
        `deadline`, or (on another node) when node 0 gave up (`_give_up`: its reason)."""
        assert self.store is not None
        nodes = list(range(self.cfg.nnodes)) if nodes is None else nodes
        while True:
            missing = [n for n in nodes if not self.store.check([f"{prefix}/{n}"])]
            if not missing:
                return
            if not self.cfg.is_head and self.store.check([FAILURE_KEY]):
                raise StartupError(f"node 0: {self.store.get(FAILURE_KEY).decode()}")
            if should_stop():
                raise StartupError("interrupted during start-up")
            if time.monotonic() > deadline:
                came = [n for n in range(self.cfg.nnodes) if n not in missing]
                raise StartupError(
                    f"{_nodes(missing)} of {self.cfg.nnodes} did not arrive at {self.addr} "
                    f"within {self.cfg.dist_timeout:g} s (dist_timeout; arrived: "
                    f"{_nodes(came)})")
            if show is not None:
                show(f"waiting for {_nodes(missing)} to arrive at {self.addr} (up to "
                     f"{self.cfg.dist_timeout:g} s, dist_timeout)")
                show = None
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

    def report_secondary(self, message: str) -> str:
        """Report a failure that only followed another's (a rank that exited with PEER_EXIT,
        its cause not seen here) and return what every node names: node 0's decision
        (`_decide`), or, if none comes within `_AWAIT_DECISION_S`, the first report."""
        if self.store is None:
            return message
        deadline = time.monotonic() + _AWAIT_DECISION_S
        try:
            self.store.compare_set(SECONDARY_KEY, "", message)
            while time.monotonic() < deadline:
                if self.store.check([FAILURE_KEY]):
                    return self.store.get(FAILURE_KEY).decode()
                if self._found is not None:  # the watcher found a cause it does not write
                    return self.report(self._found)
                time.sleep(0.1)
        except RuntimeError:  # the store is gone: node 0 is
            return self._found or self._lost()
        return self.report(message)

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

    def _silent_nodes(self, for_s: float) -> List[int]:
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
                decided = self._decide(store) if self.cfg.is_head else None
                if decided is not None:
                    self._found = store.compare_set(FAILURE_KEY, "", decided).decode()
                    return
                self._closed.wait(BEAT_INTERVAL_S)
        except Exception as e:
            if not self._closed.is_set():
                logger.debug("the store at %s failed: %s", self.addr, _first_line(e))
                self._found = self._lost()

    def _lost(self) -> str:
        return f"lost the connection to node 0 at {self.addr}: node 0 is gone"

    def _decide(self, store: dist.TCPStore) -> Optional[str]:
        """Node 0, once a node reported a failure that only followed another's: what every node
        names, when known. A launcher silent for `_SILENT_S` (this turn's beats are read) is
        the cause; with none for `_DECIDE_S`, the follower's report stands (a primary failure
        would have been reported at once, and the follower's node waited a grace for one)."""
        if not store.check([SECONDARY_KEY]):
            return None
        now = time.monotonic()
        if self._secondary_since is None:
            self._secondary_since = now
        silent = self._silent_nodes(_SILENT_S)
        if silent:
            return node_gone(silent[0])
        if now - self._secondary_since >= _DECIDE_S:
            return store.get(SECONDARY_KEY).decode()
        return None

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

