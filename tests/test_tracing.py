"""Request traces to an OpenTelemetry collector (vLLM's --otlp-traces-endpoint): a served tiny
model exports to a fake OTLP/HTTP collector in this process, whose protobuf requests are
decoded with OpenTelemetry's own definitions.

What must hold: one "llm_request" span per generation request, a child of the client's W3C
traceparent (same trace id, the client's span its parent), with the request's id, sampling
parameters, token counts and latencies; an aborted request's span has an error status; a bad
endpoint is refused at start-up naming the setting.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from minisgl.server.args import parse_args

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace collector on a free loopback port: every span it was sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest)
        spans: List[Any] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans
                             for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.spans = spans
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def wait_for(self, count: int, timeout_s: float = 30.0) -> List[Any]:
        deadline = time.monotonic() + timeout_s
        while len(self.spans) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.spans)


def _attributes(span: Any) -> Dict[str, Any]:
    def value(v: Any) -> Any:
        return getattr(v, v.WhichOneof("value"))
    return {kv.key: value(kv.value) for kv in span.attributes}


def test_a_span_per_request_as_a_child_of_the_clients_trace(
        tiny_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    from server_helpers import CPU_ARGS, serving
    collector = Collector()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within a tenth of a second
    model = tiny_model("llama")
    with serving(["--model", str(model), "--otlp-traces-endpoint", collector.url,
                  "--collect-detailed-traces", "model,worker",
                  "--served-model-name", "tiny", *CPU_ARGS], tmp_path) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={
            "model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 6, "temperature": 0.5,
            "top_p": 0.9, "n": 2, "ignore_eos": True},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "req-7"},
            timeout=60)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={
                "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
                "ignore_eos": True}, timeout=60) as stream:
            for line in stream.iter_lines():  # the client goes after its first token
                if line.startswith("data: {"):
                    break
        spans = collector.wait_for(2)
    assert [s.name for s in spans] == ["llm_request", "llm_request"]
    traced, aborted = spans
    assert traced.trace_id.hex() == TRACE_ID and traced.parent_span_id.hex() == PARENT_ID
    a = _attributes(traced)
    assert (a["gen_ai.request.id"], a["gen_ai.response.model"], a["gen_ai.request.n"],
            a["gen_ai.request.max_tokens"], a["gen_ai.usage.prompt_tokens"],
            a["gen_ai.usage.completion_tokens"]) == ("req-7", "tiny", 2, 6, 5, 12)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    # the scheduler's phases (vLLM's detailed latencies): queue + prefill within the TTFT,
    # prefill + decode the inference time, all within the request's end-to-end time
    queue = a["gen_ai.latency.time_in_queue"]
    prefill = a["gen_ai.latency.time_in_model_prefill"]
    assert 0 <= queue and 0 < prefill
    assert queue + prefill <= a["gen_ai.latency.time_to_first_token"]
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
        prefill + a["gen_ai.latency.time_in_model_decode"])
    assert a["gen_ai.latency.time_in_model_inference"] <= a["gen_ai.latency.e2e"]
    assert traced.status.code == 0  # unset: no error
    assert aborted.trace_id.hex() != TRACE_ID and not aborted.parent_span_id
    assert aborted.status.code == 2 and "abort" in aborted.status.message  # ERROR
    assert _attributes(aborted)["gen_ai.usage.completion_tokens"] < 400


def test_a_bad_endpoint_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http:// or https://"):
        parse_args(["--otlp-traces-endpoint", "collector:4317"])
    with pytest.raises(ValueError, match="collect_detailed_traces needs otlp_traces_endpoint"):
        parse_args(["--collect-detailed-traces", "all"])
    with pytest.raises(ValueError, match="takes model, worker, all .*got 'gpu'"):
        parse_args(["--collect-detailed-traces", "gpu", "--otlp-traces-endpoint",
                    "http://collector:4318/v1/traces"])
