"""The model's recommended sampling (generation_config.json) as request defaults, as vLLM's
`--generation-config auto`: a request's own values win, "none" keeps OpenAI's defaults, a bad
file or value is a start-up error naming it; --override-generation-config over them. (Its
served case also checks the periodic stats line, its server logging at INFO.)"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict

import httpx
import pytest

from minisgl import LLM, SamplingParams
from minisgl.models.generation import SamplingDefaults, sampling_defaults
from server_helpers import Server, run_serve

# Greedy by default, so a request that leaves temperature unset is deterministic whatever its seed.
RECOMMENDED = {"temperature": 0.0, "top_p": 0.5, "top_k": 20, "do_sample": True,
               "bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 7}


def _with_generation_config(src: Path, dst: Path, config: Dict[str, Any]) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def greedy_model(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Path:
    return _with_generation_config(tiny_model("qwen3"),
                                   tmp_path_factory.mktemp("gen") / "model", RECOMMENDED)


def test_defaults_read_as_vllm_reads_them(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert sampling_defaults("auto", model) == SamplingDefaults()  # no file: OpenAI's
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 1, "top_p": 0.95, "top_k": 0, "repetition_penalty": 1.05,
         "min_p": None, "bos_token_id": 1}))
    got = sampling_defaults("auto", model)
    # an int temperature is a float, top_k 0 is Hugging Face's "no top-k", null is unset
    assert got == SamplingDefaults(1.0, 0.95, -1, 0.0, 1.05)
    assert got.changed == {"top_p": 0.95, "repetition_penalty": 1.05}
    assert sampling_defaults("none", model) == SamplingDefaults()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    assert sampling_defaults(str(other), model).temperature == 0.3


@pytest.mark.parametrize("content,match", [
    ('{"temperature": -1}', "temperature must be a finite number >= 0, got -1.0"),
    ('{"top_k": 2.5}', "top_k must be -1 or 0"),
    ('{"top_p": "high"}', "top_p must be in"),
    ("[1]", "must hold a JSON object"),
    ("{", "is not JSON"),
])
def test_a_bad_file_is_named(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        sampling_defaults("auto", tmp_path)
    assert str(tmp_path / "generation_config.json") in str(e.value)


def test_overrides_set_over_the_file(tmp_path: Path) -> None:
    """--override-generation-config (vLLM's): its keys over the file's (over none with
    generation_config none or vLLM's "vllm"); a key minisgl does not apply, or a bad value,
    is refused naming the setting (and the file it was set over)."""
    (tmp_path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    over = sampling_defaults("auto", tmp_path, '{"temperature": 1, "max_new_tokens": 64}')
    assert over == SamplingDefaults(temperature=1.0, top_p=0.5, top_k=20, max_tokens=64)
    for source in ("none", "vllm"):
        assert sampling_defaults(source, tmp_path, '{"top_k": 0, "min_p": 0.1}') == (
            SamplingDefaults(min_p=0.1))
    with pytest.raises(ValueError, match="override_generation_config: do_sample is not supported"):
        sampling_defaults("auto", tmp_path, '{"do_sample": true}')
    with pytest.raises(ValueError, match="override_generation_config over generation_config: "
                                         ".*temperature must be"):
        sampling_defaults("auto", tmp_path, '{"temperature": -2}')
    with pytest.raises(ValueError, match="must be a JSON object"):
        sampling_defaults("none", tmp_path, "[1]")


def test_a_directory_without_the_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read .*missing/generation_config.json"):
        sampling_defaults(str(tmp_path / "missing"), tmp_path)


def test_offline_calls_without_params_take_the_recommendation(greedy_model: Path) -> None:
    with LLM(str(greedy_model), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.5, 20)
        # max_new_tokens caps an unset max_tokens (as vLLM's default max_tokens)
        assert (defaults.max_tokens, defaults.default_max_tokens) == (None, 7)
        prompt = [5, 6, 7, 8]
        greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))
        assert llm.generate(prompt)[0].token_ids == greedy[0].token_ids[:7]
    with LLM(str(greedy_model), device="cpu", max_kv_tokens=1024, show_progress=False,
             generation_config="none") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with LLM(str(greedy_model), device="cpu", max_kv_tokens=1024, show_progress=False,
             override_generation_config={"top_k": 5, "max_new_tokens": 3}) as llm:
        params = llm.get_default_sampling_params()  # the file's, with the overrides over them
        assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.5, 5)
        assert len(llm.generate([5, 6, 7, 8])[0].token_ids) == 3


def test_requests_that_leave_sampling_unset_take_the_recommendation(
        greedy_model: Path, tmp_path: Path) -> None:
    srv = Server.start(["--model", str(greedy_model), "--device", "cpu", "--max-kv-tokens",
                        "2048", "--log-level", "info", "--log-stats-interval", "0.2"], tmp_path)
    try:
        assert "sampling defaults from the model's generation config: temperature=0.0, " \
               "top_p=0.5, top_k=20" in srv.stderr()

        def complete(**fields: Any) -> str:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 12, **fields}
            r = httpx.post(f"{srv.base_url}/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        greedy = complete(temperature=0)
        assert complete(seed=1) == complete(seed=2) == complete(temperature=None) == greedy
        # the request's own values win: 8 random draws at temperature 2 all greedy is unlikely
        assert any(complete(temperature=2.0, seed=s) != greedy for s in range(8))
        r = httpx.post(f"{srv.url}/generate", timeout=60, json={
            "input_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 12, "seed": 3}})
        assert r.status_code == 200 and r.json()["text"] == greedy
        # max_new_tokens (7) caps a request without max_tokens; a request's own value wins,
        # and completions keep OpenAI's explicit default of 16
        for path, body, want in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, 7),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 9}, 9),
                ("/v1/completions", {"prompt": [5, 6]}, 16),
                ("/generate", {"input_ids": [5, 6]}, 7)):
            fields = {"ignore_eos": True}
            if path == "/generate":
                body = {**body, "sampling_params": fields}
            else:
                body = {**body, **fields}
            r = httpx.post(f"{srv.url}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == want, (path, body)
        # --log-stats-interval: the periodic stats line came while requests ran
        for _ in range(50):
            if " stats: " in srv.stderr():
                break
            time.sleep(0.1)
        line = next(ln for ln in srv.stderr().splitlines() if " stats: " in ln)
        assert "[api]" in line and "tok/s" in line and "KV " in line, line
    finally:
        srv.stop()


def test_an_unreadable_generation_config_stops_the_start(greedy_model: Path,
                                                          tmp_path: Path) -> None:
    run = run_serve(["--model", str(greedy_model), "--device", "cpu", "--generation-config",
                     str(tmp_path / "nowhere")], tmp_path, timeout_s=60)
    assert run.returncode == 1
    assert "generation_config" in run.stderr and "nowhere/generation_config.json" in run.stderr


def test_max_new_tokens_only_lowers_what_an_unset_max_tokens_gets() -> None:
    """The eighth-of-the-pool cap (requests without max_tokens side by side) stays: a larger
    max_new_tokens does not raise it (a review found it did), a smaller one lowers it."""
    from minisgl.core import Limits, check_request
    limits = Limits(max_context=32768, vocab_size=100, num_pages=2048, page_size=16,
                    max_prefill_tokens=8192)
    ids = list(range(10))

    def resolved(cap: object) -> object:
        return check_request(ids, SamplingParams(max_tokens=None, default_max_tokens=cap),
                             limits).max_tokens

    assert resolved(None) == resolved(30000) == 32768 // 8
    assert resolved(100) == 100
