"""The API server process's configuration (`ApiConfig`), kept apart from the HTTP stack so that
the launcher builds it without importing FastAPI (server/api.py serves it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from minisgl.models.classifier import Classifier
from minisgl.models.generation import SamplingDefaults
from minisgl.models.pooling import Pooling
from minisgl.server.cors import CorsPolicy


@dataclass(frozen=True)
class ApiConfig:
    model_name: str
    max_context: int
    max_n: int
    tokenizer_addr: str  # PUSH: requests and aborts to the tokenizer
    api_addr: str  # PULL, bound here: replies from the detokenizer and tokenizer
    health_file: str  # exists while the launcher sees every process of the service up
    replicas: int = 1  # data-parallel replicas (their scheduler metrics are labelled)
    root: str = ""  # the model's directory (vLLM's model card `root`); "" names the model
    reasoning_parser: Optional[str] = None  # server/reasoning.py: splits chat output
    # vLLM's enable_in_reasoning: a reasoning model's constraint holds from its first token
    constrain_in_reasoning: bool = False
    tool_call_parser: str = "hermes"  # server/tool_calls.py: reads (and enforces) tool calls
    aliases: Tuple[str, ...] = ()  # more names requests may give the model
    # (name, directory) of each LoRA adapter loaded at start-up: a request naming one as its
    # model runs with it; with lora_runtime, more load at run time (lora_admin.py)
    lora_adapters: Tuple[Tuple[str, str], ...] = ()
    lora_runtime: bool = False
    max_lora_rank: int = 16
    weights_path: Optional[str] = None  # the checkpoint served (None: dummy weights)
    weight_version: str = "default"  # SGLang's version of the weights served, at start-up
    sleep_mode: bool = False  # /sleep, /wake_up, /is_sleeping served (sleep_admin.py)
    otlp_traces_endpoint: Optional[str] = None  # a span per request to it (tracing.py)
    weights_cpu_backup: bool = False  # SGLang's release keeps the weights (sleep level 1)
    tp: int = 1  # each replica's ranks (a trainer's weight update group holds them all)
    tokenizer_path: str = ""  # the tokenizer's directory (SGLang's /get_model_info)
    incremental_streaming_output: bool = False  # /generate streams what is new (SGLang's)
    max_file_bytes: int = 512 << 20  # the Files API's files held in all (batches_api.py)
    hidden_size: int = 0  # the model's: an embedding's length
    embedding_refusal: Optional[str] = None  # why embeddings cannot be served (pooling.py)
    pooling: Pooling = Pooling()  # how the model's embeddings pool the prompt (pooling.py)
    classifier: Optional[Classifier] = None  # a sequence classifier's head (classify.py)
    matryoshka: Optional[Tuple[int, ...]] = None  # ModelConfig.matryoshka_dimensions
    tls: Optional[Tuple[str, str]] = None  # (keyfile, certfile): HTTPS only (tls.py)
    # clients must send it as a Bearer token, or as x-api-key on the Messages API (auth.py);
    # not in the repr, which logs may show
    api_key: Optional[str] = field(default=None, repr=False)
    loopback_only: bool = False  # listening on loopback: Host headers must name it
    cors: CorsPolicy = CorsPolicy()  # web origins whose pages may call, and how (cors.py)
    uvicorn_log_level: Optional[str] = None  # the HTTP server's own (None: the service's)
    root_path: str = ""  # a reverse proxy's prefix, removed before it forwards (uvicorn's)
    openapi: bool = True  # /openapi.json served (vLLM's --disable-fastapi-docs: not)
    request_id_headers: bool = True  # responses carry X-Request-Id (request_log.py)
    prompt_tokens_details: bool = True  # chat / completion usage carries cached_tokens
    response_role: str = "assistant"  # the role chat replies name (vLLM's --response-role)
    max_queued_requests: Optional[int] = None  # admission.py
    request_timeout: Optional[float] = None  # seconds, admission.Deadline
    max_request_bytes: int = 32 << 20  # limits.py
    body_timeout: float = 30.0  # seconds to receive a body, limits.py
    # what a request leaves unset takes (models/generation.py: the model's recommendation)
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    log_requests: bool = True  # one access-log line per request (request_log.py)
    log_outputs: bool = False  # a line per finished choice, its text (`output_logger`)
    max_log_len: Optional[int] = None  # characters of a logged output (None: all)
    auto_tool_choice: bool = True  # tool_choice auto served (else a 400, as vLLM's default)
    force_include_usage: bool = False  # every stream ends with its usage (vLLM's flag)
    log_stats_interval: Optional[float] = None  # seconds between stats lines (stats_log.py)
    return_tokens_as_token_ids: bool = False  # vLLM's: where a request leaves it unset
    trust_request_chat_template: bool = False  # requests may bring their own chat template
    uvicorn_access_log: bool = False  # uvicorn's own access lines, besides RequestLog's
    server_load_tracking: bool = True  # GET /load served (vLLM's)
    eos_token_ids: Tuple[int, ...] = ()  # the model's: a beam search's beams end at one
    max_logprobs: int = 20  # the engine's cap (SchedulerConfig.logprobs_cap)
    stream_interval: int = 1  # a streamed chunk's tokens after the first (--stream-interval)
