"""Streaming, sharded weight loading.

Safetensors: every rank opens the files itself and reads only its slices (`get_slice`), one
tensor at a time, so its peak memory is about its shard plus one slice. Dummy: random values
drawn directly into this rank's (already sharded) parameters; FP8 layers get random weights
quantized as their format lays out its scales (their `fill_quantized_random`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, List, Optional, Tuple, cast

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from minisgl.layers.fp8 import Fp8Module, finish_loading, fp8_layers
from minisgl.layers.source import TensorSource

logger = logging.getLogger(__name__)


class SafetensorsSource:
    """A lazily read checkpoint tensor: `read` fetches only the requested slice from disk."""

    def __init__(self, handle: object, name: str) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.name = name

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def read(self, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if dim is None and not self.shape:  # a slice cannot index a 0-dim tensor (a scale)
            return self._handle.get_tensor(self.name)  # type: ignore[attr-defined]
        if dim is None:
            return self._slice[:]
        if dim == 0:
            return self._slice[start:stop]
        if dim == 1:
            return self._slice[:, start:stop]
        raise ValueError(f"cannot slice {self.name} along dim {dim}")


def checkpoint_files(model_dir: Path) -> List[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_names(model_dir: Path) -> List[str]:
    """The names of the tensors in the checkpoint's *.safetensors files (none read)."""
    names: List[str] = []
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def iter_checkpoint(model_dir: Path, show_progress: bool) -> Iterator[Tuple[str, TensorSource]]:
    """(name, source) for every tensor of every *.safetensors file, with a progress bar."""
    files = checkpoint_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    names = [(h, n) for h in handles for n in h.keys()]
    for handle, name in tqdm(names, desc="loading weights", unit="tensor",
                             disable=not show_progress):
        yield name, SafetensorsSource(handle, name)


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights (normal, std 0.02; norm weights 1) in place, on the parameters' device
    (FP8 and packed layers fill their own, as their format lays them out); then the
    weight-only FP8 layers dequantized, as after a checkpoint's loading."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    quantized = list(fp8_layers(model)) + [
        (name, cast(Fp8Module, m)) for name, m in model.named_modules()
        if getattr(m, "packed", None) is not None]
    fp8_params = {f"{name}.{p}" for name, m in quantized for p, _ in m.named_parameters()
                  if p != "bias"}
    for name, p in model.named_parameters():
        if name in fp8_params:
            continue
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for _, module in quantized:
        module.fill_quantized_random(gen, 0.02)
    finish_loading(model)
