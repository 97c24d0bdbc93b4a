"""The launcher's supervision: start-up failures, a killed rank, SIGTERM. Real processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import List

import httpx
import pytest

from server_helpers import (CPU_ARGS, Server, comm, error_line, gone, run_serve,
                            runtime_dirs, tp_args)
from shutdown_helpers import Stream


# --- start-up failures: one line, non-zero, no hang, nothing left behind --------------------------
def test_bad_model_path(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = run_serve(["--model", str(tmp_path / "nope"), "--port", "0"], tmp_path)
    assert r.returncode == 1
    assert "nope" in error_line(r.stderr) and "config.json" in r.stderr
    assert time.monotonic() - t0 < 30
    assert runtime_dirs(tmp_path) == []


def test_a_config_without_a_needed_key_is_named(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    r = run_serve(["--model", str(model), "--port", "0"], tmp_path)
    line = error_line(r.stderr)
    assert r.returncode == 1 and "config.json has no" in line and "'num_attention_heads'" in line
    assert runtime_dirs(tmp_path) == []


def test_a_model_without_tokenizer_files_is_said_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Such a model serves token-id prompts only: the launcher says so at start-up, so that a
    copy that lost its tokenizer does not come up healthy without a word."""
    from minisgl.server.args import parse_args
    from minisgl.server.launch import _prepare
    from tiny_models import build_tiny
    build_tiny("qwen3", tmp_path / "m", None)
    prep = _prepare(parse_args(["--model", str(tmp_path / "m"), "--device", "cpu", "--port",
                                "0"]))
    if prep.sock is not None:
        prep.sock.close()
    assert any("has no tokenizer files: only token-id prompts" in r.getMessage()
               for r in caplog.records)


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_serve(["--port", str(port), *CPU_ARGS], tmp_path)
    assert r.returncode == 1
    line = error_line(r.stderr)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert runtime_dirs(tmp_path) == []


def test_bad_setting_exits_2(tmp_path: Path) -> None:
    r = run_serve(["--tp", "0"], tmp_path)
    assert r.returncode == 2 and "tp must be >= 1" in error_line(r.stderr)


