"""The benchmark scripts run end to end on CPU with a tiny model: their arguments, timing loops
and reports stay working between GPU sessions (the numbers themselves mean nothing here)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, List

import pytest

from script_loader import load_script


def _result_lines(out: str) -> List[dict]:
    def strict(constant: str) -> None:  # NaN / Infinity are not JSON
        raise AssertionError(f"RESULT line holds {constant}")
    return [json.loads(line[len("RESULT "):], parse_constant=strict)
            for line in out.splitlines() if line.startswith("RESULT ")]


def test_bench_offline_reports_phases(tiny_model: Callable[..., Path],
                                      capsys: pytest.CaptureFixture) -> None:
    model = tiny_model("qwen3")
    load_script("bench_offline").main(["--model", str(model), "--device", "cpu",
                                       "--num-prompts", "3", "--min-len", "4", "--max-len", "9",
                                       "--no-warmup"])
    out = capsys.readouterr().out
    (result,) = _result_lines(out)
    assert result["engine"] == "minisgl" and result["requests"] == 3
    assert result["output_tokens"] >= 3 * 4 and result["output_tok_s"] > 0
    assert "prefill: 1 steps" in out and "decode:" in out and "host waited" in out


def test_bench_latency_rows(tiny_model: Callable[..., Path], tmp_path: Path,
                            capsys: pytest.CaptureFixture) -> None:
    """The rows, with --json-schema the same steps with every request masked by it, and with
    --verify a speculative verify step of the same requests (its drafts proposed by --draft's
    model; without --verify --draft is refused)."""
    model = tiny_model("llama")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}))
    script = load_script("bench_latency")
    script.main(["--model", str(model), "--device", "cpu", "--batch-sizes", "1,3", "--context",
                 "4-20", "--steps", "2", "--warmup", "1", "--copy-mib", "8", "--prefill", "300",
                 "--json-schema", str(schema), "--verify", "3", "--draft", str(model)])
    (result,) = _result_lines(capsys.readouterr().out)
    assert result["json_schema"] == str(schema) and result["verify_drafts"] == 3
    assert result["draft"] == str(model)
    assert all(r["verify_ms"] > 0 for r in result["rows"])
    for r in result["rows"]:
        assert r["json_step_ms"] > 0 and r["json_overlap_ms"] > 0
        assert r["json_overhead_pct"] is not None
    assert result["prefill"]["tokens"] == 300 and result["prefill"]["ms"] > 0
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and result["context"] == "4-20"
    for r in rows:
        assert r["step_ms"] > 0 and r["overlap_ms"] > 0 and r["roofline_ms"] > 0
        assert r["weight_gb"] > 0 and r["kv_gb"] > 0
    assert script.context_range("512") == (512, 512)
    with pytest.raises(ValueError, match="LO-HI"):
        script.context_range("30-10")
    assert script.parse_args(["--batch-sizes", "1,137"]).batch_sizes == [1, 137]
    for bad in (["--batch-sizes", "0,3"], ["--batch-sizes", "1,,2"], ["--batch-sizes", "x"],
                ["--draft", str(model)]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)


def test_bench_latency_with_an_adapter_on_every_request(tiny_model: Callable[..., Path],
                                                         capsys: pytest.CaptureFixture) -> None:
    """--lora: every request runs with slot 0's random adapter (the deltas change the logits);
    without adapter slots the flag is refused."""
    script = load_script("bench_latency")
    flags = ["--model", str(tiny_model("llama")), "--device", "cpu", "--batch-sizes", "1,3",
             "--context", "8", "--steps", "2", "--warmup", "1", "--copy-mib", "8", "--lora"]
    with pytest.raises(SystemExit):
        script.parse_args(flags)
    script.main([*flags, "--enable-lora", "--max-lora-rank", "4"])
    (result,) = _result_lines(capsys.readouterr().out)
    assert result["lora"] is True and result["max_lora_rank"] == 4
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    assert all(r["step_ms"] > 0 for r in result["rows"])


def test_bench_latency_moe_roofline_counts_touched_experts(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A mixture-of-experts shape (configs/models/qwen3-30b-a3b scaled down) runs, and its
    roofline reads the dense weights plus the experts a batch touches under uniform routing:
    E * (1 - (1 - k/E)^B) of them."""
    script = load_script("bench_latency")
    cfg = json.loads((Path(__file__).resolve().parent.parent / "configs" / "models" /
                      "qwen3-30b-a3b" / "config.json").read_text())
    cfg.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=16,
               num_experts_per_tok=4, moe_intermediate_size=32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    script.main(["--model", str(tmp_path), "--device", "cpu", "--batch-sizes", "1,3",
                 "--context", "8", "--steps", "2", "--warmup", "1", "--copy-mib", "8"])
    rows = _result_lines(capsys.readouterr().out)[0]["rows"]
    assert script.experts_touched(16, 4, 1) == 4
    assert script.experts_touched(16, 4, 3) == pytest.approx(16 * (1 - 0.75 ** 3))
    expert_bytes = 2 * 16 * 3 * 32 * 64 * 4  # layers, experts, gate/up/down, float32
    dense = rows[0]["weight_gb"] * 1e9 - expert_bytes * 4 / 16
    for row in rows:
        touched = script.experts_touched(16, 4, row["batch"])
        assert row["weight_gb"] * 1e9 == pytest.approx(dense + expert_bytes * touched / 16,
                                                       abs=1)


