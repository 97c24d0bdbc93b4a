"""Prometheus metrics of the API server, rendered in the text exposition format (version 0.0.4).

Scheduler gauges and counters are copied from rank 0's latest `SchedulerStats` (forwarded by the
detokenizer; rank 0 pushes them every `--stats-interval` seconds besides its replies, so they
are at most that old, or, during one long forward, as of that forward's launch), per
data-parallel replica: with more than one, every scheduler line carries a
`replica` label. Latency histograms are measured here, when replies arrive at the API server.
The same values follow under vLLM's names and labels (metrics_vllm.py).
One `Metrics` object per app (built in the app factory); not thread-safe (event-loop only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from minisgl.message.types import PhaseTimes, SchedulerStats
from minisgl.server.metrics_vllm import vllm_lines

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Tokens per request: 1, 2, 5, 10, 20, 50, ... up to a million (past any context served).
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5) if m * 10 ** e
                       <= 1_000_000)

# SchedulerStats field -> (metric name, type, help)
_SCHEDULER_METRICS: Dict[str, Tuple[str, str, str]] = {
    "running": ("minisgl_num_requests_running", "gauge", "Requests in the decode batch."),
    "waiting": ("minisgl_num_requests_waiting", "gauge",
                "Requests waiting for admission or still prefilling."),
    "kv_pages_used": ("minisgl_kv_pages_used", "gauge",
                      "KV pages held by live requests (not counting the prefix cache)."),
    "kv_pages_total": ("minisgl_kv_pages_total", "gauge", "KV pages in the pool."),
    "kv_pages_cached": ("minisgl_kv_pages_cached", "gauge", "KV pages held by the prefix cache."),
    "prompt_tokens_total": ("minisgl_prompt_tokens_total", "counter",
                            "Prompt tokens of admitted requests."),
    "generated_tokens_total": ("minisgl_generation_tokens_total", "counter",
                               "Tokens generated."),
    "cached_tokens_total": ("minisgl_cached_prompt_tokens_total", "counter",
                            "Prompt tokens served from the prefix cache."),
    "prefilled_tokens_total": ("minisgl_prefill_tokens_total", "counter",
                               "Prompt tokens computed in prefill batches."),
    "retracted_requests_total": ("minisgl_num_preemptions_total", "counter",
                                 "Running requests retracted (preempted) for KV room; each "
                                 "waits again and recomputes what the prefix cache lost."),
    "evicted_pages_total": ("minisgl_kv_pages_evicted_total", "counter",
                            "Prefix-cache KV pages evicted for room."),
    "prefill_steps_total": ("minisgl_prefill_steps_total", "counter", "Prefill forward passes."),
    "decode_steps_total": ("minisgl_decode_steps_total", "counter", "Decode forward passes."),
    "prefill_seconds_total": ("minisgl_prefill_seconds_total", "counter",
                              "Wall time of prefill forward passes."),
    "decode_seconds_total": ("minisgl_decode_seconds_total", "counter",
                             "Wall time of decode forward passes."),
    "wait_seconds_total": ("minisgl_device_wait_seconds_total", "counter",
                           "Time the scheduler waited for device results (near zero: host-bound)."),
    "verify_steps_total": ("minisgl_verify_steps_total", "counter",
                           "Decode forward passes that verified draft tokens (speculative "
                           "decoding; counted in the decode passes too)."),
    "spec_draft_tokens_total": ("minisgl_spec_draft_tokens_total", "counter",
                                "Draft tokens proposed by n-gram lookup."),
    "spec_accepted_tokens_total": ("minisgl_spec_accepted_tokens_total", "counter",
                                   "Draft tokens kept (each one a decode step saved)."),
}


@dataclass
class Histogram:
    name: str
    help: str
    buckets: Sequence[float]
    counts: List[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1

    def render(self, name: Optional[str] = None, labels: str = "") -> List[str]:
        """The exposition lines, under `name` (default its own) with `labels` (`k="v",...`)
        on every line."""
        name = name or self.name
        tag, sep = (f"{{{labels}}}", ",") if labels else ("", "")
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        for upper, count in zip(self.buckets, self.counts):
            lines.append(f'{name}_bucket{{{labels}{sep}le="{upper}"}} {count}')
        lines += [f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}',
                  f"{name}_sum{tag} {self.total}", f"{name}_count{tag} {self.n}"]
        return lines


def _histogram(name: str, help: str, buckets: Sequence[float]) -> Any:
    """A Metrics field holding a fresh Histogram of this name, help and buckets."""
    return field(default_factory=lambda: Histogram(name, help, buckets))


@dataclass
class Metrics:
    replicas: int = 1
    model_name: str = ""  # the served name: vLLM's lines carry it (metrics_vllm.py)
    scheduler: Dict[int, SchedulerStats] = field(default_factory=dict)  # by replica
    ttft: Histogram = _histogram(
        "minisgl_time_to_first_token_seconds",
        "Time from a request's arrival to its first output token.", _TTFT_BUCKETS)
    itl: Histogram = _histogram(
        "minisgl_inter_token_latency_seconds",
        "Time between consecutive output tokens of a request.", _ITL_BUCKETS)
    e2e: Histogram = _histogram(
        "minisgl_e2e_request_latency_seconds",
        "Time from a request's arrival to its last token, of requests that finished by stop "
        "or length.", _E2E_BUCKETS)
    prompt_tokens: Histogram = _histogram(
        "minisgl_request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
    generation_tokens: Histogram = _histogram(
        "minisgl_request_generation_tokens", "Generated tokens per finished request.",
        _TOKEN_BUCKETS)
    # A finished request's phases (vLLM's): waiting for admission, admission to its first
    # token, first token to last, admission to last
    queue_time: Histogram = _histogram(
        "minisgl_request_queue_time_seconds",
        "Time a finished request waited for admission (scheduler).", _E2E_BUCKETS)
    prefill_time: Histogram = _histogram(
        "minisgl_request_prefill_time_seconds",
        "Time from a finished request's admission to its first token.", _E2E_BUCKETS)
    decode_time: Histogram = _histogram(
        "minisgl_request_decode_time_seconds",
        "Time from a finished request's first token to its last.", _E2E_BUCKETS)
    inference_time: Histogram = _histogram(
        "minisgl_request_inference_time_seconds",
        "Time from a finished request's admission to its last token.", _E2E_BUCKETS)
    finished: Dict[str, int] = field(default_factory=dict)  # by finish reason (and "error")
    http: Dict[Tuple[str, str], int] = field(default_factory=dict)  # by (route, status)

    def update(self, stats: Optional[SchedulerStats]) -> None:
        """Keep the newer of `stats` and those held (they come on two paths, see seq)."""
        if stats is None:
            return
        held = self.scheduler.get(stats.replica)
        if held is None or stats.seq > held.seq:
            self.scheduler[stats.replica] = stats

    def _stats(self, replica: int) -> SchedulerStats:
        return self.scheduler.get(replica) or SchedulerStats()

    def replica_stats(self) -> List[SchedulerStats]:
        """Each replica's latest stats, in replica order (empty ones before the first)."""
        return [self._stats(d) for d in range(self.replicas)]

    def count_finished(self, reason: str, count: int = 1) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + count

    def count_http(self, route: str, status: str) -> None:
        """An HTTP request answered (`status`: its code, or "unfinished" where the client left
        or the server failed before the answer ended) on `route` (request_log.route_label)."""
        key = (route, status)
        self.http[key] = self.http.get(key, 0) + 1

    def observe_completed(self, seconds: float, prompt_tokens: int, generated: int) -> None:
        """A request (one choice) that finished by stop or length, `seconds` after it
        arrived."""
        self.e2e.observe(seconds)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)

    def observe_phases(self, times: PhaseTimes, decode_s: float) -> None:
        """A finished request's phases: the scheduler's `times` and `decode_s` from its first
        token to its last (the API server's clock)."""
        self.queue_time.observe(times.queued_s)
        self.prefill_time.observe(times.prefill_s)
        self.decode_time.observe(decode_s)
        self.inference_time.observe(times.prefill_s + decode_s)

    def render(self, gauges: Sequence["Gauge"] = ()) -> str:
        """The exposition text; `gauges`: more, the API server's own (LoRA adapters, batch
        jobs)."""
        lines: List[str] = []
        for attr, (name, kind, help_text) in _SCHEDULER_METRICS.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if self.replicas == 1:
                lines.append(f"{name} {getattr(self._stats(0), attr)}")
            else:
                lines += [f'{name}{{replica="{d}"}} {getattr(self._stats(d), attr)}'
                          for d in range(self.replicas)]
        name = "minisgl_requests_finished_total"
        lines += [f"# HELP {name} Requests finished, by reason (stop, length, abort, timeout: "
                  f"past its deadline; rejected for load, invalid input, error).",
                  f"# TYPE {name} counter"]
        lines += [f'{name}{{reason="{r}"}} {c}' for r, c in sorted(self.finished.items())]
        name = "minisgl_http_requests_total"
        lines += [f"# HELP {name} HTTP requests answered, by route and status (unfinished: the "
                  f"client left or the server failed before the answer ended).",
                  f"# TYPE {name} counter"]
        lines += [f'{name}{{path="{p}",status="{s}"}} {c}'
                  for (p, s), c in sorted(self.http.items())]
        for histogram in (self.ttft, self.itl, self.e2e, self.prompt_tokens,
                          self.generation_tokens, self.queue_time, self.prefill_time,
                          self.decode_time, self.inference_time):
            lines += histogram.render()
        for gauge in gauges:
            lines += gauge.render()
        lines += vllm_lines(self.model_name, self.replica_stats(),
                            self.finished, {
                                "vllm:time_to_first_token_seconds": self.ttft,
                                "vllm:inter_token_latency_seconds": self.itl,
                                "vllm:e2e_request_latency_seconds": self.e2e,
                                "vllm:request_prompt_tokens": self.prompt_tokens,
                                "vllm:request_generation_tokens": self.generation_tokens,
                                "vllm:request_queue_time_seconds": self.queue_time,
                                "vllm:request_prefill_time_seconds": self.prefill_time,
                                "vllm:request_decode_time_seconds": self.decode_time,
                                "vllm:request_inference_time_seconds": self.inference_time})
        return "\n".join(lines) + "\n"


class Gauge(NamedTuple):
    """A gauge's current values by label value (one unlabelled value under the key None)."""

    name: str
    help: str
    values: Mapping[Optional[str], float]
    label: str = ""

    def render(self) -> List[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        for key, value in sorted(self.values.items(), key=lambda kv: str(kv[0])):
            labels = "" if key is None else f'{{{self.label}="{key}"}}'
            lines.append(f"{self.name}{labels} {value}")
        return lines
