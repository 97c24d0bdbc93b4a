"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints (integer weights, dequantized as
they load) against Hugging Face transformers: a tiny Llama whose projections are quantized
here, packed as AutoAWQ, AutoGPTQ and compressed-tensors pack them (the packers below follow
their code, apart from ours that unpacks), and a dense checkpoint of the same dequantized
weights for transformers; greedy tokens must agree, at tp=1 and tp=2 (each rank dequantizing
only its slice), with act-order too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, Tuple

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy, mixed_prompts

from minisgl import LLM, SamplingParams
from minisgl.models.config import ModelConfig
from minisgl.models.int_quant import IntQuant
from minisgl.models.int_weights import IntWeightSource

GROUP = 16
# (Phi-3's checkpoints fuse q/k/v into qkv_proj and gate/up into gate_up_proj.)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj")


def _words(values: np.ndarray) -> torch.Tensor:
    """uint32 words as the int32 tensor a checkpoint stores (same bits)."""
    return torch.from_numpy(values.astype(np.uint32).view(np.int32).copy())


def pack_awq(ints: np.ndarray) -> torch.Tensor:
    """AutoAWQ's packing of [rows, cols] 4-bit values along the columns: word c holds columns
    c*8 + order_map[i] at bits 4i."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = np.zeros((ints.shape[0], ints.shape[1] // 8), dtype=np.uint64)
    for col in range(ints.shape[1] // 8):
        for i in range(8):
            out[:, col] |= ints[:, col * 8 + order_map[i]].astype(np.uint64) << np.uint64(i * 4)
    return _words(out)


def pack_gptq_rows(ints: np.ndarray, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight: [in, out] values packed along the rows, value j of a word at bits
    j*bits."""
    n = 32 // bits
    out = np.zeros((ints.shape[0] // n, ints.shape[1]), dtype=np.uint64)
    for row in range(out.shape[0]):
        for j in range(n):
            out[row] |= ints[row * n + j].astype(np.uint64) << np.uint64(j * bits)
    return _words(out)


def pack_gptq_cols(ints: np.ndarray, bits: int) -> torch.Tensor:
    """AutoGPTQ's qzeros: [groups, out] values packed along the columns, in order."""
    n = 32 // bits
    out = np.zeros((ints.shape[0], ints.shape[1] // n), dtype=np.uint64)
    for col in range(out.shape[1]):
        for j in range(n):
            out[:, col] |= ints[:, col * n + j].astype(np.uint64) << np.uint64(j * bits)
    return _words(out)


def pack_ct(ints: np.ndarray, bits: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 of signed [out, in] values: each plus 2^(bits - 1),
    packed along the columns, value j of a word at bits j*bits."""
    return pack_gptq_cols(ints + (1 << (bits - 1)), bits)


def _quantize(weight: torch.Tensor, rng: np.random.Generator, bits: int, act_order: bool,
              min_zero: int = 0, shared_order: bool = False
              ) -> Tuple[np.ndarray, np.ndarray, torch.Tensor, np.ndarray, torch.Tensor]:
    """Random integers for a weight's shape: (values [in, out], zero points [groups, out] from
    `min_zero` (GPTQ's original format stores them minus one, so 0 cannot be), scales
    [groups, out] (float16), each input's group, the dense weight [out, in] they make).
    `shared_order`: act-order's permutation is one per input width, as GPTQ's (from the
    layer's inputs) is one for the projections that share them; else one per weight."""
    out_f, in_f = weight.shape
    top = (1 << bits) - 1
    groups = in_f // GROUP
    q = rng.integers(0, top + 1, size=(in_f, out_f))
    z = rng.integers(min_zero, top + 1, size=(groups, out_f))
    s = torch.from_numpy(rng.uniform(0.002, 0.02, size=(groups, out_f))).half()
    g = np.arange(in_f) // GROUP
    if act_order:
        g = (np.random.default_rng(in_f) if shared_order else rng).permutation(g)
    dense = (torch.from_numpy(q - z[g]).float() * s.float()[torch.from_numpy(g)]).t()
    return q, z, s, g, dense.contiguous()


def _write(base: Path, out: Path, dense_out: Path, method: str, bits: int = 4,
           act_order: bool = False, v2: bool = False, shared_order: bool = False) -> None:
    """`out`: the base model with its projections quantized as `method` packs them;
    `dense_out`: the same model with those weights dequantized (transformers' reference)."""
    rng = np.random.default_rng(5)
    tensors = load_file(str(base / "model.safetensors"))
    quant: Dict[str, torch.Tensor] = {}
    for name in list(tensors):
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            quant[name] = tensors[name]
            continue
        v1 = method == "gptq" and not v2
        q, z, s, g, dense = _quantize(tensors[name], rng, bits, act_order, int(v1),
                                      shared_order)
        tensors[name] = dense
        if method == "ct":  # symmetric: the value q - 2^(bits - 1), no zero points
            half = 1 << (bits - 1)
            dense = (torch.from_numpy(q - half).float() * s.float()[torch.from_numpy(g)]).t()
            tensors[name] = dense.contiguous()
            quant.update({f"{prefix}.weight_packed": pack_ct((q - half).T, bits),
                          f"{prefix}.weight_scale": s.t().contiguous(),
                          f"{prefix}.weight_shape": torch.tensor(list(dense.shape))})
            if act_order:
                quant[f"{prefix}.weight_g_idx"] = torch.from_numpy(g.astype(np.int32))
        elif method == "awq":
            quant.update({f"{prefix}.qweight": pack_awq(q), f"{prefix}.qzeros": pack_awq(z),
                          f"{prefix}.scales": s})
        else:
            stored = z if v2 else z - 1  # GPTQ's original format keeps zero points minus one
            quant.update({f"{prefix}.qweight": pack_gptq_rows(q, bits),
                          f"{prefix}.qzeros": pack_gptq_cols(stored, bits),
                          f"{prefix}.scales": s,
                          f"{prefix}.g_idx": torch.from_numpy(g.astype(np.int32))})
    for target, payload in ((out, quant), (dense_out, tensors)):
        shutil.copytree(base, target)
        save_file(payload, str(target / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "ignore": ["lm_head"], "config_groups": {"group_0": {
              "targets": ["Linear"], "input_activations": None,
              "weights": {"num_bits": bits, "type": "int", "symmetric": True,
                          "strategy": "group", "group_size": GROUP,
                          "actorder": "group" if act_order else None}}}}
    cfg["quantization_config"] = ct if method == "ct" else (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order,
         "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method,bits,act_order,v2,tp", [
    ("awq", 4, False, False, 2), ("gptq", 4, True, False, 2),
    ("gptq", 8, False, True, 1), ("ct", 4, False, False, 2), ("ct", 8, True, False, 1)])
def test_int_checkpoints_match_hf_on_their_dequantized_weights(
        tiny_model: Callable[..., Path], tmp_path: Path, method: str, bits: int,
        act_order: bool, v2: bool, tp: int) -> None:
    base = tiny_model("llama")
    quantized, dense = tmp_path / "int", tmp_path / "dense"
    _write(base, quantized, dense, method, bits, act_order, v2)
    prompts = mixed_prompts(3, seed=12, lengths=(5, 17, 30))
    with LLM(str(quantized), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
             show_progress=False) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True))]
    assert got == hf_greedy(dense, prompts, 12)


class _Tensor:
    """A checkpoint tensor held in memory (layers/source.TensorSource)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.t.shape)

    def read(self, dim: "int | None" = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        if dim is None:
            return self.t
        return self.t[start:stop] if dim == 0 else self.t[:, start:stop]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_slice_dequantizes_as_the_whole_does(method: str) -> None:
    """Rows and columns cut off word boundaries (a rank's share) equal the whole weight's."""
    rng = np.random.default_rng(3)
    q, z, s, g, dense = _quantize(torch.zeros(48, 64), rng, 4, method == "gptq")
    parts = ({"qweight": pack_awq(q), "qzeros": pack_awq(z), "scales": s} if method == "awq"
             else {"qweight": pack_gptq_rows(q, 4), "qzeros": pack_gptq_cols(z, 4),
                   "scales": s, "g_idx": torch.from_numpy(g.astype(np.int32))})
    src = IntWeightSource("layer", {k: _Tensor(v) for k, v in parts.items()},
                          IntQuant(method, 4, GROUP))
    assert src.shape == (48, 64)
    torch.testing.assert_close(src.read(), dense, rtol=0, atol=0)
    torch.testing.assert_close(src.read(0, 5, 29), dense[5:29], rtol=0, atol=0)
    torch.testing.assert_close(src.read(1, 13, 51), dense[:, 13:51], rtol=0, atol=0)


@pytest.mark.parametrize("q,match", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 3}, "AWQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 2}, "GPTQ with 2 bits"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"x": {}}}, "`dynamic` overrides"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False,
                          "strategy": "group", "group_size": 16}}}},
     "asymmetric integer weights"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"},
              "input_activations": {"num_bits": 8}}}}, "W4A8"),
])
def test_int_layouts_minisgl_cannot_read_are_refused(q: dict, match: str) -> None:
    raw = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=4, quantization_config=q)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_quantization_setting_names_the_checkpoint_method() -> None:
    """vLLM's method names as the `quantization` setting state what the checkpoint is: taken
    where config.json agrees (the marlin names for the same checkpoints), refused naming both
    where it does not, or where the checkpoint is not quantized."""
    raw = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=4)
    awq = ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "awq",
                                                                 "bits": 4}})
    gptq = ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "gptq",
                                                                  "bits": 4}})
    dense = ModelConfig.from_dict(raw)
    for cfg, names in ((awq, ("awq", "awq_marlin")), (gptq, ("gptq", "gptq_marlin")),
                       (dense, ("fp8",))):
        for name in (None, *names):
            cfg.check_quantization(name)
    with pytest.raises(ValueError, match="'gptq_marlin' names a gptq checkpoint, but its "
                                         "quant_method is 'awq'"):
        awq.check_quantization("gptq_marlin")
    with pytest.raises(ValueError, match="'compressed-tensors' names a compressed-tensors "
                                         "checkpoint, but its quant_method is 'gptq'"):
        gptq.check_quantization("compressed-tensors")
    with pytest.raises(ValueError, match="'awq' names a awq checkpoint, but it has no "
                                         "quantization_config"):
        dense.check_quantization("awq")
    with pytest.raises(ValueError, match="quantization must be one of fp8, awq, .* got 'int4'"):
        dense.check_quantization("int4")


def test_awq_setting_serves_the_awq_checkpoint(tiny_model: Callable[..., Path],
                                               tmp_path: Path) -> None:
    """`quantization="awq_marlin"` over an AWQ checkpoint serves it as it is (the same tokens
    as unset); "gptq" over it is refused before anything loads."""
    _write(tiny_model("llama"), tmp_path / "int", tmp_path / "dense", "awq")
    prompts = [[1, 2, 3, 4]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = []
    for setting in (None, "awq_marlin"):
        with LLM(str(tmp_path / "int"), device="cpu", quantization=setting,
                 max_kv_tokens=256, show_progress=False) as llm:
            tokens.append([o.token_ids for o in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 4
    with pytest.raises(ValueError, match="'gptq' names a gptq checkpoint"):
        LLM(str(tmp_path / "int"), device="cpu", quantization="gptq", max_kv_tokens=256,
            show_progress=False)


def test_fp8_over_int_weights_is_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    _write(tiny_model("llama"), tmp_path / "int", tmp_path / "dense", "awq")
    with pytest.raises(ValueError, match="quantization 'fp8' over this checkpoint's AWQ"):
        LLM(str(tmp_path / "int"), device="cpu", quantization="fp8", max_kv_tokens=1024,
            show_progress=False)
