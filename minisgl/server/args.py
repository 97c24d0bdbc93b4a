"""The server section of the config tree, and the command line and TOML file that set it.

Precedence: built-in defaults < the `--config` file < flags given on the command line. Every flag
and file key comes from the tree (minisgl/settings.py): the file uses the flags' long names as
keys (dashes or underscores), e.g. `max-kv-tokens = 8192`; an unknown key or a value of the wrong
type is an error naming it, and each section's own checks judge the values. Derived values (the
scheduler config of each rank, the served model name) are methods and properties.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from minisgl.devices import resolve_device
from minisgl.engine import EngineConfig
from minisgl.engine.config import environment_settings
from minisgl.models.generation import check_generation_overrides
from minisgl.models.path import model_name
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.hosts import is_loopback
from minisgl.server.cors import CorsPolicy, parse_names, parse_origins
from minisgl.server.tls import check_tls
from minisgl.server.tracing import check_detailed_traces, check_installed as check_tracing
from minisgl.server.topology import ClusterConfig, Wiring
from minisgl.server.reasoning import REASONING_PARSERS
from minisgl.tokenizer.chat_template import CONTENT_FORMATS
from minisgl.server.tool_calls import TOOL_CALL_PARSERS
from minisgl.tokenizer.text import check_tokenizer_mode
from minisgl.settings import (Alias, add_flags, build, check_choices, check_values,
                              json_object, section, setting)
from minisgl.settings import values as setting_values

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The server's prefill chunk, where the offline API's default follows the device (larger on big
# GPUs): a longer chunk holds back the running requests' next token for longer.
SERVER_PREFILL_TOKENS = 8192
API_KEY_ENV = "MINISGL_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 32 << 20


def _server_scheduler() -> SchedulerConfig:
    return SchedulerConfig(max_prefill_tokens=SERVER_PREFILL_TOKENS)


@dataclass(frozen=True)
class ServerConfig:
    model: Optional[str] = setting(None, "local Hugging Face model directory, or a hub model id "
                                         "ORG/NAME (downloaded into the hub cache, or read from "
                                         "it with HF_HUB_OFFLINE=1; default: the bundled "
                                         "SmolLM2-135M-Instruct)", also=("model-path",))
    served_model_name: Optional[str] = setting(None, "model name in the API, or several names "
                                                     "separated by commas: replies carry the "
                                                     "first, requests may name any (default: "
                                                     "the hub id, or the directory name)")
    tokenizer: Optional[str] = setting(None, "a local directory or hub id ORG/NAME whose "
                                             "tokenizer and chat template are used instead "
                                             "of the model's (only its tokenizer files are "
                                             "downloaded)")
    hf_token: Optional[str] = setting(
        None, "the Hugging Face token that downloads of a hub model id (and --tokenizer's) "
              "send, for gated and private models (vLLM's); unset: huggingface_hub's own "
              "(HF_TOKEN, or the login it saved); never logged")
    tokenizer_mode: str = setting(
        "auto", "vLLM's: auto or hf, both transformers' tokenizer of the model (the fast one "
                "where there is one); vLLM's slow, mistral and custom are refused")
    chat_template: Optional[str] = setting(None, "a Jinja chat template file that replaces the "
                                                 "model's own")
    chat_template_content_format: str = setting(
        "auto", "vLLM's: how a message's content reaches the chat template: string (text), "
                "openai (a list of parts, [{\"type\": \"text\", \"text\": ...}], as "
                "templates of multimodal models loop over), or auto (openai where the template "
                "loops over a message's content, else string)", choices=CONTENT_FORMATS)
    generation_config: str = setting(
        "auto", "the sampling defaults of requests that leave temperature, top_p, top_k, "
                "min_p or repetition_penalty unset: auto (the model's generation_config.json "
                "recommends them, as in vLLM and SGLang; OpenAI's neutral values where it "
                "does not), none (OpenAI's; also vLLM's name, vllm), or a directory holding a "
                "generation_config.json")
    override_generation_config: Optional[str] = setting(
        None, "vLLM's: a JSON object of sampling defaults set over generation_config's "
              "('{\"temperature\": 0.6, \"max_new_tokens\": 512}': temperature, top_p, "
              "top_k, min_p, repetition_penalty, max_new_tokens)", json_value=True)
    default_chat_template_kwargs: Optional[str] = setting(
        None, "vLLM's: a JSON object of chat template keywords every chat request gets "
              "('{\"enable_thinking\": false}'); a request's own chat_template_kwargs (and "
              "reasoning_effort, Anthropic's thinking) win", json_value=True)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "HTTP port (0: pick a free one; the ready line names it)")
    max_n: int = setting(8, "the largest n (choices per request) a request may ask for")
    log_level: str = setting("info", "log level of every process", choices=LOG_LEVELS,
                             any_case=True)
    uvicorn_log_level: Optional[str] = setting(
        None, "the HTTP server's own log level (uvicorn's: its start-up, protocol and "
              "connection errors; vLLM's); unset: log_level", choices=UVICORN_LOG_LEVELS)
    log_requests: bool = setting(True, "one INFO line per HTTP request (client, method, path, "
                                       "status, milliseconds, its X-Request-Id and scheduler "
                                       "uids)",
                                 alias=Alias("disable-log-requests", False,
                                             "the same as --no-log-requests (vLLM's name)"))
    api_server_count: int = setting(
        1, "vLLM's: 1 (one API server process, on uvloop, serves every replica); more are "
           "refused")
    log_outputs: bool = setting(
        False, "one INFO line per finished choice of a generating request: its request id, "
               "finish reason, token count and text (cut to max_log_len characters); for "
               "debugging, as outputs may hold what users would not have logged",
        alias=Alias("enable-log-outputs", True, "the same as --log-outputs (vLLM's name)"))
    max_log_len: Optional[int] = setting(
        None, "vLLM's: the characters of an output log_outputs writes (unset: all)")
    otlp_traces_endpoint: Optional[str] = setting(
        None, "vLLM's: an OpenTelemetry collector's OTLP endpoint (e.g. "
              "http://collector:4318/v1/traces) that gets a span per generation request, a "
              "child of the client's W3C traceparent (server/tracing.py; needs pip install "
              "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http)")
    collect_detailed_traces: Optional[str] = setting(
        None, "vLLM's: model, worker or all (comma-separated), accepted as what minisgl "
              "always does: a span carries the scheduler's queue, prefill, decode and "
              "inference times (gen_ai.latency.time_in_queue, ...); needs "
              "otlp_traces_endpoint")
    log_stats: bool = setting(True, "an INFO line every log_stats_interval seconds while the "
                                    "service works: requests running and waiting, KV use, "
                                    "prompt and generation throughput, prefix cache hits",
                              alias=Alias("disable-log-stats", False,
                                          "the same as --no-log-stats (vLLM's name)"))
    log_stats_interval: float = setting(10.0, "seconds between log_stats' lines")
    shell: bool = setting(False, "chat with the model in this terminal")
    weight_version: str = setting(
        "default", "SGLang's: the served weights' version, as /generate's meta_info, "
                   "/get_weight_version and /get_model_info name it; a weight update's "
                   "weight_version (or /update_weight_version) changes it")
    incremental_streaming_output: bool = setting(
        False, "SGLang's: a streamed /generate chunk carries only what is new (text, "
               "output_ids, log-probabilities); by default each repeats everything so far, as "
               "SGLang's does")
    batch_input: Optional[str] = setting(
        None, "run an OpenAI batch file and exit (vLLM's run-batch): JSON lines of {custom_id, "
              "method: POST, url, body} (url: /v1/chat/completions, /v1/completions, "
              "/v1/embeddings, /v1/responses, /v1/messages, /v1/score, /v1/rerank, "
              "/v1/classify), sent "
              "through this server's own API, which then listens on a free loopback port",
        also=("input-file",))
    batch_output: Optional[str] = setting(
        None, "where batch_input's answers go: a JSON line per request in the input's order "
              "({id, custom_id, response: {status_code, request_id, body}, error})",
        also=("output-file",))
    batch_concurrency: int = setting(256, "batch_input's requests in flight at once")
    reasoning_parser: Optional[str] = setting(
        None, "split a reasoning model's chat output: the thinking part (<think>; Granite's "
              "thought process; Magistral's [THINK], whose output then keeps special "
              "tokens) goes into reasoning_content", choices=REASONING_PARSERS)
    auto_tool_choice: bool = setting(
        True, "tool_choice auto (a request's default where it gives tools) reads the output's "
              "calls; off: such a request gets a 400 naming tool_choice, as vLLM without its "
              "--enable-auto-tool-choice",
        alias=Alias("enable-auto-tool-choice", True, "on, as by default (vLLM's flag)"))
    response_role: str = setting(
        "assistant", "vLLM's: the role chat replies' messages name (message.role, the stream's "
                     "first delta); a request that continues its last message "
                     "(add_generation_prompt false) gets that message's role")
    return_tokens_as_token_ids: bool = setting(
        False, "vLLM's: log-probability tokens rendered as \"token_id:N\" in chat, "
               "completion and Responses replies whose request leaves "
               "return_tokens_as_token_ids unset")
    trust_request_chat_template: bool = setting(
        False, "vLLM's: chat and /tokenize requests may bring their own chat template "
               "(chat_template, or chat_template_kwargs' chat_template); off, a 400: a template "
               "is code the tokenizer runs")
    enable_force_include_usage: bool = setting(
        False, "vLLM's: every streamed chat, completion and Responses reply ends with its "
               "usage, as if the request had asked (stream_options.include_usage)")
    structured_outputs_config: Optional[str] = setting(
        None, "vLLM's: a JSON object of structured-output options: backend (auto or xgrammar, "
              "the one served), enable_in_reasoning (true: a reasoning model's constraint holds "
              "from its first token, thinking included; by default it holds after the "
              "thinking), reasoning_parser (the --reasoning-parser's name, or empty), and "
              "disable_any_whitespace, disable_additional_properties, disable_fallback (taken "
              "as given: xgrammar's JSON is compact, and has no fallback)", json_value=True)
    tool_call_parser: Optional[str] = setting(
        None, "the format chat output's tool calls are read (and, for tool_choice \"required\" "
              "or a named function, enforced) in (default: from the chat template: "
              "qwen3_coder for Qwen3-Coder's XML calls, mistral for Mistral's [TOOL_CALLS], "
              "granite for Granite 3.x's <|tool_call|>, phi4_mini_json for Phi-4-mini's "
              "functools[...], llama3_json for Llama 3.x's, else hermes)",
        choices=TOOL_CALL_PARSERS)
    # --- exposure and limits of the HTTP API (server/auth.py, limits.py, admission.py) ------
    api_key: Optional[str] = setting(
        None, f"clients must send `Authorization: Bearer KEY` to every endpoint but /health and "
              f"/metrics; unset: the {API_KEY_ENV} environment variable, else no key")
    allowed_origins: Optional[str] = setting(
        None, "CORS: the web origins (https://app.example, comma-separated, or vLLM's JSON "
              "list; * for any, which needs api_key) whose pages may call the API from a "
              "browser; unset: none (a browser's cross-origin requests are not answered)")
    allowed_methods: Optional[str] = setting(
        None, "CORS: the HTTP methods (comma-separated, or vLLM's JSON list) an allowed "
              "origin's page may use; unset: any")
    allowed_headers: Optional[str] = setting(
        None, "CORS: the request headers (comma-separated, or vLLM's JSON list) an allowed "
              "origin's page may send; unset: any")
    allow_credentials: bool = setting(
        False, "CORS: an allowed origin's page may send its cookies and HTTP authentication "
               "(vLLM's)")
    root_path: Optional[str] = setting(
        None, "the path prefix (/minisgl) under which a reverse proxy serves the API, removing "
              "it before it forwards: the OpenAPI document's `servers` and the web chat page's "
              "requests name it (FastAPI's root_path; vLLM's --root-path); the routes stay "
              "where they are")
    prompt_tokens_details: bool = setting(
        True, "chat and completion usage carries prompt_tokens_details (cached_tokens: the "
              "prompt tokens the prefix cache held)",
        alias=Alias("enable-prompt-tokens-details", True, "on, as by default (vLLM's flag)"))
    uvicorn_access_log: bool = setting(
        False, "uvicorn's own access line per request, besides minisgl's (log_requests)",
        alias=Alias("disable-uvicorn-access-log", False, "off, as by default (vLLM's flag)"))
    stream_interval: int = setting(
        1, "tokens a streamed chunk carries after the first (which goes at once; the last "
           "goes with the finish): fewer, larger chunks to pace many streams (vLLM's and "
           "SGLang's --stream-interval; a /generate request's sampling_params.stream_interval "
           "sets its own)")
    server_load_tracking: bool = setting(
        True, "GET /load answers how many generation requests are in flight (vLLM's /load)",
        alias=Alias("enable-server-load-tracking", True, "on, as by default (vLLM's flag)"))
    request_id_headers: bool = setting(
        True, "every response carries its request's X-Request-Id header (the client's, else a "
              "new id)",
        alias=Alias("enable-request-id-headers", True, "on, as by default (vLLM's flag)"))
    openapi: bool = setting(
        True, "serve the API's OpenAPI document at /openapi.json",
        alias=Alias("disable-fastapi-docs", False, "the same as --no-openapi (vLLM's name)"))
    ssl_keyfile: Optional[str] = setting(
        None, "HTTPS: the private key (PEM) of ssl_certfile's certificate; the port then "
              "speaks TLS only (vLLM's and SGLang's)")
    ssl_certfile: Optional[str] = setting(None, "HTTPS: the certificate chain (PEM)")
    max_queued_requests: Optional[int] = setting(
        None, "requests accepted but not started (no first token yet) beyond which new ones "
              "are refused with 429 and Retry-After; unset: no limit")
    max_queued_tokens: Optional[int] = setting(
        None, "prompt tokens waiting in a replica's scheduler queue beyond which a new request "
              "is refused with 429 and Retry-After (one request is always let into an empty "
              "queue); unset: no limit")
    request_timeout: Optional[float] = setting(
        None, "seconds a request may take from its arrival to its last token; past them it is "
              "aborted (408, or an error event in a stream); the OpenAI client's "
              "X-Stainless-Read-Timeout header sets a shorter deadline per request; unset: none")
    max_request_bytes: int = setting(DEFAULT_MAX_REQUEST_BYTES,
                                     "the largest request body accepted (413 beyond)")
    body_timeout: float = setting(30.0, "seconds a client may take to send a request's body "
                                        "(408 and the connection closed after)")
    tokenizer_threads: int = setting(2, "threads that prepare long prompts and compile "
                                        "structured-output constraints beside the "
                                        "tokenizer's loop, so that other requests are not "
                                        "held up behind them")
    watchdog_timeout: float = setting(
        300.0, "seconds a scheduler step (its collectives included) may run, and a process may "
               "show no sign of life (stopped, frozen), before the service stops as if it had "
               "died; a rank's first step gets 3 times as long (it may compile kernels)")
    shutdown_timeout: float = setting(
        30.0, "on SIGTERM or SIGINT: seconds the requests in flight get to finish while new ones "
              "get 503, before the rest end with an error; a second signal stops at once")
    scheduler: SchedulerConfig = section(_server_scheduler)
    cluster: ClusterConfig = section(ClusterConfig)

    def __post_init__(self) -> None:
        check_choices(self)
        self.cluster.check_tp(self.engine.tp)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        for name in ("max_queued_requests", "max_queued_tokens", "max_request_bytes",
                     "tokenizer_threads", "stream_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("request_timeout", "body_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if not self.log_stats_interval > 0:
            raise ValueError(f"log_stats_interval must be > 0 seconds, got "
                             f"{self.log_stats_interval}")
        if not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got "
                             f"{self.shutdown_timeout}")
        if self.api_server_count != 1:
            raise ValueError(f"api_server_count {self.api_server_count}: one API server "
                             f"process serves every replica here; leave it at 1")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.otlp_traces_endpoint is not None:
            check_tracing(self.otlp_traces_endpoint)
        check_detailed_traces(self.collect_detailed_traces, self.otlp_traces_endpoint)
        if not self.response_role.strip():
            raise ValueError("response_role must not be empty")
        if any(not name for name in self.served_names):
            raise ValueError(f"served_model_name must be names separated by commas, got "
                             f"{self.served_model_name!r}")
        check_tls(self.ssl_keyfile, self.ssl_certfile)
        check_tokenizer_mode(self.tokenizer_mode)
        json_object(self.default_chat_template_kwargs, "default_chat_template_kwargs",
                    "chat template keywords")
        check_generation_overrides(self.override_generation_config)
        self.constrain_in_reasoning  # noqa: B018  (raises for a bad structured_outputs_config)
        if self.root_path is not None and not re.fullmatch(r"(/[\w.~%-]+)+", self.root_path):
            raise ValueError(f"root_path must be a path of letters, digits and . ~ % - _ that "
                             f"starts with / and does not end with one (/minisgl), got "
                             f"{self.root_path!r}")
        self.cors  # noqa: B018  (raises for a bad entry)
        if "*" in self.origins and self.resolved_api_key is None:
            raise ValueError("allowed_origins * lets any web page use this server from its "
                             "visitors' browsers: it needs api_key")
        if (self.batch_input is None) != (self.batch_output is None):
            raise ValueError("batch_input and batch_output go together (--batch-input IN "
                             "--batch-output OUT)")
        if self.batch_input is not None and self.shell:
            raise ValueError("shell and batch_input exclude each other")
        if self.batch_concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        both = sorted({n for n, _ in self.engine.lora_adapters} & set(self.served_names))
        if both:  # a request's model must name one thing
            raise ValueError(f"{', '.join(both)} names both the served model and a LoRA "
                             f"adapter (served_model_name, lora_modules)")

    # --- derived values ------------------------------------------------------------------------
    @property
    def engine(self) -> EngineConfig:
        return self.scheduler.engine

    @property
    def effective_log_level(self) -> str:
        """The log level of every process: the shell keeps the terminal for the chat, a batch
        run for its progress bar (warnings only, unless debug was asked for)."""
        if (self.shell or self.batch_input) and self.log_level.lower() == "info":
            return "warning"
        return self.log_level

    @property
    def resolved_api_key(self) -> Optional[str]:
        """The key clients must send: the setting, else the environment's, else None."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    @property
    def origins(self) -> Tuple[str, ...]:
        """allowed_origins as a tuple (cors.parse_origins)."""
        return parse_origins(self.allowed_origins)

    @property
    def constrain_in_reasoning(self) -> bool:
        """structured_outputs_config's enable_in_reasoning, its other keys checked (ValueError
        naming one this server does not serve)."""
        name = "structured_outputs_config"
        options = json_object(self.structured_outputs_config, name, "structured-output options",
                              ("backend", "enable_in_reasoning", "reasoning_parser",
                               "disable_any_whitespace", "disable_additional_properties",
                               "disable_fallback", "reasoning_parser_plugin"))
        backend = options.get("backend", "auto")
        if backend not in ("auto", "xgrammar"):
            raise ValueError(f"{name}: backend {backend!r} is not served (auto or xgrammar: "
                             f"minisgl compiles constraints with xgrammar)")
        parser = options.get("reasoning_parser") or None
        if parser is not None and parser != self.reasoning_parser:
            raise ValueError(f"{name}: reasoning_parser {parser!r} must be the server's "
                             f"--reasoning-parser ({self.reasoning_parser!r})")
        if options.get("reasoning_parser_plugin"):
            raise ValueError(f"{name}: reasoning_parser_plugin is not served")
        for key, value in options.items():
            if key not in ("backend", "reasoning_parser", "reasoning_parser_plugin") and (
                    not isinstance(value, bool)):
                raise ValueError(f"{name}: {key} must be true or false, got {value!r}")
        return bool(options.get("enable_in_reasoning", False))

    @property
    def cors(self) -> CorsPolicy:
        """The CORS settings, parsed (ValueError naming a bad entry)."""
        return CorsPolicy(self.origins, parse_names(self.allowed_methods, "allowed_methods"),
                          parse_names(self.allowed_headers, "allowed_headers"),
                          self.allow_credentials)

    @property
    def tls(self) -> Optional[Tuple[str, str]]:
        """(keyfile, certfile) where the port speaks HTTPS, else None (both or neither, as
        __post_init__'s check_tls made sure, having loaded them once)."""
        if self.ssl_keyfile is None or self.ssl_certfile is None:
            return None
        return self.ssl_keyfile, self.ssl_certfile

    @property
    def on_loopback(self) -> bool:
        """Whether the HTTP server listens on a loopback address only."""
        return is_loopback(self.host)

    @property
    def resolved_device(self) -> str:
        return resolve_device(self.engine.device)

    @property
    def served_names(self) -> Tuple[str, ...]:
        """The names of `served_model_name`, in order (empty when unset)."""
        if self.served_model_name is None:
            return ()
        return tuple(n.strip() for n in self.served_model_name.split(","))

    def model_name(self, model_path: Path) -> str:
        """The model's name in replies: the first served name, else the hub id or directory."""
        return (self.served_names or (model_name(self.model, model_path),))[0]

    @property
    def model_aliases(self) -> Tuple[str, ...]:
        """The other names requests may use."""
        return self.served_names[1:]

    def check_combination(self) -> None:
        """Raise ValueError, naming the settings, for combinations only a rank's config judges
        (pdl 'on' or tune-gemms on a device 'auto' that is a CPU, ...): the launcher calls it
        before anything starts, so they fail like any other bad setting instead of inside a
        rank."""
        self.scheduler_config(Path("model"), 0, "tcp://127.0.0.1:0", "", "", "")

    def scheduler_config(self, model_path: Path, rank: int, dist_init_method: str,
                         backend_addr: str, detokenizer_addr: str, broadcast_addr: str,
                         wiring: Wiring = Wiring(), tokenizer_path: Optional[Path] = None
                         ) -> SchedulerConfig:
        """Rank `rank`'s config (of replica `wiring.replica`); the default wiring is one
        replica on one machine. `tokenizer_path`: --tokenizer's directory (None: the
        model's)."""
        engine = replace(self.engine.for_rank(str(model_path), rank, dist_init_method),
                         show_progress=False, device_index=wiring.device_index,
                         dist_store_prefix=wiring.store_prefix,
                         dist_timeout_s=self.cluster.dist_timeout)
        return replace(self.scheduler, engine=engine, backend_addr=backend_addr,
                       detokenizer_addr=detokenizer_addr, broadcast_addr=broadcast_addr,
                       broadcast_remote_addr=wiring.broadcast_remote, replica=wiring.replica,
                       node_ranks=wiring.node_ranks,
                       subscriber_timeout_s=self.cluster.dist_timeout,
                       tokenizer_path=str(tokenizer_path or model_path))


