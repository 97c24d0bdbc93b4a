"""CLI flags + TOML file -> ServerConfig: precedence, validation, derived configs, the presets."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minisgl.distributed import DistributedInfo
from minisgl.engine import EngineConfig
from minisgl.engine.engine import use_pdl
from minisgl.server.args import ServerConfig, load_file, parse_args
from minisgl.scheduler.config import SchedulerConfig
from minisgl.settings import build, values

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults() -> None:
    cfg = parse_args([])
    assert cfg == ServerConfig()
    assert (cfg.host, cfg.port, cfg.engine.tp, cfg.max_n, cfg.model) == ("127.0.0.1", 8000, 1, 8, None)


def test_flags_override_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('tp = 3\nmax-kv-tokens = 4096\nmem_fraction = 0.5\nserved-model-name = "m"\n'
                 'port = 9000\n')
    cfg = parse_args(["--config", str(f), "--tp", "2", "--port", "0"])
    engine = cfg.engine
    assert (engine.tp, cfg.port, engine.max_kv_tokens, engine.mem_fraction) == (2, 0, 4096, 0.5)
    assert cfg.model_name(Path("/x/SomeModel")) == "m"
    assert parse_args([]).model_name(Path("/x/SomeModel")) == "SomeModel"


def test_a_files_keys_are_the_flag_names_no_flags_too(tmp_path: Path) -> None:
    """`--no-fused-ops` is `no-fused-ops = true` in a file, as the README says keys are the
    long flag names (before: "unknown setting")."""
    f = tmp_path / "c.toml"
    f.write_text("no-fused-ops = true\nno_overlap = false\n")
    sched = parse_args(["--config", str(f)]).scheduler_config(
        Path("unused"), 0, "tcp://127.0.0.1:1", "ipc://a", "ipc://b", "ipc://c")
    assert sched.engine.fused_ops is False and sched.overlap is True
    f.write_text('no-fused-ops = "yes"\n')
    with pytest.raises(ValueError, match="no-fused-ops must be of type bool"):
        parse_args(["--config", str(f)])


@pytest.mark.parametrize("text,match", [
    ("tpp = 2\n", "unknown setting 'tpp'"),
    ('tp = "two"\n', "tp must be of type int"),
    ("tp = true\n", "tp must be of type int"),
    ("tp = [\n", "not valid TOML"),
    ("mem-fraction = 1.5\n", "mem_fraction must be in"),
    ('cache = "lru"\n', "cache must be radix or naive"),
])
def test_bad_file_names_the_setting(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        parse_args(["--config", str(f)])


def test_vllm_and_sglang_names_work_on_the_command_line_in_files_and_keywords(
        tmp_path: Path) -> None:
    """A vLLM or SGLang user's `serve MODEL --tensor-parallel-size 2 --max-num-seqs 64` (and
    the same keys in a file) mean ours; one setting under two names is refused."""
    cfg = parse_args(["org/model", "--tensor-parallel-size", "2", "--max-num-seqs", "64",
                      "--block-size", "32", "--context-length", "4096", "--dp-size", "2",
                      "--chunked-prefill-size", "2048", "--disable-log-requests"])
    assert (cfg.model, cfg.engine.tp, cfg.engine.max_running_requests, cfg.engine.page_size,
            cfg.engine.max_model_len, cfg.cluster.dp, cfg.scheduler.max_prefill_tokens,
            cfg.log_requests) == ("org/model", 2, 64, 32, 4096, 2, 2048, False)
    assert parse_args(["--model-path", "x", "--tp-size", "4"]).engine.tp == 4
    assert parse_args(["x", "--cuda-graph-sizes", "64"]).engine.cuda_graph_max_bs == 64
    vllm_chunk = parse_args(["x", "--max-num-batched-tokens", "4096", "--disable-radix-cache"])
    assert (vllm_chunk.scheduler.max_prefill_tokens, vllm_chunk.scheduler.cache) == (4096,
                                                                                     "naive")
    f = tmp_path / "c.toml"
    f.write_text('model-path = "x"\ntensor_parallel_size = 2\n')
    assert parse_args(["--config", str(f)]).engine.tp == 2
    assert build(SchedulerConfig(), {"tensor_parallel_size": 2}, "LLM()").engine.tp == 2
    with pytest.raises(ValueError, match="the model is given twice: 'a' and --model 'b'"):
        parse_args(["a", "--model", "b"])
    for text, match in (("tp = 2\ntensor-parallel-size = 4\n",
                         "'tp' and 'tensor-parallel-size' both set tp"),
                        ("overlap = true\ndisable-overlap = true\n",
                         "'overlap' and 'disable-overlap' both set overlap")):
        f.write_text(text)
        with pytest.raises(ValueError, match=match):
            parse_args(["--config", str(f)])


def test_vllm_deployment_flags_mean_ours_or_are_refused_by_name() -> None:
    """The flags of vLLM command lines people copy: those that ask for what minisgl does (or
    permit what it never needs) are accepted, mapped onto its settings where they have one;
    those that ask for what it does not serve are refused naming the setting."""
    cfg = parse_args(["org/model", "--trust-remote-code", "--enable-prefix-caching",
                      "--enable-chunked-prefill", "--max-num-batched-tokens", "4096",
                      "--async-scheduling", "--disable-custom-all-reduce",
                      "--load-format", "safetensors", "--pipeline-parallel-size", "1",
                      "--distributed-executor-backend", "mp",
                      "--tokenizer-revision", "v2", "--swap-space", "4", "--enable-lora",
                      "--max-cpu-loras", "2", "--fully-sharded-loras", "--lora-dtype", "auto",
                      "--api-server-count", "1", "--language-model-only",
                      "--limit-mm-per-prompt", '{"image": 0, "video": {"count": 0}}'])
    assert (cfg.engine.trust_remote_code, cfg.scheduler.cache, cfg.scheduler.overlap,
            cfg.scheduler.max_prefill_tokens, cfg.engine.allreduce, cfg.engine.load_format,
            cfg.engine.tokenizer_revision) == (True, "radix", True, 4096, "nccl",
                                               "safetensors", "v2")
    assert parse_args(["--no-enable-prefix-caching"]).scheduler.cache == "naive"
    assert parse_args(["--no-async-scheduling"]).scheduler.overlap is False
    assert build(SchedulerConfig(), {"trust_remote_code": True}, "LLM()").engine.trust_remote_code
    assert (cfg.engine.swap_space, cfg.engine.max_cpu_loras) == (4.0, 2)
    assert parse_args(["--lora-dtype", "float32", "--device", "cpu"]).engine.lora_dtype
    for flags, named in ((["--no-enable-chunked-prefill"], "enable_chunked_prefill false"),
                         (["--lora-dtype", "bfloat16", "--device", "cpu"],
                          "lora_dtype 'bfloat16': adapters are held in the model's dtype "
                          r"\(float32 here\)"),
                         (["--max-loras", "3", "--max-cpu-loras", "1"],
                          "max_cpu_loras 1 must be at least the 3 LoRA slots"),
                         (["--swap-space", "-1"], "swap_space must be >= 0"),
                         (["--api-server-count", "4"], "api_server_count 4"),
                         (["--limit-mm-per-prompt", '{"image": 1}'],
                          "limit_mm_per_prompt: image 1: multimodal inputs are not served"),
                         (["--pipeline-parallel-size", "2"], "pipeline_parallel_size 2"),
                         (["--distributed-executor-backend", "ray"],
                          "distributed_executor_backend 'ray'")):
        with pytest.raises(ValueError, match=named):
            parse_args(flags)


def test_vllm_tokenizer_mode_auto_and_hf_served_others_refused(tmp_path: Path) -> None:
    """vLLM's --tokenizer-mode: auto and hf are what minisgl does (transformers' tokenizer);
    slow, mistral and custom are refused by name, on the command line and by LLM()."""
    from minisgl import LLM
    assert [parse_args(["--tokenizer-mode", m]).tokenizer_mode for m in ("auto", "hf")] == [
        "auto", "hf"]
    for mode in ("slow", "mistral", "custom"):
        with pytest.raises(ValueError, match=rf"tokenizer_mode '{mode}' is not supported"):
            parse_args(["--tokenizer-mode", mode])
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' is not supported"):
        LLM(str(tmp_path), tokenizer_mode="mistral")  # refused before the model is read


def test_bad_flags() -> None:
    with pytest.raises(ValueError, match="tp must be >= 1"):
        parse_args(["--tp", "0"])
    with pytest.raises(ValueError, match="cannot read config file"):
        parse_args(["--config", "/nonexistent.toml"])
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])


def test_scheduler_config_per_rank() -> None:
    cfg = parse_args(["--tp", "2", "--device", "cpu", "--max-kv-tokens", "1024",
                      "--cache", "naive", "--page-size", "8"])
    sc = cfg.scheduler_config(Path("/m"), 1, "tcp://127.0.0.1:1", "ipc://b", "ipc://d", "ipc://x")
    assert sc.engine.tp_info.rank == 1 and sc.engine.tp_info.size == 2
    assert (sc.engine.max_kv_tokens, sc.engine.page_size, sc.cache) == (1024, 8, "naive")
    assert (sc.backend_addr, sc.detokenizer_addr, sc.broadcast_addr) == ("ipc://b", "ipc://d",
                                                                         "ipc://x")
    assert str(sc.engine.torch_dtype) == "torch.float32"


@pytest.mark.parametrize("name", ["default.toml", "llama-3.1-8b-tp2.toml", "qwen3-32b-tp4.toml"])
def test_presets_parse(name: str) -> None:
    settings = load_file(CONFIGS / name)
    cfg = parse_args(["--config", str(CONFIGS / name)])
    for key, value in settings.items():
        assert values(cfg)[key] == value
    if name != "default.toml":
        assert cfg.engine.device == "cuda" and cfg.engine.tp in (2, 4)


def test_decode_reserve_tokens_reaches_the_scheduler() -> None:
    from pathlib import Path

    from minisgl.server.args import parse_args
    cfg = parse_args(["--decode-reserve-tokens", "64"])
    sched = cfg.scheduler_config(Path("unused"), 0, "tcp://127.0.0.1:1", "ipc://a", "ipc://b",
                                 "ipc://c")
    assert sched.decode_reserve_tokens == 64
    assert parse_args([]).scheduler_config(Path("unused"), 0, "tcp://127.0.0.1:1", "ipc://a",
                                           "ipc://b", "ipc://c").decode_reserve_tokens is None


def test_pdl_flag_reaches_the_engine_and_is_refused_off_cuda() -> None:
    """--pdl (programmatic dependent launch) is auto by default, reaches EngineConfig, and a
    configuration that cannot honour "on" fails at start-up naming what is wrong; "auto" is
    quietly off there (CPU, no fused ops)."""
    assert parse_args([]).engine.pdl == "auto"
    assert parse_args(["--pdl", "on"]).engine.pdl == "on"
    assert EngineConfig("m", DistributedInfo(0, 1), device="cuda", pdl="on").pdl == "on"
    with pytest.raises(ValueError, match="pdl 'on' needs device 'cuda' and fused_ops.*'cpu'"):
        parse_args(["--pdl", "on", "--device", "cpu"]).scheduler_config(
            Path("/m"), 0, "tcp://127.0.0.1:1", "", "", "")
    with pytest.raises(ValueError, match="fused_ops False"):
        EngineConfig("m", DistributedInfo(0, 1), device="cuda", fused_ops=False, pdl="on")
    with pytest.raises(ValueError, match="pdl must be one of auto, on, off, got True"):
        EngineConfig("m", DistributedInfo(0, 1), device="cuda", pdl=True)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parse_args(["--pdl", "yes"])
    cpu = EngineConfig("m", DistributedInfo(0, 1), device="cpu")
    assert use_pdl(cpu, torch.device("cpu")) is False
    assert use_pdl(replace(cpu, pdl="off"), torch.device("cpu")) is False


def test_graph_and_overlap_flags_reach_the_engine_and_scheduler() -> None:
    """--cuda-graph-max-bs and --disable-overlap (the issue's ablation switches): defaults are
    graphs up to 256 and overlap left to the scheduler (on for CUDA); bad values fail naming
    the flag."""
    def sched(*argv: str):  # type: ignore[no-untyped-def]
        return parse_args(list(argv)).scheduler_config(
            Path("unused"), 0, "tcp://127.0.0.1:1", "ipc://a", "ipc://b", "ipc://c")
    default = sched()
    assert (default.engine.cuda_graph_max_bs, default.overlap) == (256, None)
    ablated = sched("--cuda-graph-max-bs", "0", "--disable-overlap")
    assert (ablated.engine.cuda_graph_max_bs, ablated.overlap) == (0, False)
    assert sched("--cuda-graph-max-bs", "32").engine.cuda_graph_max_bs == 32
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 0"):
        parse_args(["--cuda-graph-max-bs", "-1"])
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 0"):
        EngineConfig("m", DistributedInfo(0, 1), cuda_graph_max_bs=-1)
    graphs = default.engine
    assert (graphs.decode_graph_max_bs, graphs.prefill_graph_max_tokens) == (256, 1024)
    for flag in ("--enforce-eager", "--disable-cuda-graph"):  # vLLM's and SGLang's names
        eager = sched(flag, "--cuda-graph-max-bs", "32", "--mixed-steps").engine
        assert (eager.decode_graph_max_bs, eager.prefill_graph_max_tokens) == (0, 0)


def test_vllm_compilation_config_sets_the_graphs_and_names_what_it_cannot() -> None:
    """--compilation-config (vLLM's JSON): cudagraph_capture_sizes' largest or
    max_cudagraph_capture_size bound the decode graphs, cudagraph_mode NONE captures none,
    torch.compile's keys change nothing; --enforce-eager still wins; a key minisgl does not
    know, or a bad value, is refused naming it."""
    def graphs(*argv: str) -> int:
        return parse_args(list(argv)).engine.decode_graph_max_bs
    assert graphs("--compilation-config", '{"level": 3, "full_cuda_graph": true}') == 256
    assert graphs("--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 48]}') == 48
    assert graphs("--compilation-config", '{"max_cudagraph_capture_size": 64}') == 64
    assert graphs("--compilation-config", '{"cudagraph_mode": "NONE"}') == 0
    assert graphs("--enforce-eager", "--compilation-config",
                  '{"cudagraph_capture_sizes": [8]}') == 0
    for text, named in (('{"speculative": 1}', "speculative is not supported"),
                        ('{"cudagraph_capture_sizes": []}', "cudagraph_capture_sizes must"),
                        ('{"cudagraph_mode": 2}', "cudagraph_mode must be a name"),
                        ("[3]", "must be a JSON object")):
        with pytest.raises(ValueError, match=f"compilation_config.*{named}"):
            parse_args(["--compilation-config", text])
