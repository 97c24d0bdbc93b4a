"""A LoRA adapter's directory read and checked (PEFT's adapter_config.json), without torch: the
launcher checks every adapter this way before any rank starts, and each rank again before it
loads one (models/lora.py). What minisgl cannot apply exactly is refused, naming it: DoRA,
biases, `modules_to_save`, per-module rank or alpha patterns, Conv1D layouts, a rank above
--max-lora-rank. The scaling is PEFT's: lora_alpha / rank, or lora_alpha / sqrt(rank) with
`use_rslora`.

An adapter's path may also be a Hugging Face hub id (`ORG/NAME`), fetched into the hub cache
as models are (models/path.py: only its config and weights), so that the launcher's check
downloads it once and the ranks find it cached.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from minisgl.models.path import download_model, looks_like_hub_id

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
HUB_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what an adapter on the hub is fetched for
# PEFT options whose non-default values change what the adapter computes
# Why an adapter cannot load at run time where LoRA was not asked for at start-up
RUNTIME_OFF = "loading LoRA adapters at run time needs --enable-lora (or --max-loras) at start-up"
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as its config describes it (`read_adapter` checked it)."""

    name: str
    path: Path
    rank: int
    scaling: float


def read_adapter(name: str, path: str, max_rank: int) -> LoraAdapter:
    """The adapter at directory `path` (or hub id: the module's doc), served as `name`;
    ValueError naming the problem (a missing file, a hub id neither cached nor downloadable, a
    rank above `max_rank`, an option minisgl cannot apply)."""
    root = Path(path).expanduser()
    if not root.is_dir() and looks_like_hub_id(path):
        try:
            root = download_model(path, files=HUB_FILES)
        except FileNotFoundError as e:
            raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    config_file, weights = root / CONFIG_FILE, root / WEIGHTS_FILE
    for f in (config_file, weights):
        if not f.is_file():
            raise ValueError(f"LoRA adapter {name!r}: no {f.name} in {root}")
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not "
                         f"LORA")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None):
            raise ValueError(f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported "
                             f"(only {key}={default!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {key} {cfg[key]!r} is not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank!r} is not in [1, {max_rank}] "
                         f"(--max-lora-rank)")
    alpha = float(cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoraAdapter(name, root, rank, scaling)


def check_runtime_load(name: str, path: str, runtime: bool, max_rank: int) -> LoraAdapter:
    """Adapter `name` at `path` as a run-time load would take it (its config read and
    checked, `read_adapter`); ValueError where run-time loads are off (`runtime`:
    EngineConfig.lora_runtime) or the config refuses. The ranks check its tensors."""
    if not runtime:
        raise ValueError(RUNTIME_OFF)
    return read_adapter(name, path, max_rank)
