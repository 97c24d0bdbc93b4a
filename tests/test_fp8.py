"""FP8 weights on the CPU (weight-only: dequantized at load): checkpoints in every format
minisgl reads give exactly the greedy tokens Hugging Face gives for their dequantized float32
twins, at tp=1 and tp=2; online `quantization="fp8"` quantizes each rank's shard and still
answers; bad configurations fail at start-up naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Dict, Tuple

import pytest
import torch

from fp8_checkpoints import Fp8Format, Group, Written, cached_writer, write_config, write_fp8
from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.distributed import Communicator, DistributedInfo
from minisgl.layers import fp8
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl.layers.weight_format import WeightFormat
from minisgl.models import ModelConfig, model_class
from minisgl.models.checkpoint_quant import CheckpointFp8, parse_quantization
from minisgl.models.quantization import quant_plan
from minisgl.models.weights import init_dummy, iter_checkpoint
from recording_source import RecordingSource, ValuesSource

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# 128 x 128 blocks need every projection's dims to be whole blocks at tp=1 and tp=2
BLOCK_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=128)

FORMATS: Dict[str, Fp8Format] = {
    # compressed-tensors, two groups: attention with per-tensor weight scales (0-d tensors) and
    # static activations, so that q/k/v each carry their own scale into the fused QKV; the MLPs
    # per channel ([out, 1]) with dynamic per-token activations (the "-FP8-dynamic" layout);
    # one projection left dense by a regular expression
    "ct-mixed": Fp8Format("compressed-tensors", (
        Group(r"re:.*self_attn\.[qkvo]_proj$", "tensor", True),
        Group(r"re:.*mlp\.(gate|up|down)_proj$", "channel", False)),
        ("model.layers.1.self_attn.o_proj",),
        ("lm_head", r"re:.*layers\.1\.self_attn\.o_proj$"), scale_shape="scalar"),
    # vLLM / AutoFP8's fp8: per-tensor [1] weight scales, static activations
    "fp8-tensor-static": Fp8Format("fp8", (Group("Linear", "tensor", True),), (), ()),
    # Hugging Face's block-wise fp8 (Qwen3's FP8 checkpoints), one MLP left dense
    "fp8-block": Fp8Format("fp8", (Group("Linear", "block", False),),
                           ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
                            "model.layers.1.mlp.down_proj"), ("model.layers.1.mlp",)),
}


@pytest.fixture(scope="module")
def written(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Callable[[str], Written]:
    def source(name: str) -> Tuple[Path, Fp8Format]:
        fmt = FORMATS[name]
        block = fmt.groups[0].weights == "block"
        return (tiny_model("qwen3", **BLOCK_SHAPE) if block else tiny_model("qwen3")), fmt

    return cached_writer(source, tmp_path_factory.mktemp)


def _generate(path: Path, tp: int, prompts: list) -> list:
    """Greedy tokens on the CPU in float32 (weight-only FP8: exact against HF's dequantized
    twin; on a GPU the projections would be W8A8)."""
    with LLM(str(path), tp=tp, page_size=4, max_kv_tokens=2048, show_progress=False,
             check_lockstep=tp > 1, device="cpu") as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("name", ["ct-mixed", "fp8-block"])
def test_fp8_checkpoint_matches_hf_on_its_dequantized_weights(
        written: Callable[[str], Written], name: str) -> None:
    """tp=1 and tp=2 (per-tensor and per-channel scales sliced with their rows; blocks with
    their blocks)."""
    ckpt = written(name)
    prompts = mixed_prompts(3, seed=3, lengths=(2, 9, 40))
    ref = hf_greedy(ckpt.dequantized, prompts, GREEDY.max_tokens)
    assert _generate(ckpt.fp8, 1, prompts) == ref
    assert _generate(ckpt.fp8, 2, prompts) == ref


PHI3_FORMATS: Dict[str, Fp8Format] = {
    # the fused tensors' per-channel scales split with their rows; an ignore list naming the
    # checkpoint's own fused layer (not q_proj: no such layer in a Phi-3 checkpoint)
    "ct-channel": Fp8Format("compressed-tensors", (Group("Linear", "channel", False),),
                            ("model.layers.1.self_attn.qkv_proj",),
                            ("lm_head", "model.layers.1.self_attn.qkv_proj")),
    "ct-tensor-static": Fp8Format("compressed-tensors", (Group("Linear", "tensor", True),), (),
                                  ("lm_head",)),
    # block scales: a row per 128 rows, split where every part is whole blocks
    "fp8-block": Fp8Format("fp8", (Group("Linear", "block", False),),
                           ("model.layers.1.mlp.gate_up_proj",),
                           ("model.layers.1.mlp.gate_up_proj",)),
}


@pytest.mark.parametrize("name", sorted(PHI3_FORMATS))
def test_phi3_fused_fp8_checkpoints_match_hf(tiny_model: Callable[..., Path],
                                             tmp_path: Path, name: str) -> None:
    """Phi-3's fused qkv_proj / gate_up_proj in FP8: scales per tensor, per channel and per
    block split with the parts' rows, and the quantization config's lists matched against the
    checkpoint's own (fused) layer names; tp=1 and tp=2 give HF's tokens on the dequantized
    twin."""
    fmt = PHI3_FORMATS[name]
    shape = BLOCK_SHAPE if name == "fp8-block" else {}
    ckpt = write_fp8(tiny_model("phi3", **shape), tmp_path / name, fmt)
    prompts = mixed_prompts(3, seed=5, lengths=(2, 9, 30))
    ref = hf_greedy(ckpt.dequantized, prompts, GREEDY.max_tokens)
    assert _generate(ckpt.fp8, 1, prompts) == ref
    assert _generate(ckpt.fp8, 2, prompts) == ref


def test_fp8_loading_keeps_scales_per_part_and_the_largest_input_scale(
        written: Callable[[str], Written]) -> None:
    """On a CUDA-like (not weight-only) plan the layers stay FP8: the fused QKV keeps q's, k's
    and v's own per-tensor scales on their rows, and the static activation scale is the
    largest of the three."""
    from safetensors import safe_open
    ckpt = written("fp8-tensor-static")
    cfg = ModelConfig.from_dir(ckpt.fp8)
    plan = quant_plan(cfg.quantization, None, torch.device("cpu"), torch.float32)
    assert plan is not None
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime,
                                                                 weight_only=False))
    info = DistributedInfo(0, 1)
    model = model_class(cfg.architecture)(cfg, info, Communicator(info), quant=plan)
    model.load_weights(iter_checkpoint(ckpt.fp8, False))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == fp8.FP8 and qkv.fp8 is not None
    with safe_open(str(ckpt.fp8 / "model.safetensors"), framework="pt") as h:
        scales = [h.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight_scale").item()
                  for p in "qkv"]
        inputs = [h.get_tensor(f"model.layers.0.self_attn.{p}_proj.input_scale").item()
                  for p in "qkv"]
    sizes = qkv.split_sizes
    got = qkv.weight_scale.split(sizes)
    for part, want in zip(got, scales):
        assert torch.all(part == torch.tensor(want, dtype=torch.float32))
    assert qkv.input_scale.item() == pytest.approx(max(inputs))


def test_online_fp8_quantizes_each_ranks_shard(tiny_model: Callable[..., Path]) -> None:
    """Every rank quantizes only the slices it reads, per output row of its own shard (the
    row-parallel layers' scales are over the rank's columns), and the weight-only CPU layers
    end up dense: each row an FP8 grid times its scale."""
    path = tiny_model("qwen3")
    cfg = ModelConfig.from_dir(path)
    plan = quant_plan(None, "fp8", torch.device("cpu"), torch.float32)
    full = {n: s.read() for n, s in iter_checkpoint(path, False)}
    for rank in range(2):
        info = DistributedInfo(rank, 2)
        model = model_class(cfg.architecture)(cfg, info, Communicator(info), quant=plan)
        reads: list = []
        model.load_weights((n, RecordingSource(s, reads)) for n, s in iter_checkpoint(path, False))
        for name, shape, got in reads:
            if len(shape) == 2 and "proj" in name:
                assert torch.Size(got).numel() * 2 == torch.Size(shape).numel(), name
        down = model.model.layers[0].mlp.down_proj
        assert down.fp8 is None and down.weight.dtype == torch.float32
        mine = full["model.layers.0.mlp.down_proj.weight"][:, rank * 64:(rank + 1) * 64]
        q, scale = fp8.quantize_rows(mine)
        assert torch.equal(down.weight, q.float() * scale[:, None])
        assert not torch.equal(down.weight, mine)


def test_online_fp8_default_model_answers_paris(default_model_dir: Path) -> None:
    with LLM(str(default_model_dir), quantization="fp8", max_kv_tokens=1024,
             show_progress=False) as llm:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=12, temperature=0.0))
    assert "Paris" in out[0].text, out[0].text


def test_fp8_accuracy_script_compares_distributions(tiny_model: Callable[..., Path]) -> None:
    from script_loader import load_script
    script = load_script("fp8_accuracy")
    path = str(tiny_model("qwen3"))
    ids = list(range(100, 140))
    cfg = script.EngineConfig(max_kv_tokens=128, max_running_requests=1, show_progress=False)
    ref = script.run_engine(cfg, path, ids)
    fp8_logits = script.run_engine(dataclasses.replace(cfg, quantization="fp8"), path, ids)
    assert ref.shape == (40, 49152)
    same = script.compare(ref, ref, ids)
    assert same["kl_max"] < 1e-6 and same["greedy_agreement"] == 1.0
    moved = script.compare(ref, fp8_logits, ids)
    assert 0 < moved["kl_mean"] < 0.5 and moved["positions"] == 39


def test_dummy_weights_with_online_fp8(tiny_model: Callable[..., Path]) -> None:
    cfg = ModelConfig.from_dir(tiny_model("qwen3"))
    info = DistributedInfo(0, 1)
    plan = quant_plan(None, "fp8", torch.device("cpu"), torch.float32)
    model = model_class(cfg.architecture)(cfg, info, Communicator(info), quant=plan)
    assert len(list(fp8.fp8_layers(model))) == 4 * cfg.num_layers
    init_dummy(model, seed=0)
    assert not list(fp8.fp8_layers(model))  # weight-only: all dequantized
    w = model.model.layers[0].mlp.gate_up_proj.weight
    assert w.dtype == torch.float32 and torch.isfinite(w).all() and 0.01 < w.std() < 0.03


def test_quantization_config_rules() -> None:
    """Which layers a config makes FP8, and how: groups by target (first match), ignore entries
    by name, module prefix or regular expression; compressed-tensors' block scheme."""
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
    dynamic = {"type": "float", "num_bits": 8, "dynamic": True, "strategy": "token"}
    q = parse_quantization({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "ignore": ["lm_head", r"re:.*\.0\.mlp\.down_proj$", "model.layers.3"],
        "config_groups": {
            "attn": {"targets": [r"re:.*self_attn\..*"],
                     "weights": {**weights, "strategy": "block", "block_structure": [128, 128]},
                     "input_activations": {**dynamic, "strategy": "group", "group_size": 128}},
            "rest": {"targets": ["Linear"], "weights": {**weights, "strategy": "channel"},
                     "input_activations": dynamic}}}})
    assert q is not None
    assert q.spec_for("model.layers.0.self_attn.q_proj") == CheckpointFp8(block=(128, 128))
    assert q.spec_for("model.layers.0.mlp.up_proj") == CheckpointFp8()
    assert q.spec_for("model.layers.0.mlp.down_proj") is None
    assert q.spec_for("model.layers.1.mlp.down_proj") == CheckpointFp8()
    assert q.spec_for("model.layers.3.self_attn.o_proj") is None
    assert q.spec_for("model.layers.31.self_attn.o_proj") is not None
    plan = quant_plan(q, None, torch.device("cpu"), torch.float32)
    assert plan is not None
    with pytest.raises(ValueError, match="quantizes gate_proj, up_proj differently"):
        dataclasses.replace(plan, checkpoint=dataclasses.replace(
            q, ignore=("model.layers.0.mlp.gate_proj",))).spec_for(
            "model.layers.0.mlp", ("gate_proj", "up_proj"))


