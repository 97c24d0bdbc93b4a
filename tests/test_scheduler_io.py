"""The seed's chapter-14 example, harder: two IO-only scheduler ranks (gloo group + ZmqIO, no
model) receive exactly the same messages in exactly the same steps, for 1,000 messages sent in
random bursts, and only rank 0 replies.

Each rank simulates a scheduler: every message brings `uid % 3` steps of work, and a rank blocks
for input only when it has none left, a pure function of the messages received so far, so both
ranks block at the same steps (as the real scheduler does). Rank 1 runs slower than rank 0.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, List

import torch.distributed as dist
import zmq

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.message.queue import PullQueue, PushQueue
from minisgl.message.types import TokenOut, UserMsg
from minisgl.scheduler.io import ZmqIO
from minisgl.distributed.bind import free_port
from spawn_ranks import spawn_ranks

TOTAL = 1000


def rank_main(rank: int, init: str, addrs: List[str], out: Any) -> None:
    backend, detokenizer, broadcast = addrs
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    io = ZmqIO(DistributedInfo(rank, 2), backend, detokenizer, broadcast, dist.group.WORLD, 30.0)
    out.put(("ready", rank))
    steps: List[List[int]] = []
    blocked: List[bool] = []
    work, received = 0, 0
    jitter = random.Random(rank)
    while received < TOTAL:
        blocking = work == 0
        uids = [m.uid for m in io.receive(blocking, on_idle=lambda: None)]
        steps.append(uids)
        blocked.append(blocking)
        received += len(uids)
        work = max(0, work - 1) + sum(u % 3 for u in uids)
        io.send([TokenOut(u, token=rank) for u in uids], None)
        time.sleep(jitter.random() * 0.001 * (1 + 2 * rank))  # rank 1 is slower
    out.put((rank, steps, blocked))
    dist.barrier()
    io.close()
    dist.destroy_process_group()


def test_two_ranks_receive_identical_steps(tmp_path: Path) -> None:
    addrs = [f"ipc://{tmp_path}/{n}" for n in ("backend", "detokenizer", "broadcast")]
    ctx = zmq.Context()
    replies = PullQueue(ctx, addrs[1], bind=True)
    init = f"tcp://127.0.0.1:{free_port()}"
    push = PushQueue(ctx, addrs[0], bind=False)
    try:
        with spawn_ranks(rank_main, 2, init, addrs) as (out, procs):
            assert sorted(out.get(timeout=120) for _ in range(2)) == [("ready", 0), ("ready", 1)]
            rng = random.Random(1234)
            uid = 0
            while uid < TOTAL:
                for _ in range(min(rng.randint(1, 60), TOTAL - uid)):
                    push.put(UserMsg(uid, [1, 2], SamplingParams()))
                    uid += 1
                time.sleep(rng.choice([0.0, 0.0, 0.001, 0.005, 0.02]))
            results = {}
            for _ in range(2):
                rank, steps, blocked = out.get(timeout=120)
                results[rank] = (steps, blocked)
            items: List[TokenOut] = []
            while len(items) < TOTAL:
                items += replies.get(timeout_ms=10_000).items
    finally:
        push.close()
        replies.close()
        ctx.term()
    steps0, blocked0 = results[0]
    steps1, blocked1 = results[1]
    assert steps0 == steps1  # same messages, same steps
    assert blocked0 == blocked1
    assert [u for step in steps0 for u in step] == list(range(TOTAL))
    assert any(len(s) > 1 for s in steps0) and any(not s for s in steps0)  # bursts and empties
    assert any(blocked0) and not all(blocked0)
    # only rank 0 replied, once per message, in order
    assert [t.uid for t in items] == list(range(TOTAL))
    assert {t.token for t in items} == {0}
    assert all(p.exitcode == 0 for p in procs)
