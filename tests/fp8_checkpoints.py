"""FP8 checkpoints written from a dense tiny one, in the formats minisgl reads, each with its
dequantized float32 twin (the weights Hugging Face runs as the reference).

The quantization here is the test's own (not minisgl's), as llm-compressor and Hugging Face
write them: weight = fp8(w / s) with s = amax / 448 per tensor, per output row or per block,
and the dequantized twin holds fp8 * s in float32.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# (Phi-3's checkpoints fuse q/k/v into qkv_proj and gate/up into gate_up_proj; Mixtral's
# experts name gate, down and up w1, w2, w3.)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj", "w1", "w2", "w3")


class Group(NamedTuple):
    """Layers quantized alike: `target` "Linear" (all) or "re:" a regular expression, the
    weights' scales ("tensor", "channel" or "block"), static activation scales (`input_scale`
    tensors) or dynamic ones."""

    target: str
    weights: str
    static: bool


class Fp8Format(NamedTuple):
    """How the test writes a checkpoint: its groups (the first matching a layer applies; "fp8"
    takes one), the layers left dense (checkpoint module names) and the config's way of
    naming them."""

    method: str  # "compressed-tensors" or "fp8"
    groups: Tuple[Group, ...]
    dense: Tuple[str, ...]
    ignore: Tuple[str, ...]
    scale_shape: str = "default"  # "scalar": per-tensor scales as 0-d tensors

    def group(self, module: str) -> Group:
        return next(g for g in self.groups if g.target == "Linear"
                    or re.match(g.target[3:], module))


class Written(NamedTuple):
    fp8: Path  # the FP8 checkpoint
    dequantized: Path  # its float32 twin, no quantization_config


def _quantize(w: torch.Tensor, weights: str, block: Tuple[int, int] = (128, 128)
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale as the checkpoint stores it, scale broadcast to w's shape)."""
    w = w.float()
    if weights == "tensor":
        s = w.abs().amax() / FP8_MAX
        full = s.expand_as(w)
    elif weights == "channel":
        s = (w.abs().amax(dim=1) / FP8_MAX)[:, None]
        full = s.expand_as(w)
    else:
        n, k = w.shape
        bn, bk = block
        s = torch.empty(-(-n // bn), -(-k // bk))
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / FP8_MAX
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s, full


def _ct_group(g: Group) -> Dict[str, object]:
    weights: Dict[str, object] = {"type": "float", "num_bits": 8, "strategy": g.weights,
                                  "symmetric": True, "dynamic": False, "group_size": None,
                                  "observer": "minmax"}
    if g.weights == "block":
        weights["block_structure"] = [128, 128]
    acts = ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False,
             "symmetric": True} if g.static else
            {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True,
             "symmetric": True})
    return {"targets": [g.target], "weights": weights, "input_activations": acts}


def quantization_config(fmt: Fp8Format) -> Dict[str, object]:
    if fmt.method == "fp8":
        (g,) = fmt.groups
        cfg: Dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "static" if g.static else "dynamic",
                                  "modules_to_not_convert": list(fmt.ignore)}
        if g.weights == "block":
            cfg["weight_block_size"] = [128, 128]
        return cfg
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {f"group_{i}": _ct_group(g) for i, g in enumerate(fmt.groups)},
            "ignore": list(fmt.ignore)}


def write_fp8(dense: Path, out: Path, fmt: Fp8Format, seed: int = 0) -> Written:
    """The FP8 checkpoint of tiny checkpoint `dense` in `fmt` (under out/fp8) and its
    dequantized float32 twin (out/dequantized), both with `dense`'s other files."""
    gen = torch.Generator().manual_seed(seed)
    fp8_dir, deq_dir = out / "fp8", out / "dequantized"
    for d in (fp8_dir, deq_dir):
        d.mkdir(parents=True, exist_ok=True)
        for f in dense.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
    quantized: Dict[str, torch.Tensor] = {}
    dequantized: Dict[str, torch.Tensor] = {}
    for f in sorted(dense.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                module, param = name.rsplit(".", 1)
                if (param != "weight" or module.split(".")[-1] not in PROJECTIONS
                        or module in fmt.dense):
                    quantized[name] = dequantized[name] = t
                    continue
                group = fmt.group(module)
                q, s, full = _quantize(t, group.weights)
                if fmt.scale_shape == "scalar" and group.weights == "tensor":
                    s = s.reshape(())
                elif group.weights == "tensor":
                    s = s.reshape(1)
                scale_name = "weight_scale_inv" if (fmt.method, group.weights) == (
                    "fp8", "block") else "weight_scale"
                quantized[name] = q
                quantized[f"{module}.{scale_name}"] = s.float().contiguous()
                if group.static:
                    quantized[f"{module}.input_scale"] = (
                        0.01 + 0.1 * torch.rand(1, generator=gen))
                dequantized[name] = (q.float() * full).contiguous()
    save_file(quantized, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dense / "config.json").read_text())
    (deq_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    cfg["quantization_config"] = quantization_config(fmt)
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    return Written(fp8_dir, deq_dir)


def write_config(out: Path, dense: Path, quantization: Optional[Dict[str, object]],
                 files: Sequence[str] = ()) -> Path:
    """A directory with `dense`'s config.json but `quantization` as its quantization_config
    (and the named files of `dense` copied)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(cfg))
    for name in files:
        shutil.copy(dense / name, out / name)
    return out


def cached_writer(source: Callable[[str], Tuple[Path, Fp8Format]], out: Callable[[str], Path]
                  ) -> Callable[[str], Written]:
    """name -> the FP8 checkpoint (and twin) of `source(name)`'s dense checkpoint and format,
    written once under `out(name)` (a module fixture's cache)."""
    cache: Dict[str, Written] = {}

    def make(name: str) -> Written:
        if name not in cache:
            dense, fmt = source(name)
            cache[name] = write_fp8(dense, out(name), fmt)
        return cache[name]

    return make
