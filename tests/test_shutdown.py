"""Faults and shutdown of a running service, in the style of vLLM's tests/v1/shutdown: a child
killed with SIGKILL or stopped with SIGSTOP ends the service within seconds and every streaming
client gets an error event and [DONE]; SIGTERM drains; a second signal stops at once; no rank
listens on a wildcard address. Real processes, a random tiny model with a long context (a
stream of thousands of tokens is still running when the test acts)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, List

import httpx
import pytest

from server_helpers import CPU_ARGS, Server, comm, error_line, gone, runtime_dirs
from shutdown_helpers import Stream, listeners, status, wait_for

LONG = 6000  # tokens: a stream that does not end by itself while a test runs (8192 in the pool)
EXIT_S = 5.0


@pytest.fixture(scope="module")
def long_model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("qwen3", max_position_embeddings=16384)


def _args(model: Path, *more: str) -> List[str]:
    # One torch thread per rank: on a loaded machine a rank's threads wait for each other at
    # every op, and the streams these tests time would crawl.
    return ["--model", str(model), *CPU_ARGS, "--cpu-threads", "1", *more]


def _pid_of(srv: Server, name: str) -> int:
    pids = [p for p in srv.children if comm(p) == f"minisgl-{name}"[:15]]
    assert len(pids) == 1, {p: comm(p) for p in srv.children}
    return pids[0]


def _wait_exit(srv: Server, timeout_s: float) -> float:
    """Seconds until the launcher exited (it is killed, and the test fails, past `timeout_s`)."""
    t0 = time.monotonic()
    try:
        srv.proc.wait(timeout_s)
    except Exception:
        srv.kill_all()
        raise
    return time.monotonic() - t0


def _all_gone(srv: Server, tmp: Path) -> None:
    assert gone(srv.children)
    assert runtime_dirs(tmp) == []


# --- a dead child -------------------------------------------------------------------------------
@pytest.mark.parametrize("victim,tp", [("tokenizer", 1), ("detokenizer", 1), ("api", 1),
                                       ("rank0", 2)])
def test_kill_9_ends_the_service_within_5_s(tmp_path: Path, long_model: Path, victim: str,
                                            tp: int) -> None:
    """(rank1's kill: tests/test_server_launch.py.) The API server's own death cuts its
    connections: only the others can give their clients an error event."""
    srv = Server.start(_args(long_model, "--tp", str(tp)), tmp_path)
    try:
        stream = Stream(srv.url, LONG).started()
        os.kill(_pid_of(srv, victim), signal.SIGKILL)
        elapsed = _wait_exit(srv, 20)
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
    assert srv.proc.returncode == 1 and elapsed < EXIT_S, (srv.proc.returncode, elapsed)
    line = error_line(srv.stderr())
    assert victim in line and "signal 9" in line, line
    stream.join()
    if victim == "api":
        assert stream.cut is not None
    else:
        error = stream.ended_with_error()
        assert error["type"] == "server_error" and victim in error["message"], error
    _all_gone(srv, tmp_path)


# --- a stopped rank -----------------------------------------------------------------------------
def test_stopped_rank_ends_the_service_past_the_watchdog(tmp_path: Path,
                                                          long_model: Path) -> None:
    """SIGSTOP of rank 1 mid-stream: /health answers 503 within about a second, the watchdog
    (2 s here) ends the service, the client gets an error event. Before that, the ranks' TCP
    endpoints (store, gloo) listen on loopback only: nothing on a wildcard address."""
    srv = Server.start(_args(long_model, "--tp", "2", "--watchdog-timeout", "2"), tmp_path)
    rank1 = _pid_of(srv, "rank1")
    try:
        ranks = [_pid_of(srv, "rank0"), rank1]
        found = listeners(ranks)
        assert {lst.pid for lst in found} == set(ranks), found  # the store, gloo's pairs
        assert all(lst.address in ("127.0.0.1", "::1") for lst in found), found
        stream = Stream(srv.url, LONG).started()
        assert status(srv.url) == 200
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        assert wait_for(lambda: status(srv.url) == 503, 1.9), "still healthy"
        _wait_exit(srv, 20)
        elapsed = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()  # SIGKILL ends a stopped process too
    assert srv.proc.returncode == 1 and elapsed < 2 + EXIT_S, elapsed
    line = error_line(srv.stderr())
    assert "rank1" in line and "no sign of life" in line and "watchdog_timeout 2" in line, line
    error = stream.join().ended_with_error()
    assert "rank1" in error["message"], error
    _all_gone(srv, tmp_path)


# --- SIGTERM ------------------------------------------------------------------------------------
def _post(srv: Server) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=10,
                      json={"prompt": [1, 2, 3], "max_tokens": 2})


def test_sigterm_drains_and_a_second_signal_stops_at_once(tmp_path: Path,
                                                         long_model: Path) -> None:
    """SIGTERM: /health and new requests 503 at once, a stream in flight runs to its end, the
    service stays up for the one that cannot end; a second signal (SIGINT) ends that one with
    an error event and the service exits 0 within seconds."""
    srv = Server.start(_args(long_model, "--shutdown-timeout", "60"), tmp_path)
    try:
        endless = Stream(srv.url, LONG).started()
        short = Stream(srv.url, 100).started()
        srv.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert wait_for(lambda: status(srv.url) == 503, 2)
        refused = _post(srv)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["message"] == "the server is shutting down"
        short.join(60)
        assert short.done and short.finish_reason == "length" and short.cut is None, \
            short.events[-3:]
        assert short.ended_at > signalled
        assert srv.proc.poll() is None and endless.ended_at == 0.0  # still draining
        srv.proc.send_signal(signal.SIGINT)
        elapsed = _wait_exit(srv, 20)
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
    assert srv.proc.returncode == 0 and elapsed < EXIT_S, (srv.proc.returncode, elapsed)
    error = endless.join().ended_with_error()
    assert "stopped before the request finished" in error["message"], error
    _all_gone(srv, tmp_path)


def test_shutdown_timeout_ends_the_rest_with_an_error(tmp_path: Path, long_model: Path) -> None:
    """Also, first: a stopped tokenizer makes /health 503 within about a second (long before
    the watchdog's 300 s), and it is 200 again once the tokenizer resumes."""
    srv = Server.start(_args(long_model, "--shutdown-timeout", "1"), tmp_path)
    try:
        tokenizer = _pid_of(srv, "tokenizer")
        assert status(srv.url) == 200
        os.kill(tokenizer, signal.SIGSTOP)
        try:
            assert wait_for(lambda: status(srv.url) == 503, 3), "still healthy"
        finally:
            os.kill(tokenizer, signal.SIGCONT)
        assert wait_for(lambda: status(srv.url) == 200, 3), "not healthy again"
        endless = Stream(srv.url, LONG).started()
        srv.proc.send_signal(signal.SIGTERM)
        elapsed = _wait_exit(srv, 20)
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
    assert srv.proc.returncode == 0 and 1 <= elapsed < 1 + EXIT_S, elapsed
    error = endless.join().ended_with_error()
    assert "shutdown_timeout 1 s" in error["message"] and error["type"] == "server_error"
    assert endless.tokens > 0
    _all_gone(srv, tmp_path)