def test_bench_latency_decode_batch_is_the_schedulers(tiny_model: Callable[..., Path]) -> None:
    """The timed decode batch comes from the scheduler's own DecodeManager: longest context
    first, each request writing the slot after its context."""
    script = load_script("bench_latency")
    from minisgl.distributed import DistributedInfo, ProcessGroups
    from minisgl.distributed.comm import Communicator
    from minisgl.engine import Engine, EngineConfig
    info = DistributedInfo(0, 1)
    engine = Engine(EngineConfig(model_path=str(tiny_model("llama")), tp_info=info,
                                 device="cpu", load_format="dummy", max_kv_tokens=2048,
                                 max_running_requests=8),
                    ProcessGroups(Communicator(info), None))
    batch = script.decode_batch(engine, 6, "4-60", engine.model_cfg.vocab_size, seed=0)
    assert batch.prefix_lens == sorted(batch.prefix_lens, reverse=True)
    assert [r.device_len - 1 for r in batch.reqs] == batch.prefix_lens
    table = engine.page_table
    for req, ctx, slot in zip(batch.reqs, batch.prefix_lens, batch.out_slots.tolist()):
        assert int(table[req.table_row, ctx]) == slot


def test_bench_kernels_shapes_and_cpu_refusal() -> None:
    """The kernel micro-benchmark needs CUDA (it says so); its projection shapes are those of the
    model at each tp (Llama-3.1-8B: the numbers in benchmarks/RESULTS.md)."""
    script = load_script("bench_kernels")
    cfg = script.ModelConfig.from_dir(Path(__file__).resolve().parent.parent / "configs" /
                                      "models" / "llama-3.1-8b")
    assert list(script.projections(cfg, 1)) == [
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
        ("down", 4096, 14336), ("lm_head", 128256, 4096)]
    assert list(script.projections(cfg, 2))[:2] == [("qkv", 3072, 4096), ("o", 4096, 2048)]
    if not script.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            script.main(["--what", "decode"])


