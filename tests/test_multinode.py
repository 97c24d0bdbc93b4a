"""Tensor parallelism over two nodes: two launchers on this machine, gloo and TCP on 127.0.0.1.

Each launcher is a node (`--nnodes 2 --node-rank R --dist-init-addr 127.0.0.1:P`), with its own
runtime directory. Node 0 serves HTTP; node 1 runs only its ranks. Covered: the greedy outputs
of tp=1 at tp=4 (KV heads replicated: the tiny Qwen3 has 2), either start order, a node that
never arrives, a rank killed on node 1 while requests are in flight (tp=2), and the start-up
checks of the cluster settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import httpx
import pytest

from server_helpers import (CPU_ARGS, NODE_READY, READY, REPO, Server, check_same_as_tp1, comm,
                            error_line, gone, run_serve, runtime_dirs)
from shutdown_helpers import listeners

from minisgl.distributed.bind import address_towards, is_loopback
from minisgl.distributed.store import parse_tcp
from minisgl.distributed.bind import free_port

TIMEOUT = ("--dist-timeout", "30")


def _addr(host: str = "127.0.0.1") -> Tuple[str, List[str]]:
    """A meeting address and the flags naming it (the broadcast port picked free too)."""
    addr = f"{host}:{free_port()}"
    return addr, ["--dist-init-addr", addr, "--dist-broadcast-port", str(free_port())]


def node_args(model: Path, tp: int, node: int, where: Sequence[str], *extra: str) -> List[str]:
    return ["--model", str(model), "--tp", str(tp), "--nnodes", "2", "--node-rank", str(node),
            *where, *CPU_ARGS, *TIMEOUT, *extra]


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
    assert time.monotonic() - t0 < 60
    assert runtime_dirs(tmp_path / "a") == [] and runtime_dirs(tmp_path / "b") == []


# --- a rank killed on node 1 while requests are in flight -----------------------------------------
def _generate(url: str, stream: bool) -> httpx.Response:
    body = {"input_ids": [1, 2, 3, 4], "stream": stream,
            "sampling_params": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_kill_9_of_a_rank_on_node_1(tmp_path: Path, tiny_qwen3: Path) -> None:
    _, where = _addr()
    head_start = Server.begin(node_args(tiny_qwen3, 2, 0, where), tmp_path / "node0")
    worker = Server.begin(node_args(tiny_qwen3, 2, 1, where), tmp_path / "node1",
                          NODE_READY).ready()
    head = head_start.ready()
    try:
        plain: Dict[str, httpx.Response] = {}
        sender = threading.Thread(target=lambda: plain.update(r=_generate(head.url, False)))
        sender.start()
        events: List[dict] = []
        with httpx.stream("POST", f"{head.url}/generate", timeout=120, json={
                "input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_tokens": 400, "ignore_eos": True}}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 2:  # tokens are flowing: kill node 1's rank
                    rank = next(p for p in worker.children if comm(p) == "minisgl-rank1")
                    os.kill(rank, signal.SIGKILL)
                    t0 = time.monotonic()
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
