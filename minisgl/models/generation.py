"""The sampling a checkpoint's creator recommends, as request defaults.

A model's `generation_config.json` may carry `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` (Qwen3: 0.6 / 0.95 / 20; Llama 3.1: 0.6 / 0.9) and `max_new_tokens`.
With `generation_config` "auto" (the default, as vLLM's `--generation-config auto` and SGLang's
`--sampling-defaults model`), a request that leaves one of them unset gets the model's value
instead of OpenAI's neutral default; "none" keeps OpenAI's defaults; any other value is a
directory whose `generation_config.json` is read instead. A request's own values always win.
`max_new_tokens` caps what an unset max_tokens resolves to (core.SamplingParams
.default_max_tokens; vLLM takes the smaller of it and the rest of the context; here the
eighth-of-the-pool cap, which keeps requests side by side, stays too). HF's `do_sample` and
`max_length` are not read (vLLM reads neither).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from minisgl.core import SamplingParams
from minisgl.settings import json_object

GENERATION_CONFIG = "generation_config.json"
SOURCES = ("auto", "none", "vllm")  # besides a directory ("vllm": vLLM's name for none)


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling fields a request leaves unset: OpenAI's neutral ones unless the
    model recommends others."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = None  # generation_config's max_new_tokens

    @property
    def changed(self) -> Dict[str, Any]:
        """The fields that differ from OpenAI's defaults (for the start-up log)."""
        neutral = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(neutral, f.name)}

    def params(self) -> SamplingParams:
        """SamplingParams with these values and the rest at their defaults (with a
        max_new_tokens, an unset max_tokens capped by it, else the offline default of 16)."""
        fields = dataclasses.asdict(self)
        cap = fields.pop("max_tokens")
        if cap is None:
            return SamplingParams(**fields)
        return SamplingParams(**fields, max_tokens=None, default_max_tokens=cap)


_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def check_generation_overrides(text: Optional[str]) -> Dict[str, Any]:
    """override_generation_config (vLLM's) parsed: a JSON object of _KEYS; ValueError naming
    the setting and the key where it is not (the values are checked with the defaults)."""
    return json_object(text, "override_generation_config", "sampling defaults", _KEYS)


def _file_values(source: str, model_dir: Path) -> Tuple[Dict[str, Any], Optional[Path]]:
    """The sampling keys of the generation_config.json `source` names, and that file (none
    for "none")."""
    if source in ("none", "vllm"):
        return {}, None
    path = (model_dir if source == "auto" else Path(source).expanduser()) / GENERATION_CONFIG
    if source == "auto" and not path.is_file():
        return {}, None
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"generation_config {source!r}: cannot read {path}: "
                         f"{e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config: {path} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return {k: v for k, v in raw.items() if k in _KEYS and v is not None}, path


def sampling_defaults(source: str, model_dir: Path, overrides: Optional[str] = None
                      ) -> SamplingDefaults:
    """The defaults `source` names ("auto": `model_dir`'s generation_config.json, OpenAI's
    defaults where it has none; "none", or vLLM's "vllm"; or a directory holding one), with
    `overrides` (override_generation_config's JSON) set over them. ValueError naming the
    file or the setting, and the value, for a missing directory file, bad JSON or a bad
    value."""
    from_file, path = _file_values(source, model_dir)
    given = {**from_file, **check_generation_overrides(overrides)}
    where = " over ".join([*(["override_generation_config"] if overrides else []),
                           *([f"generation_config: {path}"] if path else [])])
    if "max_new_tokens" in given:
        given["max_tokens"] = given.pop("max_new_tokens")
    if isinstance(given.get("top_k"), int) and given["top_k"] == 0:
        given["top_k"] = -1  # Hugging Face's "no top-k"
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if isinstance(given.get(name), int) and not isinstance(given[name], bool):
            given[name] = float(given[name])
    defaults = SamplingDefaults(**given)
    try:
        defaults.params().validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return defaults