def test_hf_peer_batching_options() -> None:
    """HF's continuous-batching settings: on CPU a bounded KV cache (HF would size it from the
    machine's RAM); on CUDA, asynchronous batching, CUDA graphs unless --peer-cuda-graph off and
    torch.compile at level 1 (its fastest measured), in the form the installed transformers
    takes."""
    script = load_script("bench_offline")
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=4)
    on_cpu = script.hf_batching_options(gen, on_cuda=False)
    cpu_cb = on_cpu.get("continuous_batching_config", gen)
    assert getattr(cpu_cb, "num_blocks") * getattr(cpu_cb, "page_size") == \
        script.HF_CPU_KV_TOKENS
    assert getattr(cpu_cb, "max_batch_tokens") == script.HF_CPU_BATCH_TOKENS
    for graphs in (True, False):
        opts = script.hf_batching_options(gen, on_cuda=True, cuda_graph=graphs,
                                          memory_percent=0.6)
        cb = opts.get("continuous_batching_config", gen)
        assert getattr(cb, "use_cuda_graph") is graphs
        assert getattr(cb, "max_memory_percent") == 0.6
        assert getattr(cb, "default_compile_level") == script.HF_COMPILE_LEVEL == 1
    assert script.parse_args(["--peer-cuda-graph", "off"]).peer_cuda_graph == "off"
    assert script.parse_args([]).peer_memory_percent == 0.7


def test_hf_peer_extra_batching_fields() -> None:
    """--peer-cb-option KEY=VALUE sets further ContinuousBatchingConfig fields (to search HF's
    best settings); values parse as Python literals; an unknown field fails naming it."""
    script = load_script("bench_offline")
    from transformers import GenerationConfig
    args = script.parse_args(["--peer-cb-option", "q_padding_interval_size=64",
                              "--peer-cb-option", "scheduler_type = fifo",
                              "--peer-cb-option", "default_compile_level=0"])
    assert args.peer_cb_option == [("q_padding_interval_size", 64), ("scheduler_type", "fifo"),
                                   ("default_compile_level", 0)]
    gen = GenerationConfig(do_sample=False, max_new_tokens=4)
    opts = script.hf_batching_options(gen, on_cuda=True, extra=args.peer_cb_option)
    cb = opts.get("continuous_batching_config", gen)
    assert getattr(cb, "q_padding_interval_size") == 64
    assert getattr(cb, "default_compile_level") == 0  # an option overrides a default
    assert getattr(cb, "use_cuda_graph") is True  # the defaults stay
    if "continuous_batching_config" in opts:  # a transformers that validates field names
        with pytest.raises(ValueError, match="no \\['not_a_field'\\]"):
            script.hf_batching_options(gen, on_cuda=True, extra=[("not_a_field", 1)])
    with pytest.raises(SystemExit):
        script.parse_args(["--peer-cb-option", "no-equals-sign"])


def test_bench_offline_hf_peer_end_to_end(tiny_model: Callable[..., Path],
                                          capsys: pytest.CaptureFixture) -> None:
    """--peer hf runs transformers' continuous batching on the same requests and prints the
    ratio (on CPU: the manager API of the installed transformers still fits the script)."""
    model = tiny_model("llama")
    load_script("bench_offline").main(["--model", str(model), "--device", "cpu",
                                       "--num-prompts", "2", "--min-len", "4", "--max-len", "8",
                                       "--no-warmup", "--peer", "hf"])
    out = capsys.readouterr().out
    ours, hf = _result_lines(out)
    assert (ours["engine"], hf["engine"]) == ("minisgl", "hf")
    assert hf["output_tokens"] == ours["output_tokens"] > 0
    assert "minisgl / hf: output tok/s ratio" in out and "hf: run 2/2 finished" in out


