"""The HTTP front end: an OpenAI-compatible API on FastAPI, served by uvicorn on uvloop.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /generate (token ids in and out), POST
/v1/responses (and /v1/conversations: conversations.py), POST /v1/messages and POST
/v1/messages/count_tokens (Anthropic's Messages API, whose errors take Anthropic's shape:
error_shapes.py), POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /v1/models, GET
/v1/models/{id}, GET /version, GET /health (200 only while the launcher reports every process
up), GET /metrics, GET /load, POST /invocations (SageMaker's: invocations.py). A chat or
completion with use_beam_search runs as a beam search (beam_search_api.py).
A POST body must be JSON: another declared content type gets a 415.
In front of the routes: the API key and Host checks (auth.py), then the body's size and read
deadline (limits.py); admission (429) and deadlines (408) are admission.py's.

A request's uids are released (unfinished ones aborted, so their KV pages are freed) when the
handler ends for any reason: response sent, error, or the client gone. Non-streaming handlers
poll for a disconnect while they wait; streaming responses watch for it concurrently.
All app state is built in `create_app`; nothing is global.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from minisgl.gc_heap import freeze_startup_heap
from minisgl.log import exit_now
from minisgl.message.startup import report_startup
from minisgl.message.types import ReplyChunk
from minisgl.models.classifier import pair_score_error
from minisgl.server.admission import Deadline, overloaded
from minisgl.server.anthropic_api import (CountTokensRequest, MessagesFormatter, MessagesRequest,
                                          count_tokens_prompt, messages_job)
from minisgl.server.api_config import ApiConfig
from minisgl.server.auth import AccessCheck
from minisgl.server.beam_search_api import BeamLimits, BeamServer, beam_search
from minisgl.server.error_shapes import COUNT_TOKENS_PATH, MESSAGES_PATH, error_body
from minisgl.server.invocations import invocation_route
from minisgl.server.limits import BodyLimits, route_path
from minisgl.server.request_log import REQUEST_ID_HEADER, RequestLog
from minisgl.server.health import HealthFile
from minisgl.server.metrics import Metrics
from minisgl.server.openapi import App, body as body_schema
from minisgl.server.classify import (CLASSIFY_PATHS, POOLING_PATH, ClassifyFormatter,
                                     ClassifyRequest, PoolingFormatter, classify_job)
from minisgl.server.embeddings import (EMBEDDINGS_PATH, EmbeddingFormatter, EmbeddingRequest,
                                       embeddings_job)
from minisgl.server.generate_request import GenerateRequest, generate_job
from minisgl.server.scores import (RERANK_PATHS, SCORE_PATHS, RerankFormatter, RerankRequest,
                                   ScoreFormatter, ScoreRequest, rerank_pairs, score_pairs)
from minisgl.server.protocol import (ApiError, ChatRequest, CompletionRequest, DetokenizeBody,
                                     Job, Prompt, TokenizeBody, chat_job, completion_job,
                                     constrained_from_the_start, detokenize_prompt, parse_body,
                                     refuse_untrusted_template, tokenize_prompt)
from minisgl.server.responses import (ChatFormatter, Choice, CompletionFormatter, Formatter,
                                      GenerateFormatter, SSEResponse)
from minisgl.server.responses_api import (ResponsesRequest, ResponseStore, items_page,
                                          response_messages,
                                          responses_job)
from minisgl.server.responses_background import BackgroundRuns
from minisgl.server.responses_output import ResponsesFormatter
from minisgl.server.stats_log import Totals, log_stats
from minisgl.server.batches_api import Batches, install_batch_routes
from minisgl.server.conversations import (ConversationLink, ConversationStore, conversation_id,
                                          install_conversation_routes)
from minisgl.server.lora_admin import Adapters, install_adapter_routes
from minisgl.server.pause_admin import Pause, install_pause_routes
from minisgl.server.profile_admin import install_profile_routes
from minisgl.server.weight_read_api import install_weight_read_route
from minisgl.server.sleep_admin import Sleep, install_sleep_routes
from minisgl.server.tracing import Traces
from minisgl.server.state_admin import Weights, install_state_routes
from minisgl.server.server_info import server_info
from minisgl.server.streams import RequestStream, RequestStreams, status_reason
from minisgl.server.tls import server_url

logger = logging.getLogger("minisgl.api")
CHAT_PAGE = Path(__file__).with_name("chat.html")
_DISCONNECT_POLL_S = 0.5
# /health_generate: one token of token id 0, within this many seconds (SGLang's probe)
HEALTH_GENERATE_BODY = GenerateRequest.model_validate(
    {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
HEALTH_GENERATE_S = 20.0


class ClientGone(Exception):
    pass


# --- running a job --------------------------------------------------------------------------------
class Waiter:
    """Takes a request's chunks, checking every `_DISCONNECT_POLL_S` (also while chunks keep
    coming) whether the client is still there, and that the request's deadline has not
    passed."""

    def __init__(self, stream: RequestStream, request: Request,
                 deadline: Deadline = Deadline()) -> None:
        self.stream, self.request, self.deadline = stream, request, deadline
        self.next_check = time.monotonic() + _DISCONNECT_POLL_S

    async def next(self) -> ReplyChunk:
        """The stream's next chunk; ClientGone if the client disconnects first, the deadline's
        ApiError (408) if it passes first (the response has not begun: `Deadline.first`)."""
        while True:
            left = self.deadline.left(started=False)
            if left <= 0:
                self.stream.abort_reason = "timeout"
                raise self.deadline.error()
            if time.monotonic() >= self.next_check:
                if await self.request.is_disconnected():
                    raise ClientGone()
                self.next_check = time.monotonic() + _DISCONNECT_POLL_S
            chunk = await self.stream.get(timeout=min(_DISCONNECT_POLL_S, left))
            if chunk is not None:
                return chunk


def _check(chunk: ReplyChunk, prompt_param: str = "prompt", job: Optional[Job] = None
           ) -> None:
    """ApiError for an error reply, naming the field (a chat request's prompt is its
    messages; a constraint that does not compile or a log-probability count, the field of
    `job` it came from)."""
    if chunk.error is not None:
        raise _chunk_error(chunk, prompt_param, job)


def _chunk_error(chunk: ReplyChunk, prompt_param: str = "prompt", job: Optional[Job] = None
                 ) -> ApiError:
    """The ApiError of an error reply: a server error (5xx, the service stopped), overload (429,
    from the tokenizer's admission) or the request's fault, naming the field (the message's
    leading name too, where the request calls it otherwise)."""
    if chunk.error_status == 429:
        return overloaded(chunk.error or "too many tokens queued")
    kind = "server_error" if chunk.error_status >= 500 else "invalid_request_error"
    ours = chunk.error_param
    if ours == "prompt":
        param: Optional[str] = prompt_param
    else:
        param = job.field(ours) if job is not None and ours is not None else ours
    message = chunk.error or ""
    if ours and param != ours:
        message = re.sub(rf"^{re.escape(ours)}\b", param or "", message)
    return ApiError(chunk.error_status, message, param, kind=kind)


def _version() -> str:
    try:
        return importlib.metadata.version("minisgl")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


async def json_body(request: Request) -> bytes:
    """The raw body of a POST whose declared content type is JSON (or none is declared);
    ApiError(415) otherwise."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(415, f"Unsupported Media Type: Only 'application/json' is allowed, got "
                            f"{kind!r}", kind="invalid_request_error")
    return await request.body()


