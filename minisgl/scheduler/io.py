"""The scheduler's input and output (the seed protocol).

The loop calls only `receive(blocking, on_idle)` and `send(outs, stats)` (and `post(msg)` to
answer a control message). Which implementation it
gets is chosen when the scheduler is built:

- `LocalIO`: offline single-rank mode; the caller puts messages in and takes results out.
- `ZmqIO`, rank 0 alone: pull from the tokenizer, push results to the detokenizer.
- `ZmqIO`, rank 0 with others: additionally forward every message's raw bytes verbatim over
  XPUB and broadcast (gloo) how many arrived this step; decode locally. Over several nodes the
  XPUB also listens on a tcp:// address for the ranks elsewhere; the bytes are the same.
- `ZmqIO`, rank r > 0: take the count from the broadcast, then that many messages from SUB;
  never reply.

`blocking` is True only when the scheduler has no work at all; it is a function of scheduler
state, which is identical on every rank, so every rank blocks (or not) at the same step.
`on_idle` (the accounting check) runs before blocking.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Protocol

import torch
import torch.distributed as dist
import zmq

from minisgl.distributed import DistributedInfo
from minisgl.message import BatchTokenOut, SchedulerStats, TokenOut, decode
from minisgl.message.queue import PubQueue, PullQueue, PushQueue, SubQueue


class SchedulerIO(Protocol):
    def receive(self, blocking: bool, on_idle: Callable[[], None]) -> List[Any]: ...

    def send(self, outs: List[TokenOut], stats: Optional[SchedulerStats]) -> None: ...

    def post(self, msg: object) -> None:
        """Rank 0: one reply to a control message (AccountingReply) on the results socket;
        the other ranks drop it."""

    def close(self) -> None: ...


class LocalIO:
    """In-process queues for the offline API with one rank."""

    def __init__(self) -> None:
        self.inbox: Deque[Any] = deque()
        self.outbox: List[TokenOut] = []
        self.posted: List[object] = []  # replies to control messages
        self.stats: Optional[SchedulerStats] = None

    def receive(self, blocking: bool, on_idle: Callable[[], None]) -> List[Any]:
        if blocking:
            on_idle()
        msgs = list(self.inbox)
        self.inbox.clear()
        return msgs

    def send(self, outs: List[TokenOut], stats: Optional[SchedulerStats]) -> None:
        self.outbox.extend(outs)
        self.stats = stats or self.stats

    def post(self, msg: object) -> None:
        self.posted.append(msg)

    def close(self) -> None:
        pass


class ZmqIO:
    def __init__(self, info: DistributedInfo, backend_addr: str, detokenizer_addr: str,
                 broadcast_addr: Optional[str], cpu_group: Optional[dist.ProcessGroup],
                 subscriber_timeout_s: float, broadcast_remote_addr: Optional[str] = None
                 ) -> None:
        self.info = info
        self.cpu_group = cpu_group
        self.ctx = zmq.Context()
        self.pull: Optional[PullQueue] = None
        self.push: Optional[PushQueue] = None
        self.pub: Optional[PubQueue] = None
        self.sub: Optional[SubQueue] = None
        if info.is_primary:
            self.pull = PullQueue(self.ctx, backend_addr, bind=True)
            self.push = PushQueue(self.ctx, detokenizer_addr, bind=False)
        if info.size > 1:
            if broadcast_addr is None or cpu_group is None:
                raise ValueError("tensor parallelism needs a broadcast address and a CPU group")
            if info.is_primary:
                extra = () if broadcast_remote_addr is None else (broadcast_remote_addr,)
                self.pub = PubQueue(self.ctx, broadcast_addr, *extra)
            else:
                self.sub = SubQueue(self.ctx, broadcast_addr)
            if info.is_primary:
                self.pub.wait_for_subscribers(info.size - 1, subscriber_timeout_s)  # type: ignore
            dist.barrier(group=cpu_group)  # nobody starts before every subscription is live

    def receive(self, blocking: bool, on_idle: Callable[[], None]) -> List[Any]:
        if blocking:
            on_idle()
        if self.info.size == 1:
            return self._receive_single(blocking)
        if self.info.is_primary:
            return self._receive_rank0(blocking)
        return self._receive_follower(blocking)

    def _receive_single(self, blocking: bool) -> List[Any]:
        assert self.pull is not None
        msgs = [self.pull.get()] if blocking else []
        while not self.pull.empty():
            msgs.append(self.pull.get())
        return msgs

    def _receive_rank0(self, blocking: bool) -> List[Any]:
        assert self.pull is not None and self.pub is not None
        raws: List[bytes] = []
        if blocking:  # forwarded at once: the other ranks are blocked on SUB for it
            raw = self.pull.get_raw()
            self.pub.put_raw(raw)
            raws.append(raw)
        more: List[bytes] = []
        while not self.pull.empty():
            more.append(self.pull.get_raw())
        count = torch.tensor([len(more)], dtype=torch.int64)
        dist.broadcast(count, src=0, group=self.cpu_group)
        for raw in more:
            self.pub.put_raw(raw)
        return [decode(r) for r in raws + more]

    def _receive_follower(self, blocking: bool) -> List[Any]:
        assert self.sub is not None
        msgs = [self.sub.get()] if blocking else []
        count = torch.tensor([-1], dtype=torch.int64)
        dist.broadcast(count, src=0, group=self.cpu_group)
        msgs.extend(self.sub.get() for _ in range(int(count.item())))
        return msgs

    def send(self, outs: List[TokenOut], stats: Optional[SchedulerStats]) -> None:
        if self.push is None or (not outs and stats is None):
            return  # only rank 0 replies: every rank sampled the same tokens
        self.push.put(BatchTokenOut(outs, stats))

    def post(self, msg: object) -> None:
        if self.push is not None:
            self.push.put(msg)

    def close(self) -> None:
        for q in (self.pull, self.push, self.pub, self.sub):
            if q is not None:
                q.close()
        self.ctx.term()
