"""Request traces for an OpenTelemetry collector (vLLM's `--otlp-traces-endpoint`).

One span per generation request over HTTP ("llm_request", kind SERVER), from its arrival at the
API server to its release (its last token sent, or its abort), a child of the client's trace
where the request carries a W3C `traceparent` header (`tracestate` too), with vLLM's
attributes: `gen_ai.request.id`, `gen_ai.response.model`, the sampling parameters
(`gen_ai.request.temperature`, `top_p`, `top_k`, `max_tokens`, `n`), the token counts
(`gen_ai.usage.prompt_tokens`, `completion_tokens`) and the latencies in seconds
(`gen_ai.latency.time_to_first_token`, `gen_ai.latency.e2e`); a request that ended in an error
or an abort has an error status naming why.

Spans are exported in batches on the SDK's own thread, so a slow or absent collector never
holds the event loop: OTLP over HTTP/protobuf, or gRPC where OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
is "grpc" (and its exporter is installed); the SDK's other OTEL_* variables apply
(OTEL_SERVICE_NAME, whose default here is "minisgl"; OTEL_BSP_SCHEDULE_DELAY). It needs
`pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http`: a service asked to
trace without them stops at start-up naming them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

from minisgl.message.types import PhaseTimes

PACKAGES = "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"


@dataclass
class SpanRecord:
    """One request's span as it goes (RequestStreams fills the counts and times)."""

    start_ns: int
    parent: Any  # the client's context (opentelemetry.context.Context), or None
    attributes: Dict[str, Any]
    first_token: Optional[float] = None  # perf_counter of the first token of any choice
    times: Optional[PhaseTimes] = None  # that choice's queue and prefill times (scheduler)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None  # an error or abort reason: the span's status


DETAILED_TRACES = ("model", "worker", "all")


def check_detailed_traces(modules: Optional[str], endpoint: Optional[str]) -> None:
    """vLLM's --collect-detailed-traces: ValueError naming a module other than model, worker
    or all, or the flag without an endpoint to send the spans to."""
    if modules is None:
        return
    other = [m for m in modules.split(",") if m.strip() not in DETAILED_TRACES]
    if other:
        raise ValueError(f"collect_detailed_traces takes {', '.join(DETAILED_TRACES)} "
                         f"(comma-separated), got {other[0]!r}")
    if endpoint is None:
        raise ValueError("collect_detailed_traces needs otlp_traces_endpoint (the collector "
                         "that gets the spans)")


def check_installed(endpoint: str) -> None:
    """ValueError naming the setting where `endpoint` is no URL, or the packages to install
    where the SDK or the exporter its protocol takes (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) is
    missing; run at start-up, before any child starts."""
    grpc = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "") == "grpc"
    if not grpc and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL (OTLP over "
                         f"HTTP; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for gRPC), got "
                         f"{endpoint!r}")
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if grpc
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        __import__("opentelemetry.sdk.trace")
        __import__(module)
    except ImportError as e:
        wanted = PACKAGES.replace("proto-http", "proto-grpc") if grpc else PACKAGES
        raise ValueError(f"otlp_traces_endpoint needs the OpenTelemetry SDK and its OTLP "
                         f"exporter: pip install {wanted} ({e})") from None


class Traces:
    """The service's tracer: `begin` as a request arrives, `end` as it is released."""

    def __init__(self, endpoint: str, model: str) -> None:
        check_installed(endpoint)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter)
        service = os.environ.get("OTEL_SERVICE_NAME", "minisgl")
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("minisgl")
        self._propagator = TraceContextTextMapPropagator()
        self.model = model

    def begin(self, headers: Dict[str, str], attributes: Dict[str, Any]) -> SpanRecord:
        """A request arrived with these `headers` (its traceparent / tracestate, lower-case
        names) and sampling attributes."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        return SpanRecord(time.time_ns(), parent, {"gen_ai.response.model": self.model,
                                                   **attributes})

    def end(self, record: SpanRecord, created: float) -> None:
        """The request (arrived at perf_counter `created`) was released: its span, ended now,
        to the exporter's queue."""
        from opentelemetry.trace import SpanKind, Status, StatusCode
        now = time.perf_counter()
        attributes = dict(record.attributes)
        attributes["gen_ai.usage.prompt_tokens"] = record.prompt_tokens
        attributes["gen_ai.usage.completion_tokens"] = record.completion_tokens
        attributes["gen_ai.latency.e2e"] = now - created
        if record.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = record.first_token - created
        if record.times is not None and record.first_token is not None:  # vLLM's names
            decode = now - record.first_token
            attributes["gen_ai.latency.time_in_queue"] = record.times.queued_s
            attributes["gen_ai.latency.time_in_model_prefill"] = record.times.prefill_s
            attributes["gen_ai.latency.time_in_model_decode"] = decode
            attributes["gen_ai.latency.time_in_model_inference"] = record.times.prefill_s + decode
        span = self._tracer.start_span("llm_request", context=record.parent,
                                       kind=SpanKind.SERVER, attributes=attributes,
                                       start_time=record.start_ns)
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, record.error))
        span.end()

    def shutdown(self) -> None:
        """Export what is queued (at the API server's exit)."""
        self._provider.shutdown()
