"""Sleep mode (vLLM's `--enable-sleep-mode`): in the scheduler (a real Scheduler on the fake
engine: tests/fake_engine.py), the engine's memory on the CPU, offline (`LLM.sleep` /
`wake_up` against Hugging Face, tp=1 and tp=2) and over HTTP (/sleep, /wake_up, /is_sleeping).

What must hold: a sleep waits for the running requests; nothing launches while any part is
asleep, and requests that arrive then wait and run once a wake-up leaves nothing asleep; the
prefix cache is forgotten; level 1 gives the same tokens after waking, level 2 those of the
checkpoint reloaded in between; a failed wake-up leaves the parts asleep and can be retried;
every change gets one final reply; the KV pages balance at every step.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.message.types import SleepMsg
from tests.fake_engine import Harness, lora_reference, reference

PROMPT = list(range(1, 14))


# --- the scheduler --------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_a_sleep_waits_for_the_running_requests_and_holds_new_ones_until_woken(
        overlap: bool) -> None:
    h = Harness(overlap=overlap)
    h.submit(1, PROMPT, max_tokens=12)
    for _ in range(3):
        h.step()
    h.sleep(100, level=1)
    h.submit(2, PROMPT)  # held: a sleep waits
    h.run()
    assert h.tokens[1] == reference(PROMPT, 12) and h.reply(100) == "ok"
    assert h.engine.asleep == {"weights", "kv_cache"} and h.engine.sleeps == [
        (1, ("weights", "kv_cache"))]
    assert 2 not in h.tokens and h.sched.stats().waiting == 1
    assert h.accounting().pages.cached == 0  # the prefix cache went with the KV cache
    h.submit(3, PROMPT[:5])
    h.run()
    assert 3 not in h.tokens  # still asleep: nothing launched (the fake engine asserts it)
    h.wake(101)
    h.run()
    assert h.reply(101) == "ok" and not h.engine.asleep
    assert h.tokens[2] == reference(PROMPT, 8) and h.tokens[3] == reference(PROMPT[:5], 8)
    assert max(o.cached_tokens for o in h.outs if o.uid == 2) == 0
    assert h.accounting().live_requests == 0


def test_level_2_wakes_the_weights_for_a_reload_then_the_kv_cache() -> None:
    """The RL loop's order: sleep(2), wake the weights, reload them, wake the KV cache; a
    reload while the weights sleep, or a LoRA load, is refused; requests wait for the last
    wake-up and run on the reloaded weights."""
    h = Harness(max_loras=1)
    h.sleep(100, level=2)
    h.run()
    h.submit(1, PROMPT)
    h.weights(101, "/ckpt/b")
    h.adapter(102, "sql", "/adapters/sql")
    h.run()
    assert "the weights are asleep" in h.reply(101) and h.engine.reloads == []
    assert "the weights are asleep" in h.reply(102)
    h.wake(103, "weights")
    h.weights(104, "/ckpt/b")
    h.run()
    assert h.reply(103) == "ok" and h.reply(104) == "ok" and h.engine.reloads == ["/ckpt/b"]
    assert h.engine.asleep == {"kv_cache"} and 1 not in h.tokens
    h.wake(105, "kv_cache")
    h.run()
    assert h.reply(105) == "ok"
    assert h.tokens[1] == lora_reference(PROMPT, 8, "/ckpt/b")


def test_the_kv_cache_alone_can_sleep() -> None:
    """SGLang's release of some parts: the KV cache asleep, the weights kept and reloadable;
    requests wait for the wake-up."""
    h = Harness()
    h.io.inbox.append(SleepMsg(100, 2, ("kv_cache",)))
    h.run()
    h.submit(1, PROMPT)
    h.weights(101, "/ckpt/b")
    h.run()
    assert h.engine.sleeps == [(2, ("kv_cache",))] and h.engine.asleep == {"kv_cache"}
    assert h.reply(101) == "ok" and 1 not in h.tokens
    h.wake(102, "kv_cache")
    h.run()
    assert h.tokens[1] == lora_reference(PROMPT, 8, "/ckpt/b")


def test_a_failed_wake_up_stays_asleep_and_can_be_tried_again() -> None:
    h = Harness()
    h.sleep(100)
    h.submit(1, PROMPT)
    h.run()
    h.engine.wake_error = "CUDA out of memory. Tried to allocate 14.96 GiB"
    h.wake(101)
    h.run()
    assert "CUDA out of memory" in h.reply(101) and h.engine.asleep == {"weights",
                                                                             "kv_cache"}
    assert 1 not in h.tokens
    h.wake(102)
    h.run()
    assert h.reply(102) == "ok" and h.tokens[1] == reference(PROMPT, 8)


def test_a_sleep_or_wake_up_another_rank_failed_is_undone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The vote: where another rank failed, this one wakes what it put to sleep (and takes
    the held requests), or puts back to sleep what it woke."""
    h = Harness()
    monkeypatch.setattr("minisgl.distributed.comm.min_over_ranks", lambda v, g: 0)
    h.sleep(100)
    h.run()
    h.submit(1, PROMPT)
    h.run()
    assert "sleep failed on another rank" in h.reply(100) and not h.engine.asleep
    assert h.tokens[1] == reference(PROMPT, 8)
    monkeypatch.undo()
    h.sleep(101)
    h.run()
    monkeypatch.setattr("minisgl.distributed.comm.min_over_ranks", lambda v, g: 0)
    h.wake(102, "kv_cache")
    h.run()
    assert "wake-up failed on another rank" in h.reply(102)
    assert h.engine.asleep == {"weights", "kv_cache"} and h.engine.sleeps[-1] == (
        1, ("kv_cache",))
    # parts asleep at different levels each go back to sleep at their own
    monkeypatch.undo()
    for change in (lambda: h.wake(103), lambda: h.sleep(104, 1, "weights"),
                   lambda: h.sleep(105, 2, "kv_cache")):
        change()
        h.run()
    assert [h.reply(u) for u in (103, 104, 105)] == ["ok"] * 3
    monkeypatch.setattr("minisgl.distributed.comm.min_over_ranks", lambda v, g: 0)
    h.wake(106)
    h.run()
    assert "wake-up failed on another rank" in h.reply(106)
    assert sorted(h.engine.sleeps[-2:]) == [(1, ("weights",)), (2, ("kv_cache",))]