def test_bench_offline_prints_no_ratio_when_hf_falls_short(
        tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A peer run whose requests failed part-way (HF ran out of memory on the GPU once and
    reported its failed requests as finished) must not yield a ratio from the partial count."""
    script = load_script("bench_offline")
    monkeypatch.setattr(script, "run_hf", lambda args, work, warm: script.Result(
        "hf", len(work.prompts), 1.0, work.input_tokens, 1, 0))
    with pytest.raises(SystemExit, match="no ratio: HF generated 1 of the"):
        script.main(["--model", str(tiny_model("llama")), "--device", "cpu", "--num-prompts",
                     "2", "--min-len", "4", "--max-len", "8", "--no-warmup", "--peer", "hf"])
    assert "output tok/s ratio" not in capsys.readouterr().out


class _StreamingCompletions(BaseHTTPRequestHandler):
    """An OpenAI-style streamed /v1/completions: three one-character chunks, then usage."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"text": "ab"[i % 2]}]} for i in range(3)]
        chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.server.bodies.append(body)  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


class _HeldBackCompletions(BaseHTTPRequestHandler):
    """Streams as a server with continuous usage does when a token's text is held back: "a"
    (1 token), an empty chunk (token 2 held back), "bc" (tokens 2 and 3), then usage."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        usage = body["stream_options"].get("continuous_usage_stats", False)
        for text, tokens in (("a", 1), ("", 2), ("bc", 3)):
            chunk: dict = {"choices": [{"text": text}]}
            if usage:
                chunk["usage"] = {"completion_tokens": tokens}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n')
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("token_gaps", [False, True])
def test_bench_online_token_gaps_split_a_held_back_chunk(token_gaps: bool, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """--token-gaps asks for usage on every chunk and splits the gap of a chunk that carried
    two tokens (one held back) into two; without it each chunk counts as one token."""
    bench = load_script("bench_online")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HeldBackCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dump = tmp_path / "requests.jsonl"
    try:
        bench.main(["--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--model",
                    "m", "--rates", "inf", "--num-requests", "2", "--min-len", "2",
                    "--max-len", "3", "--dump", str(dump),
                    *(["--token-gaps"] if token_gaps else [])])
    finally:
        server.shutdown()
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    (result,) = _result_lines(capsys.readouterr().out)
    for r in records:
        assert r["output_tokens"] == 3 and r["chunks"] == 2 and len(r["itl_ms"]) == 1
        assert r["chunk_tokens"] == ([1, 2] if token_gaps else [1, 1])
        assert r["itl_ms"][0] >= 30  # two sleeps of 20 ms between "a" and "bc"
    gap, per_token = result["itl_ms"]["p50"], result["itl_token_ms"]["p50"]
    assert per_token == (pytest.approx(gap / 2, rel=0.02) if token_gaps else gap)


def test_bench_online_dumps_every_request(tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    """bench_online against a streaming stub: the summary's RESULT line per rate, and --dump's
    one record per request (when sent, lengths, TTFT, its chunks and the gaps between them),
    the material for explaining a p99."""
    bench = load_script("bench_online")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StreamingCompletions)
    server.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dump = tmp_path / "requests.jsonl"
    try:
        bench.main(["--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--model",
                    "m", "--rates", "inf,50", "--num-requests", "3", "--min-len", "2",
                    "--max-len", "5", "--max-duration", "30", "--dump", str(dump)])
    finally:
        server.shutdown()
    results = _result_lines(capsys.readouterr().out)
    assert [r["rate"] for r in results] == ["inf", "50.0"]
    assert all(b["stream"] and b["temperature"] == 0.0 and b["model"] == "m"
               for b in server.bodies) and len(server.bodies) == 6  # type: ignore[attr-defined]
    assert all(r["completed"] == 3 and r["output_tok_s"] > 0 for r in results)
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [r["rate"] for r in records] == ["inf"] * 3 + ["50.0"] * 3
    for r in records:
        assert r["ok"] and r["output_tokens"] == 3 and 2 <= r["prompt_len"] <= 5
        assert 0 <= r["sent_ms"] <= r["sent_ms"] + r["ttft_ms"] and r["ttft_ms"] <= r["e2e_ms"]
        assert r["chunks"] == 3 and len(r["itl_ms"]) == 2 and min(r["itl_ms"]) >= 0
