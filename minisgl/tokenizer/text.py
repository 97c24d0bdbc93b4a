"""Loading a model directory's tokenizer (the tokenizer processes are the only places that know
text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


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
