"""Device and dtype names as the settings take them, resolved without importing torch where the
answer needs none: the launcher resolves them before any rank starts, and torch costs a process
some 2 s to import. Asking whether CUDA is there ("auto", "cuda") imports it."""

from __future__ import annotations

from typing import Optional

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
DTYPE_NAMES = ("auto", *_DTYPES)  # what dtype_name takes (and None, as "auto")
# The spellings of `--kv-cache-dtype`: the model's dtype, or FP8 e4m3 (vLLM's names).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_device(device: str) -> str:
    """"cpu" or "cuda" for a device setting ("auto": CUDA where torch sees a GPU). ValueError
    for another name, or for "cuda" without a CUDA device."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not cuda_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def dtype_name(dtype: Optional[str], device: str) -> str:
    """torch's name of the compute dtype for a dtype setting on a resolved device: None/"auto"
    is float32 on CPU (exact comparison with the reference), bfloat16 on GPU."""
    if dtype in (None, "auto"):
        return "bfloat16" if device == "cuda" else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]
