"""Resolving a model directory and loading its tokenizer (the only places that know text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


def resolve_model_path(model: Optional[str]) -> Path:
    """A local Hugging Face directory; None means the bundled default model."""
    if model is None:
        from minisgl.models.default_model import default_model_path
        return default_model_path()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {model!r} is not a directory with a config.json "
                                f"(models are loaded from local Hugging Face directories)")
    return path


def has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                             "tokenizer_config.json"))


def load_tokenizer(path: Path) -> Optional[Any]:
    """The model's tokenizer, or None for a directory without one (benchmark shapes: token-id
    prompts only)."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))
