"""Attention backends over the paged KV pool."""

from minisgl.attention.base import AttentionBackend
from minisgl.attention.torch_backend import TorchBackend

__all__ = ["AttentionBackend", "TorchBackend", "make_backend"]


def make_backend(name: str, **kwargs: object) -> AttentionBackend:
    """`name`: "torch" or "triton" (GPU only)."""
    if name == "torch":
        return TorchBackend(**kwargs)  # type: ignore[arg-type]
    if name == "triton":
        from minisgl.attention.triton_backend import TritonBackend
        return TritonBackend(**kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown attention backend {name!r} (expected 'torch' or 'triton')")