def test_changes_that_cannot_run_are_refused_and_held_requests_can_be_aborted() -> None:
    h = Harness()
    h.submit(1, PROMPT, max_tokens=12)
    h.step()
    h.sleep(100)
    h.sleep(101)  # a second while the first waits
    h.wake(102)  # a wake-up while a sleep waits
    h.weights(103, "/ckpt/b")
    h.submit(2, PROMPT)
    h.step()
    assert "a sleep is already waiting" in h.reply(101)
    assert "a sleep is waiting" in h.reply(102)
    assert "a sleep is already waiting" in h.reply(103)
    h.abort(2)
    h.run()
    assert h.finished(2).finish_reason == "abort" and 2 not in h.tokens
    assert h.reply(100) == "ok" and h.tokens[1] == reference(PROMPT, 12)
    h.sleep(104, level=3)
    h.run()
    assert "sleep level must be 1 or 2" in h.reply(104)
    off = Harness(enable_sleep_mode=False)
    off.sleep(100)
    off.submit(1, PROMPT)
    off.run()
    assert "start the server with --enable-sleep-mode" in off.reply(100)
    assert off.tokens[1] == reference(PROMPT, 8)


# --- the engine, offline --------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                ) -> List[Path]:
    """Two tiny Llama checkpoints of one shape (other random weights)."""
    from tiny_models import build_tiny
    return [tiny_model("llama"), build_tiny("llama", tmp_path_factory.mktemp("sleep") / "b",
                                            None, seed=5)]