# --- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("quantization,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}},
     "format 'marlin-24'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "type": "int", "num_bits": 8, "strategy": "channel"}}}}, "type 'int' with 8 bits"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}}}},
     "weight strategy 'group'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'dynamic' only"),
])
def test_unsupported_quantization_configs_fail_at_start_naming_them(
        tiny_model: Callable[..., Path], tmp_path: Path, quantization: dict, match: str) -> None:
    path = write_config(tmp_path, tiny_model("qwen3"), quantization)
    with pytest.raises(ValueError, match=match):
        parse_quantization({"quantization_config": quantization})
    with pytest.raises(ValueError, match=match):
        LLM(str(path), show_progress=False)


def test_unknown_quantization_setting_is_refused(tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny_model("qwen3")), quantization="int4", show_progress=False)


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100.*8\.0"):
        quant_plan(None, "fp8", torch.device("cuda", 0), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    plan = quant_plan(None, "fp8", torch.device("cuda", 0), torch.bfloat16)
    assert plan is not None and plan.runtime.gemm == "auto"  # Hopper: per shape
    assert not plan.runtime.weight_only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    plan = quant_plan(None, "fp8", torch.device("cuda", 0), torch.bfloat16)
    assert plan is not None and plan.runtime.gemm == "scaled_mm"


def test_static_input_scale_restarts_at_each_load() -> None:
    """A fused layer's static activation scale is the largest of its parts'; a load into
    the same tensors (a reload) starts it from zero again (fp8.start_loading), so it takes
    the new checkpoint's, not the larger of both."""
    layer = ColumnParallelLinear(32, [16, 16], False, DistributedInfo(0, 1),
                                 fmt=WeightFormat(fp8.Fp8Spec(static_input=True)))
    for shard, value in ((0, 2.0), (1, 3.0)):
        layer.load("input_scale", ValuesSource(value), shard)
    assert float(layer.input_scale) == 3.0
    fp8.start_loading(layer)
    assert float(layer.input_scale) == 0.0
    for shard, value in ((0, 0.5), (1, 0.25)):
        layer.load("input_scale", ValuesSource(value), shard)
    assert float(layer.input_scale) == 0.5


def test_block_split_across_ranks_is_refused_with_the_numbers() -> None:
    spec = WeightFormat(fp8.Fp8Spec(block=(128, 128)))
    with pytest.raises(ValueError, match=r"rows \[192, 384\) of 384 at tp=2.*128-row blocks"):
        ColumnParallelLinear(256, [384, 384], False, DistributedInfo(1, 2), fmt=spec)
    with pytest.raises(ValueError, match=r"input columns \[0, 192\) of 384 at tp=2"):
        RowParallelLinear(384, 256, False, DistributedInfo(0, 2),
                          Communicator(DistributedInfo(0, 2)), fmt=spec)
    ColumnParallelLinear(256, [512, 512], False, DistributedInfo(1, 2), fmt=spec)  # whole blocks
    with pytest.raises(ValueError, match=r"output part 0 gets rows \[0, 200\) of 200 at tp=1"):
        ColumnParallelLinear(256, [200, 200], False, DistributedInfo(0, 1), fmt=spec)


def test_fp8_tensors_of_a_layer_left_dense_are_refused(written: Callable[[str], Written],
                                                        tmp_path: Path) -> None:
    """A config that leaves a layer dense while the checkpoint holds it in FP8 would load
    wrong weights if the FP8 values were cast alone: refused, naming the tensor."""
    ckpt = written("ct-mixed")
    quantization = json.loads((ckpt.fp8 / "config.json").read_text())["quantization_config"]
    quantization["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    bad = write_config(tmp_path, ckpt.fp8, quantization, files=["model.safetensors"])
    cfg = ModelConfig.from_dir(bad)
    info = DistributedInfo(0, 1)
    model = model_class(cfg.architecture)(
        cfg, info, Communicator(info),
        quant=quant_plan(cfg.quantization, None, torch.device("cpu"), torch.float32))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*FP8"):
        model.load_weights(iter_checkpoint(bad, False))
