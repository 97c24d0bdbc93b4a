"""The `load_format`s each SGLang-style weight update takes, checked where the update enters
(`LLM` and the HTTP server) before anything moves. Imports no torch: the API server uses it."""

from __future__ import annotations

from typing import Mapping, Optional

# update_weights_from_disk: format -> what it reads
DISK_FORMATS: Mapping[str, str] = {"auto": "the checkpoint directory's safetensors"}
# update_weights_from_tensor: format -> what each payload holds (tensor_payload.py)
TENSOR_FORMATS: Mapping[str, str] = {"direct": "a list of (name, tensor) pairs",
                                     "flattened_bucket": "SGLang's flattened bucket"}


def check_load_format(load_format: Optional[str], formats: Mapping[str, str]) -> None:
    """ValueError naming `load_format` and the ones `formats` takes, unless it is one of them
    or None (the first: each update's default)."""
    if load_format is not None and load_format not in formats:
        taken = "; ".join(f"{name}: {what}" for name, what in formats.items())
        raise ValueError(f"load_format {load_format!r} is not supported ({taken})")
