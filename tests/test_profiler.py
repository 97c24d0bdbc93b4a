"""Profiling (vLLM's LLM.start_profile / stop_profile, /start_profile and /stop_profile over
HTTP; scheduler/profiler.py): every rank writes a torch.profiler trace of the steps between a
start and a stop; a start or stop out of turn, or with profiling off, is refused by name."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Callable

import httpx
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.message.types import ProfileMsg
from minisgl.scheduler.profiler import RankProfiler
from server_helpers import serving


def _trace_names(path: Path) -> set:
    with gzip.open(path, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


@pytest.mark.parametrize("tp", [1, 2])
def test_every_rank_writes_a_trace_of_the_steps_between(tiny_model: Callable[..., Path],
                                                        tmp_path: Path, tp: int,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("SGLANG_TORCH_PROFILER_DIR", raising=False)
    out = tmp_path / "traces"
    with LLM(str(tiny_model("llama")), device="cpu", tp=tp, max_kv_tokens=1024,
             profile_dir=str(out), show_progress=False) as llm:
        with pytest.raises(ValueError, match="the profiler is not running"):
            llm.stop_profile()
        llm.start_profile("run")
        with pytest.raises(ValueError, match="already running"):
            llm.start_profile()
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
        llm.stop_profile()
        traces = sorted(out.glob("run-*.trace.json.gz"))
        assert [p.name.rsplit("-", 1)[1] for p in traces] == [
            f"rank{r}.trace.json.gz" for r in range(tp)]
        for path in traces:  # the forward's matmuls were recorded on every rank
            assert any(n.startswith("aten::") for n in _trace_names(path)), path
        assert llm.check_accounting().live_requests == 0


def test_profiling_off_or_out_of_turn_is_refused_by_name(tmp_path: Path) -> None:
    """Without a directory every start is refused; a directory that cannot be made is named."""
    off = RankProfiler(0, 0, None, None)
    assert "profiling is off: set profile_dir" in (off.start(ProfileMsg(0, True, "x")) or "")
    blocked = tmp_path / "file"
    blocked.write_text("")
    bad = RankProfiler(0, 0, str(blocked / "traces"), None)
    assert (f"cannot create the profile directory {blocked / 'traces'}"
            in (bad.start(ProfileMsg(0, True, "x")) or ""))
    assert "not running" in (bad.stop() or "")
    root = RankProfiler(0, 0, str(tmp_path / "p"), None)
    for outside in ("/etc", "../p2", str(tmp_path)):
        error = root.start(ProfileMsg(0, True, "x", output_dir=outside)) or ""
        assert f"output_dir {outside} is outside the server's profile_dir" in error


def _work() -> None:
    a = torch.randn(32, 32)
    (a @ a).sum()


def test_num_steps_stops_by_itself_with_sglangs_options(tmp_path: Path) -> None:
    """A start for 2 steps writes its trace after the second launched batch, into its
    output_dir below profile_dir, recording shapes, stacks and memory as asked."""
    profiler = RankProfiler(0, 3, str(tmp_path / "p"), None)
    msg = ProfileMsg(0, True, "sg", num_steps=2, activities=("CPU", "MEM"), with_stack=True,
                     record_shapes=True, output_dir="sub/run")
    assert profiler.start(msg) is None
    _work()
    profiler.stepped()
    trace = tmp_path / "p" / "sub" / "run" / "sg-rank3.trace.json.gz"
    assert not trace.exists()
    _work()
    profiler.stepped()
    assert trace.exists()
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes
    assert any(e.get("name") == "[memory]" for e in events)  # MEM
    assert "not running" in (profiler.stop() or "")
    profiler.stepped()  # nothing running: nothing to count


def test_served_start_and_stop_profile(tiny_qwen3: Path, tmp_path: Path) -> None:
    """POST /start_profile and /stop_profile (vLLM's and SGLang's routes): 200 and a trace;
    out of turn, a 400 naming why; without --profile-dir, a 400 saying profiling is off."""
    out = tmp_path / "traces"
    with serving(["--model", str(tiny_qwen3), "--profile-dir", str(out)], tmp_path) as srv:
        url = srv.url
        assert httpx.post(f"{url}/stop_profile", timeout=30).status_code == 400
        r = httpx.post(f"{url}/start_profile", timeout=30)
        assert r.status_code == 200, r.text
        bad = httpx.post(f"{url}/start_profile", timeout=30)
        assert bad.status_code == 400 and "already running" in bad.json()["error"]["message"]
        httpx.post(f"{url}/v1/completions", json={"model": str(tiny_qwen3), "prompt": "Hi",
                                                  "max_tokens": 3}, timeout=60)
        assert httpx.post(f"{url}/stop_profile", timeout=60).status_code == 200
        assert len(list(out.glob("*-rank0.trace.json.gz"))) == 1
        for body, param in [({"start_step": 3}, "start_step"), ({"activities": ["RPD"]},
                            "activities"), ({"num_steps": 0}, "num_steps"),
                            ({"output_dir": "/etc"}, "output_dir"),
                            ({"merge_profiles": True}, "merge_profiles")]:
            r = httpx.post(f"{url}/start_profile", json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # SGLang's: a number of steps, a prefix, a directory below profile_dir; no stop needed
        r = httpx.post(f"{url}/start_profile", timeout=30, json={
            "num_steps": 2, "profile_prefix": "sg", "output_dir": "sub", "record_shapes": True})
        assert r.status_code == 200 and "for 2 steps" in r.text
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert len(list((out / "sub").glob("sg-*-rank0.trace.json.gz"))) == 1
        assert httpx.post(f"{url}/stop_profile", timeout=30).status_code == 400
        assert httpx.get(f"{url}/start_profile", timeout=30).status_code == 200  # GET too
        assert httpx.get(f"{url}/stop_profile", timeout=60).status_code == 200
