"""SGLang's `GET /get_server_info`: what the server runs and each replica's state now, as
SGLang's tools read it (its bench_serving takes the accept length of speculative decoding
from `internal_states[0]["avg_spec_accept_length"]`)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

from minisgl.message.types import SchedulerStats


def internal_state(s: SchedulerStats) -> Dict[str, Any]:
    """One replica's state from its latest stats: requests running and waiting, the share of
    KV pages live requests hold, and, where it speculates, the tokens a request gained per
    verify step with drafts (1 + drafts kept per draft run; None before any) and SGLang's
    draft-token count (its --speculative-num-draft-tokens: the drafts and the newest token)."""
    state: Dict[str, Any] = {
        "num_running_reqs": s.running, "num_waiting_reqs": s.waiting,
        "token_usage": s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0}
    if s.spec_tokens:
        state["avg_spec_accept_length"] = (1 + s.spec_accepted_tokens_total / s.spec_drafts_total
                                           if s.spec_drafts_total else None)
        state["speculative_num_draft_tokens"] = s.spec_tokens + 1
    return state


def server_info(fields: Dict[str, Any], stats: Sequence[SchedulerStats]) -> Dict[str, Any]:
    """`fields` (the served model, sizes, version) and `internal_states`, one per replica in
    replica order."""
    return {**fields, "internal_states": [internal_state(s) for s in stats]}
