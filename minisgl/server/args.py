"""The server's configuration: command-line flags and an optional TOML file -> one `ServerConfig`.

Precedence: built-in defaults < the `--config` file < flags given on the command line. The file
uses the flags' long names as keys (dashes or underscores), e.g. `max-kv-tokens = 8192`; an
unknown key or a value of the wrong type is an error naming it. Derived values (the engine and
scheduler configs of each rank, the served model name) are methods and properties.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from minisgl.distributed import ALLREDUCE_MODES, DistributedInfo
from minisgl.engine import PDL_MODES, EngineConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import resolve_device, resolve_dtype

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    model: Optional[str] = None  # a local Hugging Face directory; None: the bundled default
    served_model_name: Optional[str] = None  # the name clients use; default: the directory name
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (the ready line names it)
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    max_prefill_tokens: int = 8192
    max_running_requests: int = 256
    max_kv_tokens: Optional[int] = None
    mem_fraction: float = 0.85
    load_format: str = "auto"
    cache: str = "radix"
    decode_reserve_tokens: Optional[int] = None  # None: reserve all of max_tokens (no retraction)
    attention_backend: str = "auto"
    allreduce: str = "auto"  # TP all-reduce: auto, nccl, symm or symm-fused (see EngineConfig)
    pdl: str = "auto"  # programmatic dependent launch: auto, on or off (see EngineConfig)
    tune_gemms: bool = False  # time cuBLAS vs cuBLASLt per decode GEMM at start-up (EngineConfig)
    cuda_graph_max_bs: int = 256  # decode CUDA graphs up to this batch size; 0: none (GPU only)
    disable_overlap: bool = False  # ablation: plan each step only after the last one's tokens
    seed: int = 0
    max_n: int = 8
    log_level: str = "info"
    shell: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.tp >= 1, f"tp must be >= 1, got {self.tp}"),
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (self.page_size >= 1, f"page-size must be >= 1, got {self.page_size}"),
            (self.max_prefill_tokens >= 1,
             f"max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}"),
            (self.max_running_requests >= 1,
             f"max-running-requests must be >= 1, got {self.max_running_requests}"),
            (self.max_kv_tokens is None or self.max_kv_tokens >= 1,
             f"max-kv-tokens must be >= 1, got {self.max_kv_tokens}"),
            (0 < self.mem_fraction < 1, f"mem-fraction must be in (0, 1), got {self.mem_fraction}"),
            (self.max_n >= 1, f"max-n must be >= 1, got {self.max_n}"),
            (self.cuda_graph_max_bs >= 0,
             f"cuda-graph-max-bs must be >= 0 (0: no graphs), got {self.cuda_graph_max_bs}"),
            (self.device in ("auto", "cpu", "cuda"),
             f"device must be auto, cpu or cuda, got {self.device!r}"),
            (self.load_format in ("auto", "dummy"),
             f"load-format must be auto or dummy, got {self.load_format!r}"),
            (self.cache in ("radix", "naive"), f"cache must be radix or naive, got {self.cache!r}"),
            (self.allreduce in ALLREDUCE_MODES,
             f"allreduce must be one of {', '.join(ALLREDUCE_MODES)}, got {self.allreduce!r}"),
            (self.log_level.lower() in _LOG_LEVELS,
             f"log-level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    # --- derived values ------------------------------------------------------------------------
    @property
    def effective_log_level(self) -> str:
        """The log level of every process: the shell keeps the terminal for the chat
        (warnings only, unless debug was asked for)."""
        if self.shell and self.log_level.lower() == "info":
            return "warning"
        return self.log_level

    @property
    def resolved_device(self) -> str:
        return resolve_device(self.device)

    def model_name(self, model_path: Path) -> str:
        return self.served_model_name or model_path.name

    def check_combination(self) -> None:
        """Raise ValueError, naming the settings, for combinations only the engine and scheduler
        configs judge (pdl 'on' or tune-gemms without CUDA, ...): the launcher calls it before
        anything starts, so they fail like any other bad setting instead of inside a rank."""
        self.scheduler_config(Path("model"), 0, "tcp://127.0.0.1:0", "", "", "")

    def scheduler_config(self, model_path: Path, rank: int, dist_init_method: str,
                         backend_addr: str, detokenizer_addr: str, broadcast_addr: str
                         ) -> SchedulerConfig:
        device = self.resolved_device
        engine = EngineConfig(
            model_path=str(model_path), tp_info=DistributedInfo(rank, self.tp), device=device,
            dtype=resolve_dtype(self.dtype, device), page_size=self.page_size,
            max_running_requests=self.max_running_requests, max_kv_tokens=self.max_kv_tokens,
            mem_fraction=self.mem_fraction, load_format=self.load_format,
            attention_backend=self.attention_backend, allreduce=self.allreduce, pdl=self.pdl,
            tune_gemms=self.tune_gemms, cuda_graph_max_bs=self.cuda_graph_max_bs, seed=self.seed,
            dist_init_method=dist_init_method, show_progress=False)
        return SchedulerConfig(engine=engine, max_prefill_tokens=self.max_prefill_tokens,
                               cache=self.cache, backend_addr=backend_addr,
                               decode_reserve_tokens=self.decode_reserve_tokens,
                               overlap=False if self.disable_overlap else None,
                               detokenizer_addr=detokenizer_addr, broadcast_addr=broadcast_addr)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve", description="Serve a model over an OpenAI-compatible HTTP API.",
        argument_default=argparse.SUPPRESS)  # only flags actually given override the file
    p.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    p.add_argument("--model", help="local Hugging Face model directory (default: the bundled "
                                   "SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="model name in the API (default: directory name)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    p.add_argument("--page-size", type=int)
    p.add_argument("--max-prefill-tokens", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-kv-tokens", type=int, help="KV pool capacity in tokens")
    p.add_argument("--mem-fraction", type=float, help="GPU memory share for the KV pool")
    p.add_argument("--load-format", choices=("auto", "dummy"))
    p.add_argument("--cache", choices=("radix", "naive"))
    p.add_argument("--decode-reserve-tokens", type=int,
                   help="reserve KV for at most this many output tokens per request at "
                        "admission, retracting requests when decode outgrows the pool "
                        "(default: reserve all of max_tokens)")
    p.add_argument("--attention-backend", help="auto, torch or triton")
    p.add_argument("--allreduce", choices=ALLREDUCE_MODES,
                   help="tensor-parallel all-reduce: auto (symmetric-memory one-shot for small "
                        "tensors on CUDA where available, else NCCL; default), nccl, symm "
                        "(required: fail at start-up if unavailable), or symm-fused (symm, "
                        "with each all-reduce before an RMSNorm fused into it: one kernel)")
    p.add_argument("--pdl", choices=PDL_MODES,
                   help="programmatic dependent launch for the decode path's kernels: auto (on "
                        "with CUDA, fused ops and compute capability 9.0+; default), on "
                        "(required) or off")
    p.add_argument("--cuda-graph-max-bs", type=int,
                   help="capture decode CUDA graphs for batch sizes up to N (default 256; 0: "
                        "none; GPU only)")
    p.add_argument("--disable-overlap", action="store_true",
                   help="schedule each step only after the previous step's tokens arrive "
                        "(default: the CPU plans step N+1 while the GPU runs step N; GPU only)")
    p.add_argument("--tune-gemms", action="store_true",
                   help="time cuBLAS against cuBLASLt for each decode GEMM at start-up and use "
                        "the faster (CUDA; off by default: the choice can differ between runs)")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-n", type=int, help="the largest n a request may ask for (default 8)")
    p.add_argument("--log-level", choices=_LOG_LEVELS)
    p.add_argument("--shell", action="store_true", help="chat in this terminal")
    return p


def _field_types() -> Dict[str, Any]:
    return {f.name: f.default for f in fields(ServerConfig)}


def _check_type(key: str, value: Any) -> Any:
    default = _field_types()[key]
    if key in ("model", "served_model_name"):
        want: Any = str
    elif key == "max_kv_tokens":
        want = int
    else:
        want = type(default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ValueError(f"{key.replace('_', '-')} must be of type {want.__name__}, "
                         f"got {value!r}")
    return value


def load_file(path: Path) -> Dict[str, Any]:
    """Settings from a TOML file, keys normalized to field names; errors name the key."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    known = _field_types()
    out: Dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"config file {str(path)!r}: unknown setting {key!r}")
        out[name] = _check_type(name, value)
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> ServerConfig:
    """The config from `argv` (default sys.argv[1:]). Raises ValueError on a bad setting;
    argparse itself exits with status 2 on malformed flags."""
    ns = vars(_parser().parse_args(argv))
    settings: Dict[str, Any] = {}
    path = ns.pop("config", None)
    if path is not None:
        settings.update(load_file(path))
    settings.update(ns)
    return replace(ServerConfig(), **settings)


def describe(cfg: ServerConfig) -> List[str]:
    """`key = value` lines of every setting (logged at start-up)."""
    return [f"{f.name} = {getattr(cfg, f.name)!r}" for f in fields(ServerConfig)]