async def run_text(request: Request, streams: RequestStreams, prompt: Optional[Prompt],
                   return_token_strs: bool = False, prompt_param: str = "prompt",
                   skip_special_tokens: bool = False) -> ReplyChunk:
    """A tokenize / detokenize / info round trip through the tokenizer process: its one
    reply (an error about the prompt names `prompt_param`)."""
    stream = streams.submit_text(prompt, return_token_strs, skip_special_tokens)
    try:
        chunk = await Waiter(stream, request).next()
    finally:
        streams.release(stream)
    _check(chunk, prompt_param)
    return chunk


OnEnd = Callable[[str, List[Choice]], None]  # (request id, the choices) once all ended


def output_logger(max_len: Optional[int]) -> OnEnd:
    """What --log-outputs does once a job's choices have all ended: one INFO line each (the
    request id, the choice's index, finish reason, tokens and text, cut to `max_len`)."""
    def log(rid: str, choices: List[Choice]) -> None:
        for i, c in enumerate(choices):
            text = "".join(c.text)
            logger.info("request %s choice %d: %s, %d tokens, output %r", rid, i,
                        c.finish_reason, c.completion_tokens,
                        text if max_len is None else text[:max_len])
    return log


async def run_job(request: Request, streams: RequestStreams, fmt: Formatter,
                  request_timeout: Optional[float] = None, on_end: Optional[OnEnd] = None
                  ) -> Response:
    """Submit the formatter's job and answer it (a stream, or the whole response); `on_end`
    hears the choices once all have ended (not where the client left or it failed)."""
    deadline = Deadline.of(request.headers, request_timeout, fmt.job.stream)
    stream = streams.submit(fmt.job)
    request.state.uids = stream.uids  # for the access log (request_log.py)
    choices = [Choice() for _ in stream.uids]
    rid = getattr(request.state, "request_id", "-")
    ended = None if on_end is None else (lambda: on_end(rid, choices))
    waiter = Waiter(stream, request, deadline)
    try:
        if fmt.job.stream:  # wait for every choice's first reply: errors still get a 4xx
            first: List[ReplyChunk] = []
            while len({c.uid for c in first}) < len(stream.uids):
                first.append(await waiter.next())
                _check(first[-1], fmt.prompt_param, fmt.job)
            return SSEResponse(_events(stream, fmt, choices, first, deadline, ended),
                               on_close=lambda: streams.release(stream))
        await _gather(stream, waiter, choices, fmt.prompt_param, fmt.job)
        if ended is not None:
            ended()
        return JSONResponse(fmt.full(choices))
    except ClientGone:
        streams.release(stream)
        return Response(status_code=499)
    except BaseException:
        streams.release(stream)
        raise


