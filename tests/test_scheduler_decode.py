"""The decode batch's request order: what every rank must agree on, and what the decode
attention kernel's load balance relies on (longest first)."""

from __future__ import annotations

import random

from minisgl.core import Phase, Req, SamplingParams
from minisgl.scheduler.decode import DecodeManager


def _req(uid: int, length: int) -> Req:
    return Req(uid, list(range(length)), length, SamplingParams(), ())


def test_decode_batch_is_longest_first_ties_by_uid_whatever_the_arrival_order() -> None:
    lens = {0: 5, 1: 900, 2: 37, 3: 900, 4: 1, 5: 512, 6: 37}
    batches = []
    for seed in range(3):
        manager = DecodeManager()
        uids = list(lens)
        random.Random(seed).shuffle(uids)
        for uid in uids:
            manager.add(_req(uid, lens[uid]))
        manager.remove(manager.running[5])  # a finished request leaves no trace in the order
        batch = manager.schedule()
        assert batch is not None and batch.phase is Phase.DECODE
        batches.append([(r.uid, r.device_len) for r in batch.reqs])
        assert batch.prefix_lens == [n - 1 for _, n in batches[-1]]
    assert batches[0] == [(1, 900), (3, 900), (2, 37), (6, 37), (0, 5), (4, 1)]
    assert batches[1] == batches[0] and batches[2] == batches[0]


def test_decode_order_follows_growth() -> None:
    manager = DecodeManager()
    short, long_ = _req(0, 10), _req(1, 3)
    manager.add(short)
    manager.add(long_)
    long_.device_len = 11  # uid 1 grew past uid 0
    batch = manager.schedule()
    assert batch is not None and [r.uid for r in batch.reqs] == [1, 0]