@pytest.mark.parametrize("flags,words", [
    (["--pdl", "on"], "pdl 'on' needs device 'cuda'"),
    (["--tune-gemms"], "tune_gemms tunes the decode CUDA graphs"),
    # before, the service came up healthy and its first request brought it down
    (["--attention-backend", "triton"], "attention backend 'triton' needs device 'cuda'"),
])
def test_a_combination_the_engine_refuses_exits_2(tmp_path: Path, flags: List[str],
                                                  words: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings only the engine's config can judge fail before anything starts, like any other
    bad setting: one line, exit 2, no runtime directory left."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter's tests set it
    r = run_serve([*flags, "--device", "cpu", "--port", "0"], tmp_path)
    assert r.returncode == 2 and words in error_line(r.stderr)
    assert runtime_dirs(tmp_path) == []


@pytest.mark.parametrize("tp,words", [(2, "9 attention heads"),
                                      (9, "intermediate_size 1536")])
def test_tp_not_dividing_the_heads_or_the_mlp(tmp_path: Path, default_model_dir: Path, tp: int,
                                             words: str) -> None:
    r = run_serve([*tp_args(tp), "--port", "0"], tmp_path)
    assert r.returncode == 1
    line = error_line(r.stderr)
    assert words in line and f"tp={tp}" in line, line
    assert len(r.stderr.strip().splitlines()) == 1  # caught before any rank starts
    assert runtime_dirs(tmp_path) == []


def test_a_rank_failing_to_load_reports_it(tmp_path: Path, tiny_qwen3: Path) -> None:
    """Weights missing: only the ranks find out; their error ends the start-up."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    t0 = time.monotonic()
    r = run_serve([*tp_args(2, broken), "--port", "0"], tmp_path)
    assert r.returncode == 1
    line = error_line(r.stderr)
    assert "rank" in line and "failed to start" in line, line
    assert time.monotonic() - t0 < 90
    assert runtime_dirs(tmp_path) == []


# --- a dead child takes the service down; signals stop it cleanly ---------------------------------
def test_kill_9_of_a_rank_stops_everything(tmp_path: Path, tiny_qwen3: Path) -> None:
    srv = Server.start(tp_args(2, tiny_qwen3), tmp_path)
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        ranks = {comm(p): p for p in srv.children if comm(p).startswith("minisgl-rank")}
        assert set(ranks) == {"minisgl-rank0", "minisgl-rank1"}
        assert len(runtime_dirs(tmp_path)) == 1
        stream = Stream(srv.url, 400).started()
        t0 = time.monotonic()
        os.kill(ranks["minisgl-rank1"], signal.SIGKILL)
        code = srv.proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
    assert code != 0 and elapsed < 5.0, (code, elapsed)
    line = error_line(srv.stderr())
    assert "rank1" in line and "signal 9" in line
    assert "rank1" in stream.join().ended_with_error()["message"]  # an error event, [DONE]
    assert gone(srv.children)
    assert runtime_dirs(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(tmp_path: Path, tiny_qwen3: Path, sig: int) -> None:
    srv = Server.start(["--model", str(tiny_qwen3), *CPU_ARGS], tmp_path)
    try:
        r = httpx.post(f"{srv.url}/generate", timeout=60,
                       json={"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}})
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 4
        assert {comm(p) for p in srv.children} >= {"minisgl-rank0", "minisgl-tokeniz",
                                                    "minisgl-detoken", "minisgl-api"}
        result = srv.stop(sig, timeout_s=15)
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
    assert result.code == 0 and result.seconds < 10.0, result
    assert gone(srv.children)
    assert runtime_dirs(tmp_path) == []  # no stale socket files


def test_sigterm_during_start_up_exits_0(tmp_path: Path, tiny_qwen3: Path) -> None:
    """A scale-down while the model loads is a stop, not a failure: exit 0, nothing left
    behind (before: "interrupted during start-up", exit 1)."""
    from server_helpers import _launch
    err = tmp_path / "err.log"
    proc, lines = _launch(["--model", str(tiny_qwen3), *CPU_ARGS], tmp_path, err)
    try:
        line = lines.get(timeout=60)  # the first start-up step ("minisgl starting: ...")
        assert line is not None and line.startswith("minisgl starting"), (line, err.read_text())
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err.read_text()[-2000:]
    assert runtime_dirs(tmp_path) == []


def test_the_launcher_api_server_and_tokenizers_import_no_torch(default_model_dir: Path) -> None:
    """Their processes never touch a tensor: torch would cost each some 2 s and 300 MB at every
    start (the distributed, models and engine packages load their torch names lazily; the
    configs' names and checks are torch-free modules, devices.py, distributed/modes.py,
    models/checkpoint_quant.py; grammar exports the compiler's; the tokenizer's class is found
    without AutoTokenizer's module, which imports torch). A one-node CPU launcher needs none:
    "auto" and "cuda" devices import it to ask for a GPU, several nodes for the TCP store."""
    import subprocess
    import sys
    code = ("import sys, pathlib, minisgl.server.launch, minisgl.server.api, "
            "minisgl.tokenizer.tokenize_worker, "
            "minisgl.tokenizer.detokenize_worker; "
            "from minisgl.tokenizer.text import load_tokenizer; "
            f"load_tokenizer(pathlib.Path({str(default_model_dir)!r})); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from minisgl.tokenizer.text import load_tokenizer
    ours, auto = load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(
        str(default_model_dir))
    assert type(ours) is type(auto)
    texts = ["Hello, world!", " leading space", "naïve café 🍵\n\ttabs", "<|im_start|>user"]
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert ours.all_special_tokens == auto.all_special_tokens and len(ours) == len(auto)
