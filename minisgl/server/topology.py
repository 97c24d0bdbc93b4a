"""Where a service's ranks run: the cluster section of the config tree and each node's share.

A service is `dp` replicas (independent copies of the model behind one API server), each a
tensor-parallel group of `tp` ranks. The ranks are spread over `nnodes` nodes: node n runs ranks
n*k .. n*k+k-1 (k = tp / nnodes) of every replica, so rank 0 of every replica, the API server,
the tokenizer and the detokenizer run on node 0. On a GPU node a rank uses the device at its
index among that node's ranks (replica-major), not its global rank.

With nnodes > 1 the nodes meet at `dist_init_addr` (HOST:PORT on node 0): PORT is the
torch.distributed TCP store node 0's launcher hosts (the launchers' meeting and heartbeats, and
every replica's rendezvous under its own key prefix), and replica d's rank 0 publishes its
broadcast (XPUB) for the ranks on other nodes at HOST:`broadcast_port(d)`. With nnodes == 1 none
of this applies: ipc:// sockets and a rendezvous on 127.0.0.1, as for one machine.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

from minisgl.distributed.bind import split_host_port
from minisgl.settings import setting


class RankPlace(NamedTuple):
    """One rank process of a node: which replica, its rank in that replica's TP group, and its
    device index on the node."""
    replica: int
    rank: int
    device_index: int


class Wiring(NamedTuple):
    """What a rank process needs beyond its config section to join its replica: the
    rendezvous (`store_prefix` None: rank 0 hosts it at `dist_init_method`, one machine; else the
    ranks join node 0's TCP store there under that prefix), the thread budget of its host, and
    rank 0's extra broadcast endpoint for other nodes (tcp://, or None)."""
    replica: int = 0
    device_index: Optional[int] = None  # None: the rank's own number
    node_ranks: int = 0  # rank processes this launcher runs (0: tp)
    store_prefix: Optional[str] = None
    broadcast_remote: Optional[str] = None


@dataclass(frozen=True)
class ClusterConfig:
    dp: int = setting(1, "data-parallel replicas: independent copies of the model (each of tp "
                         "ranks) behind one API server; each request goes to the replica most "
                         "likely to hold its prompt's prefix in its cache, else to the least "
                         "loaded", also=("data-parallel-size", "dp-size"))
    nnodes: int = setting(1, "nodes the ranks are spread over: each runs tp/nnodes ranks of "
                             "every replica; node 0 also runs the API server")
    node_rank: int = setting(0, "this node's index in [0, nnodes): 0 serves HTTP, the others "
                                "run only their ranks")
    dist_init_addr: Optional[str] = setting(
        None, "HOST:PORT of node 0 where the nodes meet (a torch.distributed TCP store on "
              "PORT); needed with nnodes > 1. Other nodes must reach PORT and the broadcast "
              "ports (dist_broadcast_port)")
    dist_broadcast_port: Optional[int] = setting(
        None, "first port of rank 0's broadcast to the ranks on other nodes, one per replica on "
              "node 0 (unset: dist_init_addr's PORT + 1)")
    pipeline_parallel_size: int = setting(
        1, "vLLM's: 1 only (pipeline parallelism is not served: --tp splits a model over the "
           "GPUs, of one node or of --nnodes)", also=("pp-size",))
    distributed_executor_backend: str = setting(
        "mp", "vLLM's: mp, a process per rank, which is how minisgl always runs (ray and the "
              "others are refused)")
    dist_timeout: float = setting(60.0, "seconds to wait for the other nodes and ranks at "
                                        "start-up and for a collective, and after which a "
                                        "silent node or rank stops the service")

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is out of range for nnodes "
                             f"{self.nnodes}: it must be in [0, {self.nnodes})")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size}: pipeline "
                             f"parallelism is not served; split the model with --tp (over "
                             f"nodes too, with --nnodes)")
        if self.distributed_executor_backend != "mp":
            raise ValueError(f"distributed_executor_backend "
                             f"{self.distributed_executor_backend!r} is not served: minisgl's "
                             f"launcher runs a process per rank (mp)")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.dist_broadcast_port is not None and not (
                0 < self.dist_broadcast_port <= 65536 - self.dp):
            raise ValueError(f"dist_broadcast_port must leave one port per replica (dp "
                             f"{self.dp}) in [1, 65535], got {self.dist_broadcast_port}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(f"nnodes {self.nnodes} needs dist_init_addr (HOST:PORT of node 0)")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr, "dist_init_addr")

    # --- derived values ------------------------------------------------------------------------
    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def is_head(self) -> bool:
        """This node runs the API server, tokenizer and detokenizer (node 0)."""
        return self.node_rank == 0

    @property
    def store_addr(self) -> Tuple[str, int]:
        """(host, port) of the TCP store on node 0 (multi-node only)."""
        assert self.dist_init_addr is not None, "multi-node configs have an address"
        return split_host_port(self.dist_init_addr, "dist_init_addr")

    def check_tp(self, tp: int) -> None:
        """ValueError naming both values when `tp` ranks cannot be spread over the nodes."""
        if tp % self.nnodes != 0:
            raise ValueError(f"tp {tp} is not divisible by nnodes {self.nnodes}: every node runs "
                             f"tp/nnodes ranks")

    def ranks_per_node(self, tp: int) -> int:
        return tp // self.nnodes

    def local_ranks(self, tp: int) -> List[RankPlace]:
        """This node's rank processes, replica by replica, in rank order."""
        k = self.ranks_per_node(tp)
        return [RankPlace(d, self.node_rank * k + j, d * k + j)
                for d in range(self.dp) for j in range(k)]

    def broadcast_port(self, replica: int) -> int:
        base = self.dist_broadcast_port or self.store_addr[1] + 1
        return base + replica

    def broadcast_tcp_addr(self, replica: int) -> str:
        """Replica `replica`'s rank 0 broadcast for other nodes: node 0's address, resolved (a
        ZMQ bind wants an address, not a name)."""
        host = resolve_host(self.store_addr[0])
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.broadcast_port(replica)}"


def resolve_host(host: str) -> str:
    """`host` as a numeric address; ValueError naming it when it does not resolve."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r}: {e.strerror}") from None


def rank_name(place: RankPlace, dp: int) -> str:
    """A rank process's name in logs, ps and errors: rank3, or dp1-rank3 with replicas."""
    return f"rank{place.rank}" if dp == 1 else f"dp{place.replica}-rank{place.rank}"