def _parser(root: ServerConfig) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve",
                                description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                   help="TOML file of settings (flags override it)")
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                   help="the model, as --model gives it (`serve MODEL`, as `vllm serve MODEL`)")
    add_flags(p, root, given_only=True)  # only flags actually given override the file
    return p


def load_file(path: Path) -> Dict[str, Any]:
    """Settings from a TOML file, by setting name; errors name the key."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    return check_values(ServerConfig(), raw, f"config file {str(path)!r}")


_LIST_FLAGS = ("--lora-modules", "--lora-paths")  # vLLM and SGLang take several words


def joined_lists(argv: Sequence[str]) -> List[str]:
    """`argv` with the words after a LoRA list flag that are entries of it (NAME=PATH, or
    vLLM's JSON objects) joined by commas into one value, as vLLM's and SGLang's
    `--lora-modules a=/p b=/q` give them; every other word as it is (a bare path after the
    first is taken for the model, as `serve MODEL` reads it)."""
    out: List[str] = []
    joining = False
    for word in argv:
        entry = "=" in word or word.lstrip().startswith("{")
        if joining and entry and not word.startswith("-"):
            out[-1] = (f"[{out[-1].strip('[]')},{word}]" if word.lstrip().startswith("{")
                       else f"{out[-1]},{word}")
            continue
        joining = bool(out) and out[-1] in _LIST_FLAGS and entry and not word.startswith("-")
        out.append(word)
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> ServerConfig:
    """The config from `argv` (default sys.argv[1:]; a LoRA list's words joined:
    `joined_lists`). Raises ValueError on a bad setting; argparse itself exits with status 2
    on malformed flags."""
    root = ServerConfig()
    words = joined_lists(sys.argv[1:] if argv is None else argv)
    given = vars(_parser(root).parse_args(words))
    if "model_arg" in given:
        if "model" in given:
            raise ValueError(f"the model is given twice: {given['model_arg']!r} and --model "
                             f"{given['model']!r}")
        given["model"] = given.pop("model_arg")
    settings: Dict[str, Any] = environment_settings(os.environ)  # under the file and flags
    path = given.pop("config", None)
    if path is not None:
        settings.update(load_file(path))
    settings.update(given)
    return build(root, settings, "command line")


_SECRET_SETTINGS = ("api_key", "hf_token")


def _shown(name: str, value: Any) -> str:
    return "<set>" if name in _SECRET_SETTINGS and value is not None else repr(value)


def describe(cfg: ServerConfig) -> List[str]:
    """`key = value` lines of every setting (logged at start-up); secrets are not shown."""
    return [f"{name} = {_shown(name, value)}" for name, value in setting_values(cfg).items()]
