"""A bounded soak through the real service: a few thousand streaming completions, 64 at a time,
a quarter of whose clients go away (after a few events, or before the reply even starts).
Afterwards: every client that stayed saw its stream end (a finish, or an error event, then
[DONE]), the API server counted every request once, the KV pages balance (the ranks check the
accounting whenever they go idle and would have died on a mismatch: the service is still up,
and no page is held), and no process of the service kept growing (RSS)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

import httpx
import pytest

from server_helpers import CPU_ARGS, Server, comm

REQUESTS = 2000
CONCURRENCY = 64
SEED = 19
SAMPLES = 6  # RSS readings of every process, one per sixth of the requests


class Outcome(NamedTuple):
    kind: str  # "finished", "error", "left" (the client went away)
    detail: str = ""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: Path):
    # One torch thread: on a loaded machine a rank's threads wait for each other at every op.
    srv = Server.start(["--model", str(tiny_qwen3), *CPU_ARGS, "--max-kv-tokens", "2048",
                        "--page-size", "4", "--cpu-threads", "1"],
                       tmp_path_factory.mktemp("soak"))
    yield srv
    srv.stop()


async def _one(client: httpx.AsyncClient, rng: random.Random) -> Outcome:
    body = {"prompt": [rng.randrange(3, 40000) for _ in range(rng.randint(1, 40))],
            "max_tokens": rng.randint(1, 4), "stream": True, "temperature": 0.7,
            "seed": rng.randrange(1 << 30)}
    roll = rng.random()
    leave_after = rng.randint(0, 2) if roll < 0.15 else None  # events, then close
    cancel_after = rng.uniform(0.0, 0.02) if 0.15 <= roll < 0.25 else None  # seconds

    async def run() -> Outcome:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome("error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            events: List[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if leave_after is not None and len(events) > leave_after:
                    return Outcome("left")
            if not events or events[-1] != "[DONE]":
                return Outcome("cut", repr(events[-2:]))
            if len(events) > 1 and events[-2].startswith('{"error"'):
                return Outcome("error", events[-2])
            if not any('"finish_reason": "' in e for e in events):
                return Outcome("cut", f"no finish reason: {events[-3:]!r}")
            return Outcome("finished")

    try:
        if cancel_after is None:
            return await run()
        return await asyncio.wait_for(run(), cancel_after)
    except asyncio.TimeoutError:
        return Outcome("left")
    except httpx.HTTPError as e:
        return Outcome("cut", f"{type(e).__name__}: {e}")


async def _soak(url: str, n: int, on_sample: "asyncio.Queue[int]") -> List[Outcome]:
    rng = random.Random(SEED)
    rngs = [random.Random(rng.randrange(1 << 30)) for _ in range(n)]
    # A connection per request: a pooled one may be closed by the server's keep-alive timeout
    # just as it is reused, or left broken by a cancelled request (the client's races, not
    # the server's).
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        gate = asyncio.Semaphore(CONCURRENCY)
        done = 0

        async def guarded(i: int) -> Outcome:
            nonlocal done
            async with gate:
                out = await _one(client, rngs[i])
            done += 1
            if done % (n // SAMPLES) == 0:
                on_sample.put_nowait(done)
            return out

        return await asyncio.gather(*(guarded(i) for i in range(n)))


def test_soak_with_disconnects(server: Server) -> None:
    children = {comm(p): p for p in server.children}
    samples: List[Dict[str, int]] = []

    async def main() -> List[Outcome]:
        ticks: "asyncio.Queue[int]" = asyncio.Queue()
        task = asyncio.ensure_future(_soak(server.url, REQUESTS, ticks))
        for _ in range(SAMPLES):
            await ticks.get()
            samples.append({name: rss_kib(pid) // 1024 for name, pid in children.items()})
        return await task

    t0 = time.monotonic()
    outcomes = asyncio.run(main())
    elapsed = time.monotonic() - t0
    kinds = {k: sum(1 for o in outcomes if o.kind == k) for k in ("finished", "error", "left")}
    bad = [o for o in outcomes if o.kind not in kinds]
    assert not bad, (len(bad), bad[:3])
    errors = [o.detail for o in outcomes if o.kind == "error"]
    assert not errors, errors[:3]  # nothing here should fail: small prompts, a free pool
    assert kinds["left"] > REQUESTS // 10 and kinds["finished"] > REQUESTS // 2, kinds

    # a last request: its reply carries the scheduler's stats after every abort was handled
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert r.status_code == 200, r.text
    time.sleep(0.5)  # the rank goes idle and checks its accounting
    m = server.wait_metrics(lambda m: m["minisgl_num_requests_running"] == 0
                            and m["minisgl_num_requests_waiting"] == 0)
    assert server.proc.poll() is None and httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.stderr(), server.stderr()[-3000:]  # no internal error
    assert m["minisgl_kv_pages_used"] == 0, m
    # Every request the API server took is counted once, by how it ended: those whose client
    # saw the finish at least; a client that left early may have gone before its request came.
    ended = {k.split('"')[1]: v for k, v in m.items()
             if k.startswith("minisgl_requests_finished_total")}
    assert set(ended) <= {"length", "abort"}, ended
    assert kinds["finished"] + 1 <= ended["length"] <= kinds["finished"] + 1 + kinds["left"]
    assert sum(ended.values()) <= REQUESTS + 1, ended

    # Memory (MiB): a leak grows at every sample and lifts the late samples' floor; the
    # allocators' pools grow with the largest batch seen so far, which may come late, and
    # then stay (hence the margin), and one sample may catch a batch's transient peak (a
    # full suite's run saw rank 0 at 303, 294, 298, 333, 314, 369: hence the floor).
    for name in children:
        series = [sample[name] for sample in samples]
        assert not all(b - a >= 2 for a, b in zip(series, series[1:])), (name, series)
        assert min(series[SAMPLES // 2:]) - max(series[:SAMPLES // 2]) < 48, (name, series)
    grown = {name: samples[-1][name] - samples[0][name] for name in children}
    print(f"soak: {REQUESTS} requests in {elapsed:.1f} s, {kinds}, RSS growth MiB {grown}")
