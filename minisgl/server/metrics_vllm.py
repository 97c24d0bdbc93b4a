"""vLLM's names for what /metrics serves (`vllm:num_requests_waiting`, ...), so that dashboards,
autoscalers (KEDA, the HPA) and inference gateways (Kubernetes' Gateway API Inference Extension,
llm-d) built for vLLM read minisgl unchanged.

The values are the `minisgl_` lines' own (metrics.py), labelled as vLLM labels them: every line
with `model_name` (the served name), the scheduler's also with `engine` (the data-parallel
replica). KV cache usage counts the pages live requests hold, not those only the prefix cache
keeps (vLLM counts cached blocks that no request uses as free: they are evicted on demand).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Sequence, Tuple

from minisgl.message.types import SchedulerStats

if TYPE_CHECKING:  # metrics.py renders these lines: it imports this module
    from minisgl.server.metrics import Histogram

Value = Callable[[SchedulerStats], float]


def _usage(s: SchedulerStats) -> float:
    return s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0


_KV_HELP = "KV-cache usage. 1 means 100 percent usage."
# vLLM name -> (type, help, value of one replica's stats)
_SCHEDULER: Dict[str, Tuple[str, str, Value]] = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches.",
                                  lambda s: s.running),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed.",
                                  lambda s: s.waiting),
    "vllm:kv_cache_usage_perc": ("gauge", _KV_HELP, _usage),
    "vllm:gpu_cache_usage_perc": ("gauge", _KV_HELP + " (vLLM's older name)", _usage),
    "vllm:prompt_tokens_total": ("counter", "Number of prefill tokens processed.",
                                 lambda s: s.prompt_tokens_total),
    "vllm:generation_tokens_total": ("counter", "Number of generation tokens processed.",
                                     lambda s: s.generated_tokens_total),
    "vllm:prefix_cache_queries_total": ("counter", "Prefix cache queries, in terms of number "
                                                   "of queried tokens.",
                                        lambda s: s.prompt_tokens_total),
    "vllm:prefix_cache_hits_total": ("counter", "Prefix cache hits, in terms of number of "
                                                "cached tokens.",
                                     lambda s: s.cached_tokens_total),
    "vllm:num_preemptions_total": ("counter", "Cumulative number of preemption from the "
                                              "engine.",
                                   lambda s: s.retracted_requests_total),
}
# vLLM's finished_reason -> minisgl's finish reasons it counts (metrics.Metrics.finished)
_SUCCESS = {"stop": ("stop",), "length": ("length",), "abort": ("abort", "timeout")}


def _labels(**labels: str) -> str:
    """`{k="v",...}`, each value escaped as the exposition format escapes (\\, \", \n)."""
    pairs = (f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in labels.items())
    return "{" + ",".join(pairs) + "}"


def vllm_lines(model: str, stats: Sequence[SchedulerStats], finished: Mapping[str, int],
               histograms: Mapping[str, "Histogram"]) -> List[str]:
    """The exposition lines under vLLM's names: the scheduler's of each replica (`stats`, in
    replica order), requests finished by reason, and `histograms` (vLLM's name -> minisgl's
    histogram of the same measure)."""
    lines: List[str] = []
    for name, (kind, help_text, value) in _SCHEDULER.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{_labels(model_name=model, engine=str(d))} {float(value(s))}"
                  for d, s in enumerate(stats)]
    name = "vllm:request_success_total"
    lines += [f"# HELP {name} Count of successfully processed requests.",
              f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(model_name=model, finished_reason=reason)} "
              f"{float(sum(finished.get(r, 0) for r in ours))}"
              for reason, ours in _SUCCESS.items()]
    for name, histogram in histograms.items():
        lines += histogram.render(name, _labels(model_name=model)[1:-1])
    return lines + _lora_lines(stats) + _spec_lines(model, stats)


_SPEC: Dict[str, Tuple[str, Value]] = {
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.",
                                    lambda s: s.spec_drafts_total),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.",
                                          lambda s: s.spec_draft_tokens_total),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.",
                                             lambda s: s.spec_accepted_tokens_total),
}


def _spec_lines(model: str, stats: Sequence[SchedulerStats]) -> List[str]:
    """vLLM's speculative-decoding counters where the replicas speculate: drafts (a request's
    drafts in one step), draft tokens, accepted tokens, and accepted tokens by draft position
    (`position` 0 .. num_speculative_tokens - 1)."""
    if not any(s.spec_tokens for s in stats):
        return []
    lines: List[str] = []
    for name, (help_text, value) in _SPEC.items():
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        lines += [f"{name}_total{_labels(model_name=model, engine=str(d))} {float(value(s))}"
                  for d, s in enumerate(stats)]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Accepted tokens per draft position.", f"# TYPE {name} counter"]
    for d, s in enumerate(stats):
        per_pos = list(s.spec_accepted_per_pos) + [0] * (s.spec_tokens
                                                         - len(s.spec_accepted_per_pos))
        lines += [f"{name}{_labels(model_name=model, engine=str(d), position=str(j))} "
                  f"{float(n)}" for j, n in enumerate(per_pos)]
    return lines


def _lora_lines(stats: Sequence[SchedulerStats]) -> List[str]:
    """vLLM's `vllm:lora_requests_info` where the replicas serve LoRA adapters: the adapters
    running and waiting (comma-separated names) and the slots as labels, the time the stats
    were taken as the value (LoRA-aware gateways read the newest series)."""
    if not any(s.lora_slots for s in stats):
        return []
    name = "vllm:lora_requests_info"
    lines = [f"# HELP {name} Running stats on lora requests.", f"# TYPE {name} gauge"]
    for d, s in enumerate(stats):
        labels = _labels(max_lora=str(s.lora_slots),
                         running_lora_adapters=",".join(s.running_adapters),
                         waiting_lora_adapters=",".join(s.waiting_adapters), engine=str(d))
        lines.append(f"{name}{labels} {s.stats_time}")
    return lines
