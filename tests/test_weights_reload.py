"""Weights reloaded from a checkpoint while serving (SGLang's update_weights_from_disk): in the
scheduler (a real Scheduler on the fake engine, whose weights shift every request's KV:
tests/fake_engine.py), offline (`LLM.update_weights_from_disk` against Hugging Face on each
checkpoint, tp=1 and tp=2) and over HTTP.

What must hold: a request runs on the weights it started with, to its end; requests that
arrive while a reload waits run after it, on the new weights; nothing cached under the old
weights is reused; a reload that fails anywhere leaves every rank on the weights it served;
every reply is one final TokenOut of the message's uid.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, List

import pytest
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from tests.fake_engine import Harness, lora_reference, reference

PROMPT = list(range(1, 14))  # 13 tokens: three full pages of 4 for the prefix cache


def _cached(h: Harness, uid: int) -> int:
    return max(o.cached_tokens for o in h.outs if o.uid == uid)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_reload_waits_for_the_running_requests_then_serves_the_new_weights(
        overlap: bool) -> None:
    h = Harness(overlap=overlap)
    h.submit(1, PROMPT, max_tokens=12)
    for _ in range(3):
        h.step()
    h.weights(100, "/ckpt/b")
    h.submit(2, PROMPT)  # held until the reload
    h.step()
    assert 2 not in h.sched.reqs and h.engine.reloads == []
    stats = h.sched.stats()
    assert stats.waiting == 1 and stats.waiting_tokens == len(PROMPT)
    h.run()
    assert h.tokens[1] == reference(PROMPT, 12)  # the old weights to its end
    assert h.reply(100) == "ok" and h.engine.reloads == ["/ckpt/b"]
    assert h.tokens[2] == lora_reference(PROMPT, 8, "/ckpt/b")
    assert _cached(h, 2) == 0  # request 1's prefix came from the old weights
    reply_at = next(i for i, o in enumerate(h.outs) if o.uid == 100)
    assert all(i > reply_at for i, o in enumerate(h.outs) if o.uid == 2)
    h.submit(3, PROMPT)
    h.run()
    assert _cached(h, 3) == 12 and h.tokens[3] == h.tokens[2]  # the new weights' prefix


def test_a_failed_reload_restores_the_weights_served() -> None:
    """Refused before loading ("bad"), failing after the weights changed ("broken"), after a
    good reload: every rank goes back to the checkpoint it served, and serves on."""
    h = Harness()
    h.weights(100, "/ckpt/bad")
    h.run()
    assert "the checkpoint's hidden_size is 8" in h.reply(100)
    h.weights(101, "/ckpt/b")
    h.run()
    h.weights(102, "/ckpt/c-broken")
    h.submit(1, PROMPT)
    h.run()
    assert h.reply(101) == "ok"
    assert "OSError: /ckpt/c-broken: a truncated file" in h.reply(102)
    # a refusal changed nothing: no restore; a failure after changes: restored
    assert h.engine.reloads == ["/ckpt/bad", "/ckpt/b", "/ckpt/c-broken", "/ckpt/b"]
    assert h.tokens[1] == lora_reference(PROMPT, 8, "/ckpt/b")
    assert h.sched.changes.weights_path == "/ckpt/b"


def test_a_reload_another_rank_failed_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    monkeypatch.setattr("minisgl.distributed.comm.min_over_ranks", lambda v, g: 0)
    h.weights(100, "/ckpt/b")
    h.submit(1, PROMPT)
    h.run()
    assert "loading the weights failed on another rank" in h.reply(100)
    assert h.engine.reloads == ["/ckpt/b", "fake"] and h.tokens[1] == reference(PROMPT, 8)


def test_held_requests_can_be_aborted_and_a_second_reload_waits_its_turn() -> None:
    h = Harness()
    h.submit(1, PROMPT, max_tokens=12)
    h.step()
    h.weights(100, "/ckpt/b")
    h.submit(2, PROMPT)
    h.submit(3, PROMPT[:5])
    h.step()
    h.abort(2)
    h.weights(101, "/ckpt/c")
    h.step()
    assert h.finished(2).finish_reason == "abort" and 2 not in h.tokens
    assert "a weight reload is already waiting" in h.reply(101)
    h.run()
    assert h.reply(100) == "ok" and h.tokens[3] == lora_reference(PROMPT[:5], 8, "/ckpt/b")
    assert h.accounting().live_requests == 0


# --- offline, against Hugging Face ----------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                ) -> List[Path]:
    """Two tiny Llama checkpoints of one shape (other random weights) and a copy of the second
    with another hidden size."""
    from tiny_models import build_tiny
    root = tmp_path_factory.mktemp("reload")
    a, b = tiny_model("llama"), build_tiny("llama", root / "b", None, seed=5)
    other = build_tiny("llama", root / "other", None, seed=5, hidden_size=32)
    return [a, b, other]


def _tokens(llm: LLM, prompts: List[List[int]]) -> List[List[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_reload_gives_each_checkpoints_tokens(checkpoints: List[Path], tmp_path: Path,
                                                      tp: int) -> None:
    """`LLM.update_weights_from_disk`: HF's tokens of the second checkpoint, then of the
    first again; a checkpoint of another shape, a truncated one, or one missing a tensor
    (found only after the others loaded: every rank restores) is a ValueError naming it, and
    the weights served stay."""
    a, b, other = checkpoints
    prompts = mixed_prompts(3, seed=18, lengths=(5, 21))
    want_a = hf_greedy(a, prompts, 10)
    want_b = hf_greedy(b, prompts, 10)
    assert want_a != want_b
    broken = tmp_path / "broken"
    shutil.copytree(b, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:len(data) // 2])
    partial = tmp_path / "partial"
    shutil.copytree(a, partial)
    tensors = load_file(str(a / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file({n: t * 2 for n, t in tensors.items()}, str(partial / "model.safetensors"))
    with LLM(str(a), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
             show_progress=False) as llm:
        assert _tokens(llm, prompts) == want_a
        llm.update_weights_from_disk(str(b))
        assert _tokens(llm, prompts) == want_b
        with pytest.raises(ValueError, match="hidden_size is 32; the served model's is 64"):
            llm.update_weights_from_disk(str(other))
        with pytest.raises(ValueError, match="broken"):
            llm.update_weights_from_disk(str(broken))
        with pytest.raises(ValueError, match="missing 1 weights"):
            llm.update_weights_from_disk(str(partial))
        with pytest.raises(ValueError, match="load_format 'gguf' is not supported .auto: "):
            llm.update_weights_from_disk(str(a), load_format="gguf")
        assert _tokens(llm, prompts) == want_b
        llm.update_weights_from_disk(str(a))
        assert _tokens(llm, prompts) == want_a
        assert llm.check_accounting().live_requests == 0


# --- over HTTP ------------------------------------------------------------------------------
def test_served_reload_answers_as_sglang_does(checkpoints: List[Path], tmp_path: Path) -> None:
    """POST /update_weights_from_disk: success and the second checkpoint's tokens (HF's);
    another shape, an unknown load_format, a missing field: success false with why (400),
    the weights served unchanged; abort_all_requests ends a long request at once instead of
    waiting for it, as SGLang's /abort_request ends one by its rid; /get_model_info names the
    checkpoint served. The prefix cache flushed on
    its own (/flush_cache, /reset_prefix_cache); vLLM's /ping and SGLang's /health_generate
    (a one-token generation through every process)."""
    import httpx
    from server_helpers import CPU_ARGS, serving, stream_generate
    a, b, other = checkpoints
    prompt = mixed_prompts(1, seed=19, lengths=(40,))[0]
    with serving(["--model", str(a), *CPU_ARGS], tmp_path) as srv:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{srv.url}{path}", json=body, timeout=120)

        def generate(max_tokens: int = 10) -> dict:
            return post("/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).json()

        assert generate()["output_ids"] == hf_greedy(a, [prompt], 10)[0]
        info = httpx.get(f"{srv.url}/get_model_info").json()
        assert info["model_path"] == str(a) and info["is_generation"] is True
        ok = post("/update_weights_from_disk", {"model_path": str(b)})
        assert ok.status_code == 200 and ok.json()["success"] is True, ok.text
        assert httpx.get(f"{srv.url}/get_model_info").json()["model_path"] == str(b)
        assert generate()["output_ids"] == hf_greedy(b, [prompt], 10)[0]
        for body, says in (({"model_path": str(other)}, "hidden_size is 32"),
                           ({"model_path": str(a), "load_format": "dummy"}, "load_format"),
                           ({"model_path": str(tmp_path / "nowhere")}, "nowhere")):
            r = post("/update_weights_from_disk", body)
            assert r.status_code == 400 and r.json()["success"] is False, r.text
            assert says in r.json()["message"], r.text
        assert post("/update_weights_from_disk", {}).status_code == 400
        assert generate()["output_ids"] == hf_greedy(b, [prompt], 10)[0]
        for stop in ({"model_path": str(a), "abort_all_requests": True}, {"rid": "roll-1"}):
            chunks: List[dict] = []
            worker = stream_generate(srv.url, prompt, 460, chunks, rid="roll-1")
            if "rid" in stop:  # SGLang's /abort_request by the request's rid
                assert post("/abort_request", {"rid": "other"}).status_code == 200
                r = post("/abort_request", stop)
            else:
                r = post("/update_weights_from_disk", stop)
                assert r.json()["success"] is True
            worker.join(60)
            assert r.status_code == 200 and not worker.is_alive()
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort", chunks[-1]
            assert len(chunks[-1]["output_ids"]) < 460
        assert post("/abort_request", {}).status_code == 400
        assert generate()["output_ids"] == hf_greedy(a, [prompt], 10)[0]
        # the prefix cache flushed (SGLang's GET or POST /flush_cache, vLLM's reset)
        assert srv.wait_metrics(lambda m: m["minisgl_kv_pages_cached"] > 0
                                )["minisgl_kv_pages_cached"] > 0
        for method, path in (("GET", "/flush_cache"), ("POST", "/reset_prefix_cache")):
            r = httpx.request(method, f"{srv.url}{path}", timeout=60)
            assert r.status_code == 200, r.text
            assert srv.wait_metrics(lambda m: m["minisgl_kv_pages_cached"] == 0
                                    )["minisgl_kv_pages_cached"] == 0
            generate()
        assert generate()["meta_info"]["cached_tokens"] > 0
        assert httpx.post(f"{srv.url}/flush_cache").text == "Cache flushed.\n"
        assert generate()["meta_info"]["cached_tokens"] == 0
        assert [httpx.request(m, f"{srv.url}/ping").status_code for m in ("GET", "POST")] == [
            200, 200]
        probe = httpx.get(f"{srv.url}/health_generate", timeout=60)
        assert probe.status_code == 200 and probe.json() == {"status": "ok"}
        # sleep mode's routes exist only with --enable-sleep-mode (test_sleep_mode.py)
        assert httpx.post(f"{srv.url}/sleep").status_code == 404
        assert httpx.get(f"{srv.url}/is_sleeping").status_code == 404


def test_every_data_parallel_replica_reloads(checkpoints: List[Path], tmp_path: Path) -> None:
    """--dp 2: one reload reaches both replicas (the router may send a prompt to either):
    every request after it gets the second checkpoint's tokens; a refused reload leaves
    both on it."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    a, b, other = checkpoints
    prompts = mixed_prompts(6, seed=20, lengths=(7, 30))
    want = hf_greedy(b, prompts, 8)
    with serving(["--model", str(a), "--dp", "2", *CPU_ARGS], tmp_path) as srv:
        def outputs() -> List[List[int]]:
            return [httpx.post(f"{srv.url}/generate", timeout=60, json={
                "input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True}}).json()["output_ids"]
                for p in prompts]
        outputs()  # both replicas busy once on the first checkpoint (its cache too)
        r = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": str(b)},
                       timeout=120)
        assert r.json()["success"] is True, r.text
        assert outputs() == want
        r = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": str(other)},
                       timeout=120)
        assert r.status_code == 400 and "hidden_size" in r.json()["message"]
        assert outputs() == want
