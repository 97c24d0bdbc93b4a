"""Admission and deadlines of the API server's requests.

`Queued` counts the requests (one per choice) accepted but not started: sent to the tokenizer
and not yet answered with their first chunk (tokenized, waiting in a scheduler queue or in
prefill). Past `--max-queued-requests` a new request is refused with `overloaded()`: a 429 with
`Retry-After` and OpenAI's `rate_limit_error` body. The same answer comes when the tokenizer's
socket is full, and from the tokenizer for `--max-queued-tokens` (which only it can count); a
stream waits for its first chunk before its 200 is sent, so a refused stream never starts.

`Deadline` is when a request stops being worth serving: `--request-timeout` after its arrival,
or sooner where the OpenAI client says how long it will wait (`X-Stainless-Read-Timeout`, its
read timeout: the longest it waits for a byte, so for a whole non-streamed reply, and for a
stream's first event). Past it the request is aborted and its KV pages freed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Set

from minisgl.server.protocol import ApiError

RETRY_AFTER_S = 1
CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"


def overloaded(why: str) -> ApiError:
    return ApiError(429, f"the server is overloaded ({why}); retry later", kind="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


class Queued:
    """The uids accepted and not started, against an optional limit."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = limit
        self.uids: Set[int] = set()

    def admit(self, uids: Iterable[int]) -> None:
        """Count `uids` as queued, or raise `overloaded()` (429) if that passes the limit now,
        ApiError 400 if it always would (a request is let in whole or not at all)."""
        new = list(uids)
        if self.limit is not None and len(new) > self.limit:  # no retry could let it in
            raise ApiError(400, f"the request asks for {len(new)} completions (prompts times "
                                f"n), more than the {self.limit} this server queues at once "
                                f"(--max-queued-requests)", "n")
        if self.limit is not None and len(self.uids) + len(new) > self.limit:
            raise overloaded(f"{len(self.uids)} requests queued, the limit is {self.limit}")
        self.uids.update(new)

    def started(self, uid: int) -> None:
        """`uid` got its first chunk (or was released): no longer queued."""
        self.uids.discard(uid)


@dataclass(frozen=True)
class Deadline:
    """Monotonic times past which a request is abandoned (math.inf: never). `first` bounds the
    wait for a stream's first chunk (its 200), `last` the whole request."""

    first: float = math.inf
    last: float = math.inf

    @classmethod
    def of(cls, headers: Mapping[str, str], request_timeout: Optional[float], stream: bool,
           now: Optional[float] = None) -> "Deadline":
        """A request's deadlines from the server's timeout and the client's header (one that is
        not a positive number of seconds is ignored)."""
        start = time.monotonic() if now is None else now
        last = math.inf if request_timeout is None else start + request_timeout
        client = _seconds(headers.get(CLIENT_TIMEOUT_HEADER))
        mine = math.inf if client is None else start + client
        if stream:  # the client's read timeout bounds the wait for a byte, i.e. the first event
            return cls(min(mine, last), last)
        return cls(min(mine, last), min(mine, last))

    def left(self, started: bool) -> float:
        """Seconds until the deadline that applies (before or after the first chunk)."""
        return (self.last if started else self.first) - time.monotonic()

    def timeout(self, started: bool) -> Optional[float]:
        """`left(started)` as a wait's timeout: None for no deadline, 0 once past it."""
        left = self.left(started)
        return None if math.isinf(left) else max(0.0, left)

    def error(self) -> ApiError:
        return ApiError(408, "the request did not finish within its deadline and was aborted",
                        code="request_timeout")


def _seconds(value: Optional[str]) -> Optional[float]:
    try:
        s = float(value) if value is not None else None
    except ValueError:
        return None
    return s if s is not None and math.isfinite(s) and s > 0 else None