def _tokens(llm: LLM, prompts: List[List[int]]) -> List[List[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _device_bytes(llm: LLM) -> int:
    """What the tp=1 engine's weights and KV pool hold."""
    engine = llm._backend.engine  # type: ignore[attr-defined]
    tensors = [*engine.model.state_dict().values(), engine.pool.k, engine.pool.v]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_sleep_and_wake_give_hugging_faces_tokens(checkpoints: List[Path],
                                                          tp: int) -> None:
    """Level 1: the memory handed back (tp=1: every weight and KV byte), generation refused
    while asleep, the same tokens after waking; level 2: the weights woken, reloaded from the
    second checkpoint, then the KV cache: HF's tokens of that checkpoint."""
    a, b = checkpoints
    prompts = mixed_prompts(3, seed=23, lengths=(5, 21))
    want_a, want_b = hf_greedy(a, prompts, 10), hf_greedy(b, prompts, 10)
    with LLM(str(a), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
             enable_sleep_mode=True, show_progress=False) as llm:
        assert _tokens(llm, prompts) == want_a and not llm.is_sleeping()
        held = _device_bytes(llm) if tp == 1 else 0
        llm.sleep(level=1)
        assert llm.is_sleeping()
        if tp == 1:
            assert held > 0 and _device_bytes(llm) == 0
            engine = llm._backend.engine  # type: ignore[attr-defined]
            assert [engine.sleep_level(t) for t in ("weights", "kv_cache")] == [1, 1]
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate([[1, 2, 3]])
        llm.wake_up()
        assert _tokens(llm, prompts) == want_a and not llm.is_sleeping()
        if tp == 1:
            assert _device_bytes(llm) == held
        llm.sleep(2)
        if tp == 1:
            assert engine.sleep_level("weights") == 2
        llm.wake_up(tags=["weights"])
        if tp == 1:
            assert engine.sleep_level("weights") == 0 and engine.sleep_level("kv_cache") == 2
        assert llm.is_sleeping()
        llm.update_weights_from_disk(str(b))
        llm.wake_up(tags=["kv_cache"])
        assert _tokens(llm, prompts) == want_b
        llm.release_memory_occupation(["kv_cache", "cuda_graph"])  # SGLang's
        assert llm.is_sleeping()
        llm.resume_memory_occupation()
        assert _tokens(llm, prompts) == want_b
        with pytest.raises(ValueError, match="'cuda_graph' alone"):
            llm.release_memory_occupation(["cuda_graph"])
        with pytest.raises(ValueError, match="sleep level must be 1"):
            llm.sleep(0)
        with pytest.raises(ValueError, match="unknown wake_up tag 'cuda_graph'"):
            llm.wake_up(["cuda_graph"])
        assert llm.check_accounting().live_requests == 0


# --- over HTTP ------------------------------------------------------------------------------
def test_served_sleep_and_wake_up_as_vllm_answers(checkpoints: List[Path],
                                                  tmp_path: Path) -> None:
    """POST /sleep?level=1, GET /is_sleeping, a request sent while asleep answered after POST
    /wake_up with the tokens of before; bad levels and tags are 400s naming them; level 2
    (a JSON body), the weights woken and reloaded, then the KV cache."""
    import httpx
    from server_helpers import CPU_ARGS, serving, stream_generate
    a, b = checkpoints
    prompt = mixed_prompts(1, seed=29, lengths=(30,))[0]
    with serving(["--model", str(a), "--enable-sleep-mode", *CPU_ARGS], tmp_path) as srv:
        def generate() -> List[int]:
            r = httpx.post(f"{srv.url}/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}, timeout=120)
            return list(r.json()["output_ids"])

        def post(path: str, **kwargs: object) -> httpx.Response:
            return httpx.post(f"{srv.url}{path}", timeout=120, **kwargs)  # type: ignore[arg-type]

        def sleeping() -> bool:
            return bool(httpx.get(f"{srv.url}/is_sleeping").json()["is_sleeping"])

        def state() -> str:
            lines = httpx.get(f"{srv.url}/metrics").text.splitlines()
            on = [line for line in lines if line.startswith("vllm:engine_sleep_state{")
                  and line.endswith(" 1.0")]
            assert len(on) == 1, on
            return on[0].split('"')[1]

        want = generate()
        assert want == hf_greedy(a, [prompt], 10)[0] and not sleeping()
        assert state() == "awake"
        assert post("/sleep?level=1").status_code == 200 and sleeping()
        assert state() == "weights_offloaded"
        got: List[List[int]] = []
        waiting = threading.Thread(target=lambda: got.append(generate()))
        waiting.start()
        waiting.join(2)
        assert waiting.is_alive()  # held while asleep
        assert post("/wake_up").status_code == 200 and not sleeping()
        waiting.join(60)
        assert got == [want]
        for path, says in (("/sleep?level=3", "sleep level must be 1"),
                           ("/sleep?mode=keep", "sleep mode must be 'wait'"),
                           ("/wake_up?tags=cuda_graph", "unknown wake_up tag 'cuda_graph'")):
            r = post(path)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert post("/sleep", json={"level": 2}).status_code == 200
        assert state() == "discard_all"
        assert post("/wake_up?tags=weights").status_code == 200 and sleeping()
        assert state() == "kv_cache_discarded"
        r = post("/update_weights_from_disk", json={"model_path": str(b)})
        assert r.json()["success"] is True, r.text
        assert post("/wake_up?tags=kv_cache").status_code == 200 and not sleeping()
        want_b = hf_greedy(b, [prompt], 10)[0]
        assert generate() == want_b
        # vLLM's mode=abort: a long request running ends at once, then the server sleeps
        chunks: List[dict] = []
        worker = stream_generate(srv.url, prompt, 460, chunks)
        assert post("/sleep?mode=abort").status_code == 200
        worker.join(60)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(chunks[-1]["output_ids"]) < 460
        assert post("/wake_up").status_code == 200 and generate() == want_b
        # SGLang's: the KV cache alone; then all, the weights forgotten (no CPU backup), so
        # the RL loop's order: the weights back, reloaded, then the KV cache
        r = post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert r.status_code == 200 and r.json()["success"] is True and sleeping(), r.text
        assert post("/resume_memory_occupation", json={}).status_code == 200
        assert generate() == want_b and not sleeping()
        assert post("/release_memory_occupation", json={}).status_code == 200
        assert post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        r = post("/update_weights_from_disk", json={"model_path": str(a)})
        assert r.json()["success"] is True, r.text
        assert post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}
                    ).status_code == 200
        assert generate() == want
        for body, says in (({"tags": ["cuda_graph"]}, "'cuda_graph' alone"),
                           ({"tags": ["gpu"]}, "unknown tag 'gpu'")):
            r = post("/release_memory_occupation", json=body)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_every_data_parallel_replica_sleeps_and_wakes(checkpoints: List[Path],
                                                       tmp_path: Path) -> None:
    """--dp 2: one /sleep puts both replicas to sleep, requests sent meanwhile (the router
    spreads them) wait on either and are answered after the one /wake_up, as before."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    a, _ = checkpoints
    prompts = mixed_prompts(4, seed=53, lengths=(7, 30))
    want = hf_greedy(a, prompts, 8)
    with serving(["--model", str(a), "--dp", "2", "--enable-sleep-mode", *CPU_ARGS],
                 tmp_path) as srv:
        def generate(p: List[int]) -> List[int]:
            r = httpx.post(f"{srv.url}/generate", timeout=120, json={
                "input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True}})
            return list(r.json()["output_ids"])

        assert httpx.post(f"{srv.url}/sleep?level=1", timeout=120).status_code == 200
        got: Dict[int, List[int]] = {}

        def ask(i: int) -> None:
            got[i] = generate(prompts[i])
        waiting = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in waiting:
            t.start()
        waiting[-1].join(2)
        assert not got  # every replica asleep: nothing answered
        assert httpx.post(f"{srv.url}/wake_up", timeout=120).status_code == 200
        for t in waiting:
            t.join(60)
        assert [got[i] for i in range(len(prompts))] == want


# --- CUDA -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_sleep_frees_the_memory_and_wakes_with_the_same_tokens(
        checkpoints: List[Path]) -> None:
    """On CUDA in float32, decode and prefill graphs captured: level 1 frees at least the
    weights' and KV pool's bytes, and after the wake-up (graphs captured again over the new
    addresses) the tokens are the CPU's; level 2 with the second checkpoint reloaded gives the
    CPU's tokens of that checkpoint. (One CUDA engine in the process: a second one's memory
    would crowd the device.)"""
    import torch
    a, b = checkpoints
    prompts = mixed_prompts(4, seed=31)

    def used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    want = {}
    for path in (a, b):
        with LLM(str(path), device="cpu", show_progress=False) as cpu:
            want[path] = _tokens(cpu, prompts)
    with LLM(str(a), dtype="float32", enable_sleep_mode=True, show_progress=False) as llm:
        engine = llm._backend.engine  # type: ignore[attr-defined]
        assert _tokens(llm, prompts) == want[a]
        held = _device_bytes(llm)
        before = used()
        llm.sleep(1)
        assert before - used() >= held and engine.graphs is None
        llm.wake_up()
        assert engine.graphs is not None and _tokens(llm, prompts) == want[a]
        llm.sleep(2)
        llm.wake_up(["weights"])
        llm.update_weights_from_disk(str(b))
        llm.wake_up(["kv_cache"])
        assert _tokens(llm, prompts) == want[b]
