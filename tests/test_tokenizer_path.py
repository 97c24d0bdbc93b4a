"""`--tokenizer` / `LLM(tokenizer=...)`: a model directory without tokenizer files (a benchmark
shape, a bare checkpoint) serves text and chat with another directory's tokenizer, its chat
template and, for constrained output, its vocabulary in the ranks' grammar compiler; a
directory without a tokenizer is refused naming it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import httpx
import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import StructuredOutput
from server_helpers import Server, run_serve
from tiny_models import build_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_model("qwen3")'s weights (the same seed) without its tokenizer files."""
    return build_tiny("qwen3", tmp_path_factory.mktemp("bare") / "qwen3", None)


def test_offline_text_and_constrained_output_with_another_tokenizer(
        bare_model: Path, tiny_model: Callable[..., Path], default_model_dir: Path) -> None:
    with LLM(str(tiny_model("qwen3")), device="cpu", max_kv_tokens=1024,
             show_progress=False) as llm:
        want = llm.generate("Hello there", GREEDY)[0].token_ids
    regex = SamplingParams(max_tokens=8, temperature=0.0,
                           structured=StructuredOutput("regex", "[a-z]{3} [0-9]{2}"))
    with LLM(str(bare_model), device="cpu", max_kv_tokens=1024, show_progress=False,
             tokenizer=str(default_model_dir)) as llm:
        assert llm.generate("Hello there", GREEDY)[0].token_ids == want
        assert re.fullmatch("[a-z]{3} [0-9]{2}", llm.generate("x", regex)[0].text)
    with LLM(str(bare_model), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        with pytest.raises(ValueError, match="has no tokenizer: pass token ids"):
            llm.generate("Hello there", GREEDY)


def test_a_directory_without_a_tokenizer_is_refused(bare_model: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"tokenizer '{tmp_path}' is not a directory "
                                                f"with tokenizer files"):
        LLM(str(bare_model), device="cpu", tokenizer=str(tmp_path), show_progress=False)
    run = run_serve(["--model", str(bare_model), "--device", "cpu", "--tokenizer",
                     str(tmp_path)], tmp_path, timeout_s=60)
    assert run.returncode == 1 and f"tokenizer '{tmp_path}' is not a directory" in run.stderr


def test_served_chat_and_json_with_another_tokenizer(bare_model: Path, default_model_dir: Path,
                                                     tmp_path: Path) -> None:
    srv = Server.start(["--model", str(bare_model), "--tokenizer", str(default_model_dir),
                        "--device", "cpu", "--max-kv-tokens", "2048", "--log-level", "warning"],
                       tmp_path)
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24,
                "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "n", "schema": {"type": "object", "properties": {
                        "n": {"type": "integer"}}, "required": ["n"]}}}}
        r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        # the default tokenizer's chat template ran: SmolLM2's turn markers, not a 400
        assert r.json()["usage"]["prompt_tokens"] > 5
        assert r.json()["choices"][0]["message"]["content"].startswith("{")
    finally:
        srv.stop()
