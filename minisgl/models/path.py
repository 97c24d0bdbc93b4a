"""Where a model's files are: a local Hugging Face directory, or the bundled default model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from minisgl.models.default_model import default_model_path


def resolve_model_path(model: Optional[str]) -> Path:
    """A local Hugging Face directory; None means the bundled default model (fetched and
    converted on first use)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {model!r} is not a directory with a config.json "
                                f"(models are loaded from local Hugging Face directories)")
    return path