async def _gather(stream: RequestStream, waiter: Waiter, choices: List[Choice],
                  prompt_param: str, job: Job) -> None:
    """Every chunk of `stream` into its choice, until all ended; ApiError for an error reply
    (naming `job`'s field), ClientGone or the deadline's error as `waiter` raises them."""
    while stream.unfinished or not stream.queue.empty():
        chunk = await waiter.next()
        _check(chunk, prompt_param, job)
        choices[stream.index[chunk.uid]].add(chunk)


async def run_beam_search(request: Request, streams: RequestStreams, fmt: Formatter,
                          limits: BeamLimits, request_timeout: Optional[float] = None,
                          on_end: Optional[OnEnd] = None) -> Response:
    """Answer a use_beam_search job (beam_search_api.py): the search through the tokenizer and
    one job a step, then the choices as the formatter shapes them (a stream: each whole)."""
    deadline = Deadline.of(request.headers, request_timeout, False)

    async def encode(prompt: Prompt) -> List[int]:
        return (await run_text(request, streams, prompt, prompt_param=fmt.prompt_param)
                ).token_ids

    async def run(job: Job) -> List[ReplyChunk]:
        stream = streams.submit(job, counted=False)  # the search counts once, below
        choices = [Choice() for _ in stream.uids]
        try:
            await _gather(stream, Waiter(stream, request, deadline), choices, fmt.prompt_param,
                          job)
        finally:
            streams.release(stream)
        return [ReplyChunk(0, logprobs=c.logprobs) for c in choices]

    async def decode(ids: List[int], skip_special_tokens: bool) -> str:
        chunk = await run_text(request, streams, Prompt(input_ids=ids),
                               skip_special_tokens=skip_special_tokens)
        return chunk.text

    started, width = time.perf_counter(), len(fmt.job.prompts) * fmt.job.n
    try:
        chunks = await beam_search(fmt.job, BeamServer(encode, run, decode), limits)
    except ClientGone:
        streams.metrics.count_finished("abort", width)
        return Response(status_code=499)
    except ApiError as e:
        streams.metrics.count_finished(status_reason(e.status), width)
        raise
    for chunk in chunks:  # as many requests as choices, as a sampled request counts
        streams.metrics.count_finished(chunk.finish_reason or "")
        streams.metrics.observe_completed(time.perf_counter() - started, chunk.prompt_tokens,
                                          chunk.completion_tokens)
    choices = [Choice() for _ in chunks]
    for choice, chunk in zip(choices, chunks):
        choice.add(chunk)
    if on_end is not None:
        on_end(getattr(request.state, "request_id", "-"), choices)
    if not fmt.job.stream:
        return JSONResponse(fmt.full(choices))
    return SSEResponse(_whole_events(fmt, chunks, choices), on_close=lambda: None)


async def _whole_events(fmt: Formatter, chunks: List[ReplyChunk], choices: List[Choice]
                        ) -> AsyncIterator[str]:
    """A stream of finished choices: each opened, then each whole in one delta, then closed."""
    for i, chunk in enumerate(chunks):
        for line in fmt.opening(i, Choice(prompt_tokens=chunk.prompt_tokens)):
            yield line
    for i, chunk in enumerate(chunks):
        for line in fmt.delta(i, chunk, choices[i]):
            yield line
    for line in fmt.closing(choices):
        yield line


async def _events(stream: RequestStream, fmt: Formatter, choices: List[Choice],
                  first: List[ReplyChunk], deadline: Deadline = Deadline(),
                  ended: Optional[Callable[[], None]] = None) -> AsyncIterator[str]:
    for i in range(len(choices)):
        head = next(c for c in first if stream.index[c.uid] == i)
        for line in fmt.opening(i, Choice(prompt_tokens=head.prompt_tokens,
                                          prompt_logprobs=list(head.prompt_logprobs),
                                          prompt_ids=head.prompt_ids)):
            yield line
    buffered = list(first)
    while buffered or stream.unfinished or not stream.queue.empty():
        chunk = buffered.pop(0) if buffered else await stream.get(deadline.timeout(True))
        if chunk is None:  # past the deadline: an error event ends it (the release aborts)
            stream.abort_reason = "timeout"
            for line in fmt.error_events(deadline.error()):
                yield line
            return
        if chunk.error is not None:  # the service failed mid-stream: an error event ends it
            for line in fmt.error_events(_chunk_error(chunk)):
                yield line
            return
        i = stream.index[chunk.uid]
        choices[i].add(chunk)
        for line in fmt.delta(i, chunk, choices[i]):
            yield line
    if ended is not None:
        ended()
    for line in fmt.closing(choices):
        yield line


