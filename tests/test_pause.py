"""Generation paused and resumed (vLLM's /pause, /resume, /is_paused; SGLang's
/pause_generation, /continue_generation), as async RL loops do around a weight update: in the
scheduler (a real Scheduler on the fake engine, whose weights shift every token:
tests/fake_engine.py) and over HTTP.

What must hold: keep pauses at once with the running requests kept (no token while paused) and
a reload applies while they are kept (their later tokens come from the new weights); wait pauses
once the running requests have finished; requests that arrive while paused wait and run after
the resume; a sleep that would forget kept requests' KV is refused; the pages balance at every
step (the harness checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest

from minisgl.message.types import PauseMsg
from tests.fake_engine import Harness, lora_reference, reference

PROMPT = list(range(1, 14))


@pytest.mark.parametrize("overlap", [False, True])
def test_keep_freezes_the_running_requests_and_a_reload_applies_under_them(
        overlap: bool) -> None:
    h = Harness(overlap=overlap)
    h.submit(1, PROMPT, max_tokens=12)
    for _ in range(4):
        h.step()
    h.io.inbox.append(PauseMsg(100))
    h.step()
    assert h.reply(100) == "ok" and h.sched.paused and h.sched.inflight is None
    done = len(h.tokens[1])
    h.submit(2, PROMPT[:5])  # held while paused
    h.weights(101, "/ckpt/b")  # applies at once, request 1 kept
    h.step()
    h.sleep(102)  # would forget request 1's KV
    for _ in range(5):
        h.step()
    assert len(h.tokens[1]) == done and 2 not in h.tokens
    assert h.reply(101) == "ok" and h.engine.reloads == ["/ckpt/b"]
    assert "resume or abort them before sleeping" in h.reply(102)
    h.io.inbox.append(PauseMsg(103, resume=True))
    h.run()
    assert h.reply(103) == "ok" and not h.sched.paused
    assert len(h.tokens[1]) == 12 and h.tokens[1][:done] == reference(PROMPT, 12)[:done]
    assert h.tokens[1] != reference(PROMPT, 12)  # its later tokens: the new weights'
    assert h.tokens[2] == lora_reference(PROMPT[:5], 8, "/ckpt/b")


def test_wait_pauses_once_the_running_requests_finish() -> None:
    h = Harness()
    h.submit(1, PROMPT, max_tokens=12)
    h.step()
    h.io.inbox.append(PauseMsg(100, wait=True))
    h.io.inbox.append(PauseMsg(101, resume=True))  # while the pause waits: refused
    h.submit(2, PROMPT[:5])
    h.run()
    assert h.tokens[1] == reference(PROMPT, 12) and h.reply(100) == "ok"
    assert "a pause is waiting" in h.reply(101) and 2 not in h.tokens and h.sched.paused
    h.io.inbox.append(PauseMsg(102, resume=True))
    h.run()
    assert h.tokens[2] == reference(PROMPT[:5], 8)


def test_served_pause_and_resume(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """vLLM's keep: a streamed request stops getting tokens while paused and ends whole after
    /resume; /is_paused; abort (the default) ends it; SGLang's names; a bad mode is a 400."""
    import httpx
    from server_helpers import CPU_ARGS, serving, stream_generate
    prompt = [1, 2, 3, 4, 5, 6]
    with serving(["--model", str(tiny_model("llama")), *CPU_ARGS], tmp_path) as srv:
        def post(path: str, **kw: object) -> httpx.Response:
            return httpx.post(f"{srv.url}{path}", timeout=60, **kw)  # type: ignore[arg-type]

        def paused() -> bool:
            return bool(httpx.get(f"{srv.url}/is_paused").json()["is_paused"])

        chunks: List[dict] = []
        worker = stream_generate(srv.url, prompt, 300, chunks)
        assert post("/pause?mode=keep").status_code == 200 and paused()
        seen = len(chunks)
        worker.join(1.5)
        assert worker.is_alive() and len(chunks) <= seen + 1  # at most the chunk in flight
        assert post("/resume").status_code == 200 and not paused()
        worker.join(60)
        final = chunks[-1]
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        assert len(final["output_ids"]) == 300
        chunks = []
        worker = stream_generate(srv.url, prompt, 300, chunks)
        r = post("/pause_generation", json={})  # SGLang's, abort by default
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        worker.join(60)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert post("/continue_generation").json()["success"] is True and not paused()
        r = post("/pause?mode=later")
        assert r.status_code == 400 and "'later'" in r.json()["error"]["message"]
