"""The scheduler's configuration: the engine's plus batching limits and IO addresses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minisgl.engine import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig:
    engine: EngineConfig
    # Per-step token budget of a prefill batch (chunk size). None: the offline default for the
    # device (utils.offline_prefill_tokens), the minimum over ranks.
    max_prefill_tokens: Optional[int] = 8192
    cache: str = "radix"  # "radix" or "naive"
    # ZMQ addresses; None in offline single-rank mode (in-process IO).
    backend_addr: Optional[str] = None  # tokenizer -> rank 0 (PULL, rank 0 binds)
    detokenizer_addr: Optional[str] = None  # rank 0 -> detokenizer (PUSH, rank 0 connects)
    broadcast_addr: Optional[str] = None  # rank 0 -> other ranks (XPUB/SUB, rank 0 binds)
    subscriber_timeout_s: float = 60.0
    overlap: Optional[bool] = None  # schedule step N+1 while N runs; None: on for CUDA only
    # Admission reserves KV for a request's prompt plus at most this many output tokens; a
    # decode step that outgrows the reservations retracts the newest requests (their computed KV
    # goes to the prefix cache) and re-queues them. None reserves all of max_tokens: no retraction.
    decode_reserve_tokens: Optional[int] = None
    check_lockstep: bool = False  # every step, ranks compare batch uids, KV slots and tokens

    def __post_init__(self) -> None:
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.decode_reserve_tokens is not None and self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens must be >= 0, got "
                             f"{self.decode_reserve_tokens}")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', got {self.cache!r}")
