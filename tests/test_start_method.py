"""How children start (`server/proc.py`): spawned, or forked from a fork server (`LLM(tp>1)`'s
ranks under MINISGL_START_METHOD=forkserver).

Either way a child sees its parent's environment as it was at its own start (not the fork
server's), ends when its lifeline closes (its parent died) and removes the parent's runtime
directory then; `LLM(tp=2)` gives the same tokens both ways; a method not taken is refused
with the values before anything starts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, List

import pytest

from minisgl.server.proc import (START_METHOD_ENV, Child, spawn, start_method, stop_children,
                                 wait_ready)
from proc_probe import report_env
from server_helpers import comm

METHODS = ["spawn", "forkserver"]


@pytest.fixture(params=METHODS)
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(START_METHOD_ENV, request.param)
    yield request.param


def _probe(run_dir: Path, method: str, *keys: str) -> Child:
    child = spawn("probe", report_env, (list(keys),), "warning", str(run_dir),
                  forkserver=method == "forkserver")
    wait_ready([child], should_stop=lambda: False)
    return child


def test_start_method_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert start_method({}) == "spawn"
    assert [start_method({START_METHOD_ENV: m}) for m in METHODS] == METHODS
    with pytest.raises(ValueError, match="MINISGL_START_METHOD='fork': expected one of "
                                         "spawn, forkserver"):
        start_method({START_METHOD_ENV: "fork"})


def test_a_child_sees_the_environment_of_its_own_start(method: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The second child starts after the fork server (if any) is running and after the
    variables changed: it sees the new value, and the one removed is gone for it."""
    children: List[Child] = []
    keys = ("MINISGL_PROBE", "MINISGL_PROBE_GONE")
    try:
        monkeypatch.setenv(keys[0], "first")
        monkeypatch.setenv(keys[1], "here")
        children.append(_probe(tmp_path, method, *keys))
        second = f"second-{time.monotonic_ns()}"
        monkeypatch.setenv(keys[0], second)
        monkeypatch.delenv(keys[1])
        children.append(_probe(tmp_path, method, *keys))
        values = [(c.info or {})["values"] for c in children]
        assert values == [["first", "here"], [second, None]]
        assert all(comm((c.info or {})["pid"]) == "minisgl-probe" for c in children)
    finally:
        stop_children(children, 0.0, 2.0)


def test_a_closed_lifeline_ends_the_child_and_removes_the_runtime_dir(
        method: str, tmp_path: Path) -> None:
    """What a parent's `kill -9` does to its children, without killing this process: the
    child's watch reads EOF on its lifeline, removes `run_dir` and exits with code 3."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    child = _probe(run_dir, method)
    try:
        child.lifeline.close()
        child.process.join(10.0)
        assert child.process.exitcode == 3, child.describe_death()
        assert not run_dir.exists()
    finally:
        stop_children([child], 0.0, 2.0)


def test_bad_start_method_refused_by_llm_before_any_rank(tmp_path: Path, tiny_qwen3: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl import LLM
    monkeypatch.setenv(START_METHOD_ENV, "threads")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(ValueError, match="MINISGL_START_METHOD='threads'"):
        LLM(str(tiny_qwen3), tp=2, device="cpu", dtype="float32", max_kv_tokens=1024)
    assert list(tmp_path.glob("minisgl-llm-*")) == []


def test_llm_tp2_gives_the_same_tokens_both_ways(method: str, tiny_qwen3: Path) -> None:
    from minisgl import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_qwen3), tp=2, device="cpu", dtype="float32", max_kv_tokens=1024)
    try:
        tokens = [o.token_ids for o in llm.generate(["Hello there", "1 2 3"], params)]
    finally:
        llm.close()
    reference = LLM(str(tiny_qwen3), device="cpu", dtype="float32", max_kv_tokens=1024)
    try:
        assert tokens == [o.token_ids
                          for o in reference.generate(["Hello there", "1 2 3"], params)]
    finally:
        reference.close()
