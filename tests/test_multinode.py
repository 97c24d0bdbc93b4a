"""Tensor parallelism over two nodes: two launchers on this machine, gloo and TCP on 127.0.0.1.

Each launcher is a node (`--nnodes 2 --node-rank R --dist-init-addr 127.0.0.1:P`), with its own
runtime directory. Node 0 serves HTTP; node 1 runs only its ranks. Covered: the greedy outputs
of tp=1 at tp=4 (KV heads replicated: the tiny Qwen3 has 2), either start order (a waiting node
says so once, without torch's retry warnings), a node that never arrives (also a third one, while
node 1 waits with node 0, and node 0 vanishing under a waiting node), a rank killed on node 1
while requests are in flight (tp=2; its followers log one line each), the start-up checks of the
cluster settings, and over three nodes which failure every node names: a killed node's, never a
rank that only followed it (in-process launchers' `Cluster`s and a real one).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import httpx
import pytest

from server_helpers import (CPU_ARGS, NODE_READY, READY, REPO, Server, check_same_as_tp1, comm,
                            error_line, gone, run_serve, runtime_dirs)
from shutdown_helpers import listeners

from minisgl.distributed.bind import address_towards, is_loopback, listening_socket
from minisgl.distributed.store import parse_tcp
from minisgl.distributed.bind import free_port
from minisgl.message.startup import PEER_EXIT
from minisgl.server.cluster import Cluster, node_gone
from minisgl.server.proc import StartupError
from minisgl.server.topology import ClusterConfig

TIMEOUT = ("--dist-timeout", "30")


def _addr(host: str = "127.0.0.1") -> Tuple[str, List[str]]:
    """A meeting address and the flags naming it (the broadcast port picked free too)."""
    addr = f"{host}:{free_port()}"
    return addr, ["--dist-init-addr", addr, "--dist-broadcast-port", str(free_port())]


def node_args(model: Path, tp: int, node: int, where: Sequence[str], *extra: str,
              nnodes: int = 2) -> List[str]:
    return ["--model", str(model), "--tp", str(tp), "--nnodes", str(nnodes), "--node-rank",
            str(node), *where, *CPU_ARGS, *TIMEOUT, *extra]


@contextlib.contextmanager
def two_nodes(model: Path, tp: int, tmp_path: Path, first: int, host: str = "127.0.0.1"
              ) -> Iterator[Tuple[Server, Server]]:
    """Node 0 and node 1 of one service meeting at `host`, node `first` started first; both
    stopped after the body (node 0 by SIGTERM, after which node 1 must exit 0 by itself)."""
    _, where = _addr(host)
    starting = {}
    for node in (first, 1 - first):
        starting[node] = Server.begin(node_args(model, tp, node, where), tmp_path / f"node{node}",
                                      READY if node == 0 else NODE_READY)
        time.sleep(1.0 if node == first else 0.0)
    try:
        head, worker = starting[0].ready(), starting[1].ready()
    except BaseException:
        for s in starting.values():
            s.proc.kill()
        raise
    try:
        yield head, worker
    except BaseException:
        for srv in (head, worker):
            with contextlib.suppress(Exception):
                srv.kill_all()
        raise
    assert head.stop().code == 0, head.stderr()[-3000:]
    assert worker.proc.wait(timeout=20) == 0, worker.stderr()[-3000:]
    assert gone(head.children + worker.children, within_s=5.0)
    assert runtime_dirs(head.tmp_dir) == [] and runtime_dirs(worker.tmp_dir) == []


# --- the same tokens as tp=1 ----------------------------------------------------------------------
def _host_address() -> str:
    """An address of this host other than loopback, where it has one (else 127.0.0.1)."""
    with contextlib.suppress(ValueError):
        addr = address_towards("10.255.255.254")  # no packet is sent
        if not is_loopback(addr):
            return addr
    return "127.0.0.1"


def test_tp4_over_two_nodes_node1_started_first(tmp_path: Path, tiny_qwen3: Path) -> None:
    """Two ranks a node, the tiny Qwen3's 2 KV heads replicated over 4 ranks, node 1's launcher
    waiting for node 0's store; tp=1's greedy answers. Also: every TCP endpoint of the
    launchers and ranks (node 0's store, rank 0's broadcast, gloo on both nodes) listens on the
    address given, none on a wildcard. (Node 0 first: test_kill_9_of_a_rank_on_node_1.)"""
    host = _host_address()
    with two_nodes(tiny_qwen3, 4, tmp_path, first=1, host=host) as (head, worker):
        assert "ranks 2-3 joined" in worker.ready_line, worker.ready_line
        assert httpx.get(f"{head.url}/health").status_code == 200
        check_same_as_tp1(head, tiny_qwen3)
        ranks = [p for p in head.children + worker.children if comm(p).startswith("minisgl-rank")]
        found = listeners([head.proc.pid, worker.proc.pid, *ranks])
        assert len(ranks) == 4 and {lst.pid for lst in found} >= {head.proc.pid, *ranks}, found
        assert all(lst.address == host for lst in found), (host, found)
    # Node 1 waited for node 0's store: one line said so, none of torch's retry warnings.
    assert "[c10d]" not in worker.stderr(), worker.stderr()[-3000:]


# --- a node that never arrives --------------------------------------------------------------------
def test_a_node_that_never_arrives(tmp_path: Path, tiny_qwen3: Path) -> None:
    addr, where = _addr()
    short = ["--dist-timeout", "3"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    t0 = time.monotonic()
    r = run_serve([*node_args(tiny_qwen3, 2, 0, where), *short, "--port", "0"], tmp_path / "a")
    line = error_line(r.stderr)
    assert r.returncode == 1 and "node 1 of 2 did not arrive" in line and addr in line, line
    r = run_serve([*node_args(tiny_qwen3, 2, 1, where), *short], tmp_path / "b")
    line = error_line(r.stderr)
    assert r.returncode == 1 and "could not reach node 0" in line and addr in line, line
    # Waiting for node 0: one line on stdout says so; stderr has only the error line (torch's
    # client logged a warning and a C++ stack for each attempt, every second).
    assert r.stderr.strip() == line, r.stderr[-3000:]
    waits = [ln for ln in r.stdout.splitlines() if "waiting for node 0" in ln]
    assert len(waits) == 1 and addr in waits[0], r.stdout
    assert time.monotonic() - t0 < 60
    assert runtime_dirs(tmp_path / "a") == [] and runtime_dirs(tmp_path / "b") == []


# --- a rank killed on node 1 while requests are in flight -----------------------------------------
def _generate(url: str, stream: bool) -> httpx.Response:
    body = {"input_ids": [1, 2, 3, 4], "stream": stream,
            "sampling_params": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def _in_flight(url: str) -> Tuple[threading.Thread, Dict[str, httpx.Response]]:
    """A long plain request in flight on a thread; its response lands in the dict under "r"."""
    plain: Dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: plain.update(r=_generate(url, False)))
    sender.start()
    return sender, plain


def _stream_killing(url: str, victim: Callable[[], int]) -> Tuple[List[dict], float]:
    """A long stream from `url`; once its tokens flow, SIGKILL the process `victim` names. Its
    events, and when the kill was sent (time.monotonic)."""
    events: List[dict] = []
    t0 = 0.0
    with httpx.stream("POST", f"{url}/generate", timeout=120, json={
            "input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_tokens": 400, "ignore_eos": True}}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:  # tokens are flowing: every rank is in its collectives
                os.kill(victim(), signal.SIGKILL)
                t0 = time.monotonic()
    return events, t0


def test_kill_9_of_a_rank_on_node_1(tmp_path: Path, tiny_qwen3: Path) -> None:
    _, where = _addr()
    head_start = Server.begin(node_args(tiny_qwen3, 2, 0, where), tmp_path / "node0")
    worker = Server.begin(node_args(tiny_qwen3, 2, 1, where), tmp_path / "node1",
                          NODE_READY).ready()
    head = head_start.ready()
    try:
        sender, plain = _in_flight(head.url)
        events, t0 = _stream_killing(head.url, lambda: next(
            p for p in worker.children if comm(p) == "minisgl-rank1"))
        sender.join(timeout=30)
        codes = [head.proc.wait(timeout=15), worker.proc.wait(timeout=15)]
        elapsed = time.monotonic() - t0
    finally:
        for srv in (head, worker):
            if srv.proc.poll() is None:
                srv.kill_all()
    assert codes[0] != 0 and codes[1] != 0 and elapsed < 15, (codes, elapsed)
    for srv in (head, worker):
        line = error_line(srv.stderr())
        assert "node 1: rank1" in line and "signal 9" in line, line
    assert "error" in events[-1] and "node 1" in events[-1]["error"]["message"], events[-1]
    # Rank 0 only followed rank 1: one line, no traceback. Which line depends on what saw the
    # death first: gloo's connection reset, or (both nodes on this one host) its peer watch.
    followed = ("rank 0 failed (another rank failed first): ", "scheduler rank 1 (pid ")
    assert any(f in head.stderr() for f in followed), head.stderr()[-3000:]
    assert "Traceback" not in head.stderr(), head.stderr()[-3000:]
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
    assert "node 1: rank1" in r.json()["error"]["message"]
    assert gone(head.children + worker.children, within_s=5.0)
    assert runtime_dirs(head.tmp_dir) == [] and runtime_dirs(worker.tmp_dir) == []


# --- the cluster settings' checks -----------------------------------------------------------------
def test_tp_not_divisible_by_nnodes_and_node_rank_out_of_range(tmp_path: Path) -> None:
    _, where = _addr()
    r = run_serve(["--tp", "3", "--nnodes", "2", *where, *CPU_ARGS], tmp_path)
    line = error_line(r.stderr)
    assert r.returncode == 2 and "tp 3" in line and "nnodes 2" in line, line
    r = run_serve(["--nnodes", "2", "--node-rank", "2", *where, *CPU_ARGS], tmp_path)
    line = error_line(r.stderr)
    assert r.returncode == 2 and "node_rank 2" in line and "nnodes 2" in line, line


def test_nodes_with_different_page_sizes_both_refuse(tmp_path: Path, tiny_qwen3: Path) -> None:
    _, where = _addr()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "serve"), "--port", "0",
         *node_args(tiny_qwen3, 2, node, where, "--page-size", str(16 * (node + 1)))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        for node in (0, 1)]
    outs = [p.communicate(timeout=120)[1] for p in procs]
    for p, err in zip(procs, outs):
        line = error_line(err)
        assert p.returncode == 1, err[-2000:]
        assert "page_size 32" in line and "page_size 16" in line and "node 1" in line, line
    assert runtime_dirs(tmp_path) == []


def test_the_fingerprint_compares_the_model_shape_not_its_path(tiny_model: Callable[..., Path],
                                                              tmp_path: Path) -> None:
    from minisgl.models.config import ModelConfig
    from minisgl.server.args import parse_args
    from minisgl.server.cluster import mismatch
    from minisgl.server.launch import node_fingerprint

    def fp(model: Path, *flags: str) -> Dict[str, str]:
        cfg = parse_args(["--model", str(model), "--device", "cpu", *flags])
        return node_fingerprint(cfg, ModelConfig.from_dir(model))

    tiny = tiny_model("qwen3")
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    assert mismatch({0: fp(tiny), 1: fp(copy)}) is None  # another path, the same model
    deeper = tiny_model("qwen3", num_hidden_layers=3)
    problem = mismatch({0: fp(tiny), 1: fp(deeper)})
    assert problem is not None and "num_layers 3" in problem and "num_layers 2" in problem
    problem = mismatch({0: fp(tiny), 1: fp(tiny, "--dtype", "bf16")})
    assert problem is not None and "'bfloat16'" in problem and "'float32'" in problem, problem
    assert mismatch({0: fp(tiny), 1: fp(tiny, "--mem-fraction", "0.5")}) is None  # node-local


def test_rendezvous_addresses_parse_as_the_cluster_flag_does() -> None:
    """One HOST:PORT rule (distributed/bind.split_host_port) for --dist-init-addr and the ranks'
    tcp:// init method: brackets around IPv6, a port in range, errors naming the value."""
    assert parse_tcp("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_tcp("tcp://[::1]:29500") == ("::1", 29500)
    for bad in ("tcp://127.0.0.1", "tcp://host:0", "tcp://host:99999", "tcp://:80"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_tcp(bad)


# --- three nodes: who is blamed ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tp3(tiny_model: Callable[..., Path]) -> Path:
    """A tiny Qwen3 that splits over three ranks (6 heads, 3 KV heads, MLP 96 wide)."""
    return tiny_model("qwen3", num_attention_heads=6, num_key_value_heads=3,
                      intermediate_size=96)


def test_kill_9_of_node_2s_launcher_names_node_2_everywhere(tmp_path: Path,
                                                            tiny_tp3: Path) -> None:
    """Three nodes, a rank each, requests in flight; `kill -9` of node 2's launcher (its rank
    follows it). The ranks on nodes 0 and 1 fail only because node 2's did (PEER_EXIT): such a
    follower never wins over the cause, so every launcher's last line and every 503 name node
    2, not a follower rank."""
    _, where = _addr()
    starting = [Server.begin(node_args(tiny_tp3, 3, n, where, nnodes=3), tmp_path / f"node{n}",
                             READY if n == 0 else NODE_READY) for n in range(3)]
    try:
        nodes = [s.ready() for s in starting]
    except BaseException:
        for s in starting:
            s.proc.kill()
        raise
    try:
        sender, plain = _in_flight(nodes[0].url)
        events, t0 = _stream_killing(nodes[0].url, lambda: nodes[2].proc.pid)
        codes = [nodes[0].proc.wait(timeout=30), nodes[1].proc.wait(timeout=30)]
        elapsed = time.monotonic() - t0
        sender.join(timeout=30)
    finally:
        for srv in nodes:
            if srv.proc.poll() is None:
                srv.kill_all()
    assert codes == [1, 1] and elapsed < 15, (codes, elapsed)
    for srv in nodes[:2]:
        line = error_line(srv.stderr())
        assert "node 2's launcher stopped answering" in line, line
    assert "node 2's launcher" in events[-1].get("error", {}).get("message", ""), events[-1]
    r = plain["r"]
    assert r.status_code == 503 and "node 2's launcher" in r.json()["error"]["message"], r.text
    assert gone([p for srv in nodes for p in srv.children], within_s=5.0)
    assert all(runtime_dirs(srv.tmp_dir) == [] for srv in nodes[:2])
    for srv in nodes[:2]:  # the followers' gloo errors: one line each, no traceback
        assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]


def test_a_third_node_missing_fails_the_waiting_node_in_one_line(tmp_path: Path,
                                                                 tiny_tp3: Path) -> None:
    """Nodes 0 and 1 of 3 meet, node 2 never comes: node 0 gives up after --dist-timeout and
    tells node 1 why before its store closes, so node 1 (whose own deadline is later) exits 1
    with node 0's reason in one line, not a DistNetworkError traceback."""
    addr, where = _addr()
    host, port = parse_tcp(f"tcp://{addr}")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs: List[subprocess.Popen] = []
    deadline = time.monotonic() + 60
    try:
        for node in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "serve"), "--port", "0",
                 *node_args(tiny_tp3, 3, node, where, "--dist-timeout", "5", nnodes=3)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                cwd=tmp_path))
            while node == 0 and not _listening(host, port):  # node 1 meets after node 0 did
                assert procs[0].poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        outs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [error_line(err) for err in outs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "node 2 of 3 did not arrive" in lines[0] and addr in lines[0], lines[0]
    assert f"node 0: {lines[0].removeprefix('serve: error: ')}" in lines[1], lines
    assert outs[1].strip() == lines[1], outs[1][-3000:]
    assert runtime_dirs(tmp_path) == []


def _listening(host: str, port: int) -> bool:
    """Whether node 0's store (or anything) accepts connections at host:port."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


# --- launchers' links, in-process -----------------------------------------------------------------
def _links(nnodes: int, timeout_s: float = 30.0) -> List[Cluster]:
    """Every node's `Cluster` of one service, met (node 0 hosting the store here)."""
    addr = f"127.0.0.1:{free_port()}"
    links = [Cluster(ClusterConfig(nnodes=nnodes, node_rank=n, dist_init_addr=addr,
                                   dist_timeout=timeout_s), {"model": "same"})
             for n in range(nnodes)]
    errors: List[BaseException] = []

    def meet(link: Cluster) -> None:
        try:
            link.meet(lambda: False)
        except BaseException as e:  # noqa: B036 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=meet, args=(link,)) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return links


def _follower_service(link: Cluster, model: Path) -> Any:
    """Node `link.node`'s `Service` whose one rank exited with PEER_EXIT (it followed another
    rank's failure, whose cause it did not see)."""
    from minisgl.server.args import parse_args
    from minisgl.server.proc import Child, new_pulse
    from minisgl.server.service import Service
    cl = link.cfg
    cfg = parse_args(["--model", str(model), "--device", "cpu", "--tp", str(cl.nnodes),
                      "--nnodes", str(cl.nnodes), "--node-rank", str(cl.node_rank),
                      "--dist-init-addr", cl.dist_init_addr or ""])
    service = Service(cfg, model, None, link)
    rank = multiprocessing.get_context("fork").Process(target=os._exit, args=(PEER_EXIT,))
    rank.start()
    rank.join()
    service.ranks = [Child(f"rank{cl.node_rank}", rank, multiprocessing.Pipe()[0], new_pulse())]
    return service


def test_a_follower_never_wins_over_the_node_that_went_silent(tiny_tp3: Path) -> None:
    """Three nodes' launchers in-process; node 2's stops beating (as if killed); node 1's rank
    exits with PEER_EXIT and node 1 sees no cause within its grace. Node 1 watches only node
    0's heartbeat, so it must not name its follower: node 0, which watches every node, names
    node 2, and every node says the same. (Was the follower, from node 1, for every node.)"""
    links = _links(3)
    for link in links:
        link.start_watch()
    service = None
    try:
        head_store = links[0].store
        assert head_store is not None
        while int(head_store.add("beat/node2", 0)) < 3:  # node 0 has seen node 2 beat
            time.sleep(0.1)
        links[2].close()  # node 2's launcher is gone: its beats stand still
        service = _follower_service(links[1], tiny_tp3)
        t0 = time.monotonic()
        failure = service.watch(threading.Event())
        assert failure == node_gone(2), failure
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while links[0].failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert links[0].failure() == failure
    finally:
        if service is not None:
            service.stop(graceful=False)
        for link in reversed(links):
            link.close()


def test_with_no_node_silent_node_0_names_the_follower_for_all() -> None:
    """A follower's report with every launcher beating: node 0 names it after a while (no
    cause elsewhere showed), the same for every node; a follower reported later (node 0's own)
    gets that first one."""
    links = _links(2)
    for link in links:
        link.start_watch()
    try:
        t0 = time.monotonic()
        first = links[1].report_secondary("node 1: rank1 (pid 1) exited with code 4 after "
                                          "another rank failed")
        assert first.startswith("node 1: rank1") and time.monotonic() - t0 < 8, first
        assert links[0].report_secondary("node 0: rank0 (pid 2) exited with code 4") == first
    finally:
        for link in reversed(links):
            link.close()


def test_node_0_vanishing_under_a_waiting_node_is_a_startup_error() -> None:
    """Node 1 waits at node 0's store for node 2 when the store closes with no word from node
    0 (killed): a StartupError saying so, not torch's DistNetworkError."""
    host, port = "127.0.0.1", free_port()
    import torch.distributed as dist
    store: Any = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10),
                               master_listen_fd=listening_socket(host, port).detach())
    link = Cluster(ClusterConfig(nnodes=3, node_rank=1, dist_init_addr=f"{host}:{port}",
                                 dist_timeout=30), {"model": "same"})
    caught: List[BaseException] = []

    def meet() -> None:
        try:
            link.meet(lambda: False)
        except BaseException as e:  # noqa: B036 (checked below)
            caught.append(e)

    waiter = threading.Thread(target=meet)
    waiter.start()
    while not store.check(["node/1"]):
        time.sleep(0.05)
    del store  # node 0 is gone
    gc.collect()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and len(caught) == 1
    e = caught[0]
    assert isinstance(e, StartupError) and "node 0 closed the meeting" in str(e), repr(e)
    assert f"{host}:{port}" in str(e) and "\n" not in str(e), str(e)


def test_a_follower_ranks_failure_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """A rank that only followed another (gloo's connection reset) logs one line and exits
    PEER_EXIT; a failure of its own keeps its traceback and exits 1."""
    from minisgl.scheduler.main import log_failure
    log = logging.getLogger("minisgl.scheduler")
    caplog.set_level(logging.ERROR, logger="minisgl.scheduler")

    def raised(e: BaseException) -> BaseException:
        try:
            raise e
        except BaseException as caught:  # noqa: B036 (with its traceback)
            return caught

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
                        "Connection reset by peer\nmore detail")
    assert log_failure(log, 2, raised(gloo)) == PEER_EXIT
    assert log_failure(log, 3, raised(ValueError("a bug"))) == 1
    follower, own = caplog.records
    assert follower.exc_info is None and "\n" not in follower.getMessage()
    assert follower.getMessage() == ("rank 2 failed (another rank failed first): [gloo/"
                                     "transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
                                     "Connection reset by peer")
    assert own.getMessage() == "rank 3 failed" and own.exc_info is not None
