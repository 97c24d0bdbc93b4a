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
from typing import Any, Dict, Optional

from minisgl.core import SamplingParams

GENERATION_CONFIG = "generation_config.json"
SOURCES = ("auto", "none")  # besides a directory


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


def sampling_defaults(source: str, model_dir: Path) -> SamplingDefaults:
    """The defaults `source` names ("auto": `model_dir`'s generation_config.json, OpenAI's
    defaults where it has none; "none"; or a directory holding one). ValueError naming the
    file and the value for a missing directory file, bad JSON or a bad value."""
    if source == "none":
        return SamplingDefaults()
    path = (model_dir if source == "auto" else Path(source).expanduser()) / GENERATION_CONFIG
    if source == "auto" and not path.is_file():
        return SamplingDefaults()
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"generation_config {source!r}: cannot read {path}: "
                         f"{e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config: {path} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    fields = {f.name for f in dataclasses.fields(SamplingDefaults)} - {"max_tokens"}
    given = {k: v for k, v in raw.items() if k in fields and v is not None}
    if raw.get("max_new_tokens") is not None:
        given["max_tokens"] = raw["max_new_tokens"]
    if isinstance(given.get("top_k"), int) and given["top_k"] == 0:
        given["top_k"] = -1  # Hugging Face's "no top-k"
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if isinstance(given.get(name), int) and not isinstance(given[name], bool):
            given[name] = float(given[name])
    defaults = SamplingDefaults(**given)
    try:
        defaults.params().validate()
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return defaults