# --- the app --------------------------------------------------------------------------------------
def _error_response(e: ApiError, request: Request) -> JSONResponse:
    """The error's response, in the shape the request's path speaks (error_shapes.error_body:
    Anthropic's on the Messages API, OpenAI's elsewhere)."""
    return JSONResponse(error_body(e, route_path(request.scope)), status_code=e.status,
                        headers=e.headers or None)


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error_response(exc, request)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{exc.detail}: {request.method} {request.url.path}"
        return _error_response(ApiError(exc.status_code, msg, kind=kind), request)

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("internal error in %s %s", request.method, request.url.path)
        return _error_response(ApiError(500, f"internal server error: {type(exc).__name__}",
                                        kind="server_error"), request)

    async def client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # gone while its body was read: nobody to answer

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


def create_app(cfg: ApiConfig, is_healthy: Callable[[], bool]) -> App:
    """The app and all its state. `is_healthy` says whether every process of the service is up."""
    metrics = Metrics(cfg.replicas, cfg.model_name)
    streams = RequestStreams(cfg.tokenizer_addr, cfg.api_addr, metrics, cfg.max_queued_requests,
                             cfg.stream_interval)
    if cfg.otlp_traces_endpoint is not None:
        streams.traces = Traces(cfg.otlp_traces_endpoint, cfg.model_name)
    started = int(time.time())
    stored = ResponseStore()  # the Responses API's, and its background runs
    conversations = ConversationStore()  # the Conversations API's (conversations.py)
    on_end = output_logger(cfg.max_log_len) if cfg.log_outputs else None
    background = BackgroundRuns(streams, cfg.request_timeout, lambda chunk, fmt: _check(
        chunk, fmt.prompt_param, fmt.job), on_end)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(streams.serve_replies())]
        if cfg.log_stats_interval is not None:
            tasks.append(asyncio.create_task(log_stats(
                lambda: Totals.of(metrics.scheduler.values()), cfg.log_stats_interval)))
        yield
        for task in [*tasks, *background.tasks.values()]:
            task.cancel()
        streams.close()
        if streams.traces is not None:
            streams.traces.shutdown()

    app = App(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None,
              openapi_url="/openapi.json" if cfg.openapi else None)
    app.state.streams = streams  # serve_forever exits once they are `finished`
    app.body_models += [ChatRequest, CompletionRequest, ResponsesRequest, MessagesRequest,
                        CountTokensRequest, GenerateRequest, TokenizeBody, DetokenizeBody,
                        EmbeddingRequest, ScoreRequest, RerankRequest]
    _install_error_handlers(app)
    app.add_middleware(BodyLimits, max_bytes=cfg.max_request_bytes, timeout_s=cfg.body_timeout)
    app.add_middleware(AccessCheck, api_key=cfg.api_key, loopback_only=cfg.loopback_only)
    cors = cfg.cors
    if cors.origins:  # preflights answered before the key and Host checks (cors.py)
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins),
                           allow_methods=list(cors.methods), allow_headers=list(cors.headers),
                           allow_credentials=cors.credentials,
                           expose_headers=["X-Request-Id"])
    # outermost: sees every answer
    app.add_middleware(RequestLog, enabled=cfg.log_requests, count=metrics.count_http,
                       echo_id=cfg.request_id_headers)

    loras = Adapters(streams, cfg.replicas, cfg.lora_runtime, cfg.max_lora_rank,
                     cfg.lora_adapters, (cfg.model_name, *cfg.aliases))
    adapters = loras.paths  # changes as adapters load and unload
    install_adapter_routes(app, loras, json_body)
    # its path and version follow the updates
    weights = Weights(streams, cfg.replicas, cfg.weights_path, cfg.weight_version)
    install_state_routes(app, streams, weights, cfg.tp, json_body)
    install_pause_routes(app, Pause(streams, cfg.replicas), json_body)
    install_profile_routes(app, streams, cfg.replicas, json_body)
    install_weight_read_route(app, streams, cfg.replicas, json_body)
    sleep = Sleep(streams, cfg.replicas) if cfg.sleep_mode else None
    if sleep is not None:
        install_sleep_routes(app, sleep, cfg.weights_cpu_backup, json_body)
    app.state.self_url = ""  # serve_forever sets it: the batches' requests go there
    batches = Batches(cfg.max_file_bytes, cfg.api_key)
    install_batch_routes(app, batches, lambda: str(app.state.self_url), json_body)
    install_conversation_routes(app, conversations, json_body)

    def check_model(name: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's model names (None: the base model); ApiError 404 for
        a name this server does not serve."""
        if name is not None and name in adapters:
            return name
        if name is not None and name != cfg.model_name and name not in cfg.aliases:
            extra = f" and the LoRA adapters {', '.join(adapters)}" if adapters else ""
            raise ApiError(404, f"The model `{name}` does not exist. This server serves "
                                f"`{cfg.model_name}`{extra}.", "model", "model_not_found")
        return None

    def adapter_of(model: Optional[str], path: Any) -> Optional[str]:
        """The LoRA adapter a body asks for: SGLang's `lora_path` (a loaded adapter's name;
        ApiError 400 naming the field for another), else its model's (check_model)."""
        lora = check_model(model)
        if path is None:
            return lora
        if not isinstance(path, str) or path not in adapters:
            raise ApiError(400, f"lora_path {path!r:.60} names no LoRA adapter (loaded: "
                                f"{', '.join(adapters) or 'none'})", "lora_path")
        return path

    def with_lora(job: Job, lora: Optional[str]) -> Job:
        """The job's requests run with adapter `lora` (None: as they are)."""
        return job if lora is None else dataclasses.replace(
            job, params=dataclasses.replace(job.params, lora_name=lora))

    beam_limits = BeamLimits(cfg.eos_token_ids, cfg.max_context, cfg.max_logprobs)

    async def run(request: Request, fmt: Formatter) -> Response:
        if fmt.job.beam_search:  # chat and completions only (protocol.py reads it there)
            return await run_beam_search(request, streams, fmt, beam_limits,
                                         cfg.request_timeout, on_end)
        return await run_job(request, streams, fmt, cfg.request_timeout, on_end)

    def served(job: Job, request: Optional[Request]) -> Job:
        """The job as this server serves it, before its formatter is built (which reads it):
        the client's X-Request-Id, where `request` gives one, which the response id is built
        from (as vLLM builds it; else the formatter makes one); tool_choice auto refused where
        it is off; a stream's usage forced (--enable-force-include-usage); log-probability
        tokens as ids where the request left it to the server; usage without its prompt
        tokens' details where they are off; a reasoning model's
        constraint from its first token where configured (structured_outputs_config's
        enable_in_reasoning)."""
        check_tool_choice(job)
        given = request.headers.get(REQUEST_ID_HEADER) if request is not None else None
        if given is not None:
            job = dataclasses.replace(job, request_id=given)
        if streams.traces is not None and request is not None:
            job = dataclasses.replace(job, trace_headers=tuple(
                (k, v) for k in ("traceparent", "tracestate")
                if (v := request.headers.get(k)) is not None))
        if cfg.force_include_usage and job.stream:
            job = dataclasses.replace(job, include_usage=True)
        if job.tokens_as_ids is None:
            job = dataclasses.replace(job, tokens_as_ids=cfg.return_tokens_as_token_ids)
        if not cfg.prompt_tokens_details:
            job = dataclasses.replace(job, prompt_tokens_details=False)
        return constrained_from_the_start(job) if cfg.constrain_in_reasoning else job

    def check_tool_choice(job: Job) -> None:
        """ApiError 400 for tool_choice auto where the server reads no calls unasked
        (--no-auto-tool-choice: vLLM without --enable-auto-tool-choice)."""
        if not cfg.auto_tool_choice and job.tools is not None and job.tools.choice == "auto":
            raise ApiError(400, "tool_choice \"auto\" (the default with tools) is off on this "
                                "server (--no-auto-tool-choice; vLLM's --enable-auto-tool-choice "
                                "turns it on): send \"none\", \"required\" or a named "
                                "function", "tool_choice")

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest))
    async def chat(request: Request) -> Response:
        body = parse_body(await json_body(request), ChatRequest)
        refuse_untrusted_template(body, cfg.trust_request_chat_template)
        lora = adapter_of(body.model, (body.model_extra or {}).get("lora_path"))
        job = served(with_lora(chat_job(body, cfg.max_n, cfg.tool_call_parser,
                                        cfg.sampling_defaults, cfg.reasoning_parser), lora),
                     request)
        fmt = ChatFormatter(lora or cfg.model_name, job, cfg.reasoning_parser,
                            cfg.tool_call_parser, cfg.response_role)
        return await run(request, fmt)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_body(await json_body(request), CompletionRequest)
        lora = adapter_of(body.model, (body.model_extra or {}).get("lora_path"))
        job = served(with_lora(completion_job(body, cfg.max_n, cfg.sampling_defaults), lora),
                     request)
        fmt = CompletionFormatter(lora or cfg.model_name, job)
        return await run(request, fmt)

    @app.post(EMBEDDINGS_PATH, openapi_extra=body_schema(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        body = parse_body(await json_body(request), EmbeddingRequest)
        lora = embedding_model(body.model)
        job = served(with_lora(embeddings_job(body, cfg.hidden_size, cfg.matryoshka,
                                              cfg.pooling), lora), request)
        return await run(request, EmbeddingFormatter(lora or cfg.model_name, job,
                                                     body.encoding_format,
                                                     cfg.pooling.cut_to(body.dimensions)))

    def embedding_model(name: Optional[str]) -> Optional[str]:
        """check_model, and a 400 where this model's embeddings cannot be served (a
        classifier's among them)."""
        lora = check_model(name)
        if cfg.classifier is not None:
            raise ApiError(400, "this model is a sequence classifier: use /classify, /score "
                                "or /rerank", "model")
        if cfg.embedding_refusal is not None:
            raise ApiError(400, cfg.embedding_refusal, "model")
        return lora

    def scoring_model(name: Optional[str]) -> Optional[str]:
        """check_model, and a 400 where this model cannot score pairs: by embeddings (an
        embedding model) or as a cross-encoder (a one-label classifier)."""
        if cfg.classifier is None:
            return embedding_model(name)
        lora = check_model(name)
        refusal = pair_score_error(cfg.classifier)
        if refusal is not None:
            raise ApiError(400, refusal, "model")
        return lora

    async def score(request: Request) -> Response:
        body = parse_body(await json_body(request), ScoreRequest)
        lora = scoring_model(body.model)
        pairs = score_pairs(body, cfg.classifier is not None, cfg.pooling.mode,
                            cfg.pooling.logits)
        job = served(with_lora(pairs.job, lora), request)
        return await run(request, ScoreFormatter(lora or cfg.model_name, job, pairs))

    async def rerank(request: Request) -> Response:
        body = parse_body(await json_body(request), RerankRequest)
        lora = scoring_model(body.model)
        pairs = rerank_pairs(body, cfg.classifier is not None, cfg.pooling.mode,
                             cfg.pooling.logits)
        job = served(with_lora(pairs.job, lora), request)
        return await run(request, RerankFormatter(lora or cfg.model_name, job, pairs, body))

    async def classify(request: Request) -> Response:
        body = parse_body(await json_body(request), ClassifyRequest)
        lora = check_model(body.model)
        if cfg.classifier is None:
            raise ApiError(400, "classification needs a sequence classification model; this "
                                "one has no classification head", "model")
        job = served(with_lora(classify_job(body), lora), request)
        return await run(request, ClassifyFormatter(
            lora or cfg.model_name, job, cfg.classifier.labels,
            cfg.pooling.logits.for_request(body.use_activation)))

    @app.post(POOLING_PATH, openapi_extra=body_schema(ClassifyRequest))
    async def pooling(request: Request) -> Response:
        body = parse_body(await json_body(request), ClassifyRequest)
        lora = check_model(body.model)
        if cfg.classifier is None and cfg.embedding_refusal is not None:
            raise ApiError(400, cfg.embedding_refusal, "model")
        mode = "last" if cfg.classifier is not None else cfg.pooling.mode
        job = served(with_lora(classify_job(body, "pooling", mode), lora), request)
        return await run(request, PoolingFormatter(lora or cfg.model_name, job))

    for path in CLASSIFY_PATHS:
        app.post(path, openapi_extra=body_schema(ClassifyRequest))(classify)
    for path in SCORE_PATHS:
        app.post(path, openapi_extra=body_schema(ScoreRequest))(score)
    for path in RERANK_PATHS:
        app.post(path, openapi_extra=body_schema(RerankRequest))(rerank)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's single route (vLLM's): the body's fields pick the endpoint."""
        routes = {"chat": chat, "completions": completions, "embeddings": embeddings,
                  "classify": classify, "rerank": rerank, "score": score}
        route = invocation_route(await json_body(request), cfg.classifier is not None)
        return await routes[route](request)

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def responses(request: Request) -> Response:
        body = parse_body(await json_body(request), ResponsesRequest)
        lora = check_model(body.model)
        conv = conversation_id(body.conversation)
        messages = response_messages(body, stored, () if conv is None
                                     else conversations.messages(conv))
        job = served(with_lora(responses_job(
            body, messages, cfg.max_n, cfg.sampling_defaults, cfg.tool_call_parser,
            cfg.reasoning_parser), lora), request)
        fmt = ResponsesFormatter(lora or cfg.model_name, job, body, messages, stored,
                                 cfg.reasoning_parser, cfg.tool_call_parser,
                                 None if conv is None else ConversationLink(conversations, conv))
        if body.background:
            return JSONResponse(background.start(fmt))
        return await run(request, fmt)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Dict[str, Any]:
        await background.cancel(response_id)
        return stored.stored(response_id).response

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Dict[str, Any]:
        """A stored response as it was answered (store: true; the newest kept)."""
        return stored.stored(response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, limit: str = "20", order: str = "desc",
                                   after: Optional[str] = None) -> Dict[str, Any]:
        """A stored response's input items, a page at a time (the SDK's
        `responses.input_items.list`)."""
        return items_page(stored.stored(response_id).items, limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Dict[str, Any]:
        """Drop a stored response (one still running in the background is stopped first, so
        that its end does not store it again)."""
        stored.stored(response_id)  # a 404 for one not kept, before anything is stopped
        await background.stop(response_id)
        stored.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post(MESSAGES_PATH, openapi_extra=body_schema(MessagesRequest))
    async def messages(request: Request) -> Response:
        body = parse_body(await json_body(request), MessagesRequest)
        lora = check_model(body.model)
        job = served(with_lora(messages_job(body, cfg.max_n, cfg.tool_call_parser,
                                            cfg.sampling_defaults, cfg.reasoning_parser), lora),
                     request)
        fmt = MessagesFormatter(lora or cfg.model_name, job, cfg.reasoning_parser,
                                cfg.tool_call_parser)
        return await run(request, fmt)

    @app.post(COUNT_TOKENS_PATH, openapi_extra=body_schema(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        """The prompt tokens a messages request with this body would have."""
        body = parse_body(await json_body(request), CountTokensRequest)
        check_model(body.model)
        try:
            chunk = await run_text(request, streams,
                                   count_tokens_prompt(body, cfg.tool_call_parser),
                                   prompt_param="messages")
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": len(chunk.token_ids)})

    @app.post("/generate", openapi_extra=body_schema(GenerateRequest))
    async def generate(request: Request) -> Response:
        body = parse_body(await json_body(request), GenerateRequest)
        lora = adapter_of(None, body.lora_path)
        job = with_lora(generate_job(body, cfg.sampling_defaults, cfg.max_n), lora)
        # SGLang echoes `rid` (RL frameworks key rollouts by it); a proxy's X-Request-Id
        # must not replace it, and still names the response in the log and its header.
        job = served(job, None if body.rid is not None else request)
        return await run(request, GenerateFormatter(cfg.model_name, job,
                                                     cfg.incremental_streaming_output,
                                                     lambda: weights.version))

    async def text_endpoint(request: Request, body_type: Any, prompt_of: Callable[[Any], Prompt],
                            reply: Callable[[ReplyChunk], Dict[str, Any]]) -> Response:
        """/tokenize and /detokenize: parse, one round trip to the tokenizer, reply."""
        body = parse_body(await json_body(request), body_type)
        check_model(body.model)
        try:
            chunk = await run_text(request, streams, prompt_of(body),
                                   getattr(body, "return_token_strs", False))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(reply(chunk))

    def tokenized(chunk: ReplyChunk) -> Dict[str, Any]:
        out = {"tokens": chunk.token_ids, "count": len(chunk.token_ids),
               "max_model_len": cfg.max_context}
        if chunk.token_strs is not None:
            out["token_strs"] = chunk.token_strs
        return out

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeBody))
    async def tokenize(request: Request) -> Response:
        def prompt_of(body: TokenizeBody) -> Prompt:
            refuse_untrusted_template(body, cfg.trust_request_chat_template)
            return tokenize_prompt(body)

        return await text_endpoint(request, TokenizeBody, prompt_of, tokenized)

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeBody))
    async def detokenize(request: Request) -> Response:
        return await text_endpoint(request, DetokenizeBody, detokenize_prompt,
                                   lambda c: {"prompt": c.text})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        try:
            chunk = await run_text(request, streams, None)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(json.loads(chunk.text))

    @app.get("/version")
    async def version() -> Dict[str, Any]:
        return {"version": _version()}

    def model_card() -> Dict[str, Any]:
        """vLLM's model card: OpenAI's fields, the model's `root` and its context length."""
        return {"id": cfg.model_name, "object": "model", "created": started,
                "owned_by": "minisgl", "root": cfg.root or cfg.model_name, "parent": None,
                "max_model_len": cfg.max_context, "permission": []}

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list",
                "data": [model_card()] + [{**model_card(), "id": a} for a in cfg.aliases]
                + [{**model_card(), "id": name, "root": path, "parent": cfg.model_name}
                   for name, path in adapters.items()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Dict[str, Any]:
        check_model(name)
        return {**model_card(), "id": name}  # an alias's card, as /v1/models lists it

    chat_page = CHAT_PAGE.read_text()

    @app.get("/")
    async def page() -> Response:
        """The web chat page (one static file; it talks to /v1/chat/completions, under the
        proxy's prefix where there is one: --root-path, checked to be a plain path)."""
        return HTMLResponse(chat_page.replace('const ROOT = "";',
                                              f'const ROOT = "{cfg.root_path}";'))

    # HEAD: probes that read no body; /ping: vLLM's (SageMaker's) name for it
    @app.each_method("/health", ["GET", "HEAD"])
    @app.each_method("/ping", ["GET", "POST"])
    async def health() -> Response:
        if is_healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    if cfg.server_load_tracking:
        @app.get("/load")
        async def load() -> Dict[str, Any]:
            """vLLM's: the generation requests in flight (each HTTP request once, streams
            until they end)."""
            return {"server_load": streams.in_flight}

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """SGLang's deep probe: healthy where a one-token generation goes through the whole
        path (tokenizer, every rank of a replica, detokenizer) within HEALTH_GENERATE_S."""
        if not is_healthy():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        job = generate_job(HEALTH_GENERATE_BODY, cfg.sampling_defaults, cfg.max_n)
        try:
            answer = await asyncio.wait_for(run(request, GenerateFormatter(
                cfg.model_name, job, False)), HEALTH_GENERATE_S)
        except (asyncio.TimeoutError, ApiError):
            answer = Response(status_code=503)
        if answer.status_code != 200:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def model_info() -> Dict[str, Any]:
        """SGLang's: the checkpoint served (the last one reloaded: state_admin.py), its
        tokenizer, and whether it generates text (a sequence classifier does not)."""
        return {"model_path": weights.path or cfg.root, "tokenizer_path": cfg.tokenizer_path,
                "is_generation": cfg.classifier is None, "preferred_sampling_params": None,
                "weight_version": weights.version}

    @app.get("/get_server_info")
    async def get_server_info() -> Dict[str, Any]:
        """SGLang's (server_info.py): the model served, its sizes, each replica's state."""
        return server_info({"model_path": weights.path or cfg.root, "served_model_name":
                            cfg.model_name, "tokenizer_path": cfg.tokenizer_path,
                            "context_length": cfg.max_context, "tp_size": cfg.tp,
                            "dp_size": cfg.replicas, "weight_version": weights.version,
                            "version": _version()}, metrics.replica_stats())

    @app.get("/metrics")
    async def prometheus() -> Response:
        sleep_state = [] if sleep is None else [sleep.gauge()]
        return PlainTextResponse(metrics.render([loras.gauge(), *batches.gauges(),
                                                 *sleep_state]),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _not_startup_lines(record: logging.LogRecord) -> bool:
    """Drop uvicorn's "Application startup complete" (and its "Waiting for application
    startup"): the HTTP server is up long before the ranks are, and the launcher's ready line
    is what says the service is."""
    return "application startup" not in record.getMessage().lower()


def _loopback_url(address: Any, tls: bool) -> str:
    """This server's URL from its socket's address, a wildcard address as loopback."""
    host, port = address[0], address[1]
    return server_url({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), port, tls)


def serve_forever(cfg: ApiConfig, sock: Any, is_healthy: Callable[[], bool],
                  on_listening: Callable[[], None], log_level: str) -> None:
    """Serve on the already bound socket `sock` until the process is terminated or the
    launcher stops or drains the service (`streams.py`: then every reply in flight is sent and
    the server exits); call `on_listening` once uvicorn accepts connections. Signals are left
    to the launcher."""
    import uvicorn
    import uvloop

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # SIGTERM keeps its default action; SIGINT is ignored by every child

    logging.getLogger("uvicorn.error").addFilter(_not_startup_lines)
    app = create_app(cfg, is_healthy)
    app.state.self_url = _loopback_url(sock.getsockname(), cfg.tls is not None)
    keyfile, certfile = cfg.tls or (None, None)
    config = uvicorn.Config(app, log_config=None, access_log=cfg.uvicorn_access_log,
                            lifespan="on",
                            log_level=(cfg.uvicorn_log_level or log_level).lower(),
                            timeout_graceful_shutdown=1, ssl_keyfile=keyfile,
                            ssl_certfile=certfile, root_path=cfg.root_path)
    server = _Server(config)

    async def main() -> None:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            on_listening()
        finished = asyncio.ensure_future(app.state.streams.finished.wait())
        await asyncio.wait([serving, finished], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True  # stopped or drained: close, letting the last replies out
        await serving

    uvloop.run(main())
    if not server.started:
        raise RuntimeError("the HTTP server failed to start")


def run_api(cfg: ApiConfig, sock: Any, log_level: str, conn: Any) -> None:
    """Process entry: serve; report ("ready", "api", {}) once listening (the start-up heap
    frozen: gc_heap.py) or ("error", ...)."""
    def ready() -> None:
        freeze_startup_heap(logger, "api")
        conn.send(("ready", "api", {}))
    with report_startup(conn, "api", logger):
        serve_forever(cfg, sock, HealthFile(cfg.health_file).is_up, ready, log_level)
    exit_now(0)  # every reply is out: the launcher need not wait for the teardown
