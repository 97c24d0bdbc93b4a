"""The context length and rope scaling read from config.json, as vLLM reads them: YaRN and
linear scaling stretch it, a sliding window does not cut it (the layers that slide, read as
transformers reads them, mask it), an unimplemented scaling is refused naming its type.
(Numerics of every scaling and window against Hugging Face: test_engine_hf.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig

QWEN3_8B = json.loads((Path(__file__).resolve().parent.parent / "configs" / "models" / "qwen3-8b"
                       / "config.json").read_text())


def _config(**changes: Any) -> ModelConfig:
    return ModelConfig.from_dict({**QWEN3_8B, **changes})


def test_yarn_stretches_the_context_as_qwen_documents() -> None:
    """Qwen3's model card: factor 4 over 32768 pretraining positions serves 131072."""
    cfg = _config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768})
    assert cfg.max_context == 131072 and cfg.max_position_embeddings == 40960
    assert _config().max_context == 40960


@pytest.mark.parametrize("changes,context", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 81920),  # the older key, `type`
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 0.5,
                                                "rope_theta": 1e6}}, 20480),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 81920),  # trained: max_position
    # a sliding window (here in layers 30-35) leaves the context whole: the layers mask it
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 30}, 40960),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, 40960),
])
def test_context_length(changes: Dict[str, Any], context: int) -> None:
    assert _config(**changes).max_context == context


@pytest.mark.parametrize("changes,windows", [
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 30},
     (0,) * 30 + (4096,) * 6),
    ({"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 30}, ()),
    # as transformers decides: Qwen slides only from layer max_window_layers on (36: none),
    # config.json's layer_types say it where given, Llama ignores the key
    ({"sliding_window": 4096, "use_sliding_window": True}, ()),
    ({"sliding_window": 4096, "use_sliding_window": True,
      "layer_types": ["full_attention"] * 35 + ["sliding_attention"]}, (0,) * 35 + (4096,)),
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 30,
      "layer_types": ["full_attention"] * 36}, ()),
    ({"sliding_window": 4096, "architectures": ["LlamaForCausalLM"]}, ()),
    ({"sliding_window": 2047, "architectures": ["Phi3ForCausalLM"]}, (2047,) * 36),
])
def test_layer_windows(changes: Dict[str, Any], windows: tuple) -> None:
    cfg = _config(**changes)
    assert cfg.layer_windows == windows
    assert cfg.sliding_window == (max(windows) if windows else None)


def test_a_layer_types_list_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="each of the 36 layers a window"):
        _config(sliding_window=4096, use_sliding_window=True,
                layer_types=["sliding_attention"] * 35)


@pytest.mark.parametrize("arch,fields", [
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, max_window_layers=3)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, max_window_layers=2)),
    ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, max_window_layers=4)),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True)),
    ("MistralForCausalLM", dict()),
    ("Phi3ForCausalLM", dict(sliding_window=64)),
])
def test_layer_windows_are_transformers_layers(arch: str, fields: Dict[str, Any]) -> None:
    """Each layer slides where the family's transformers attention module slides: its config's
    `layer_types` where it has them, else every layer."""
    import transformers
    raw = dict(architectures=[arch], vocab_size=64, hidden_size=64, intermediate_size=32,
               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
               **_MOE_FIELDS.get(arch, {}), **fields)
    hf = getattr(transformers, HF_CONFIGS[arch])(**raw)
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 6
    want = tuple(hf.sliding_window if t == "sliding_attention" and hf.sliding_window else 0
                 for t in types)
    assert ModelConfig.from_dict(raw).layer_windows == (want if any(want) else ())
    assert any(want)


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope scaling type 'dynamic'"),
    ({"type": "longrope", "factor": 2.0}, "longrope short_factor must list 64 factors"),
    ({"rope_type": "yarn", "factor": -1.0}, "rope scaling factor must be > 0"),
])
def test_unimplemented_or_bad_scaling_is_refused(scaling: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(rope_scaling=scaling)


def test_yarn_tables_carry_the_attention_factor() -> None:
    """cos and sin are scaled by 0.1 ln(factor) + 1 (both, so q.k gains its square), and the
    highest frequencies are kept as trained while the lowest are interpolated."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    plain = RotaryEmbedding(32, 128, 10000.0, None)
    yarn = RotaryEmbedding(32, 128, 10000.0, scaling)
    attention = 0.1 * torch.log(torch.tensor(4.0)).item() + 1
    assert torch.allclose(yarn.cos[0], torch.full((32,), attention))
    angle = torch.atan2(yarn.sin[1], yarn.cos[1])  # position 1: the inverse frequencies
    assert torch.allclose(angle[0], torch.atan2(plain.sin[1], plain.cos[1])[0])
    assert torch.allclose(angle[15], torch.atan2(plain.sin[1], plain.cos[1])[15] / 4)


# Each family's transformers config class; a hand-written config.json of the family: only the
# fields a model cannot do without, the others left to the family's defaults, plus every bias
# switch (the families whose Hugging Face layers read one get the bias, the others ignore it).
HF_CONFIGS = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
              "MixtralForCausalLM": "MixtralConfig", "Qwen2ForCausalLM": "Qwen2Config",
              "Qwen2MoeForCausalLM": "Qwen2MoeConfig", "Qwen3ForCausalLM": "Qwen3Config",
              "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "Phi3ForCausalLM": "Phi3Config",
              "Glm4MoeForCausalLM": "Glm4MoeConfig", "Dots1ForCausalLM": "Dots1Config"}
_MOE_FIELDS = {"MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
               "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16,
                                           shared_expert_intermediate_size=16),
               "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16),
               "Glm4MoeForCausalLM": dict(n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16),
               # (transformers' Dots1 needs n_shared_experts: its default None fails)
               "Dots1ForCausalLM": dict(n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, n_shared_experts=1),
               # not MoE: Phi3Config's default pad and EOS ids (32000) lie beyond this vocabulary
               "Phi3ForCausalLM": dict(pad_token_id=0, eos_token_id=2)}


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_a_minimal_config_reads_as_transformers_reads_it(arch: str, tmp_path: Path) -> None:
    """Absent fields take the family's transformers defaults (Mixtral's rope_theta 1e6 and
    eps 1e-5, Mistral's 4096 window, Qwen3's head_dim 128, the context lengths: before, the
    generic ones, wrong tokens or a failed load), and the bias switches count where the family's Hugging Face
    layers read them (Mistral/Mixtral/Qwen ignore mlp_bias, Qwen2-MoE's q/k/v bias is
    `qkv_bias`: before, a load missing biases): the checkpoint transformers saves for the
    config loads, every tensor in place with its shape."""
    import transformers

    from minisgl.distributed import Communicator, DistributedInfo
    from minisgl.models import model_class
    from minisgl.models.weights import iter_checkpoint
    raw = dict(architectures=[arch], vocab_size=64, hidden_size=64, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               attention_bias=True, mlp_bias=True, qkv_bias=False, **_MOE_FIELDS.get(arch, {}))
    hf_cfg = getattr(transformers, HF_CONFIGS[arch])(**raw)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))  # as written by hand
    cfg = ModelConfig.from_dir(tmp_path)
    hf_head_dim = getattr(hf_cfg, "head_dim", None) or 64 // 4
    # the window where a layer slides (dots.llm1's config keeps one that none of 2 layers uses)
    types = getattr(hf_cfg, "layer_types", None) or ["sliding_attention"]
    hf_window = (getattr(hf_cfg, "sliding_window", None) or None
                 if "sliding_attention" in types else None)
    assert (cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.sliding_window,
            cfg.max_position_embeddings) == (
        hf_head_dim, hf_cfg.rope_parameters["rope_theta"], hf_cfg.rms_norm_eps, hf_window,
        hf_cfg.max_position_embeddings)
    info = DistributedInfo(0, 1)
    model_class(arch)(cfg, info, Communicator(info)).load_weights(iter_checkpoint(tmp_path, False))


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_absent_kv_heads_and_shared_expert_take_the_familys_defaults(arch: str) -> None:
    """Without `num_key_value_heads` a family's transformers class has its own count (Qwen2's
    32, Qwen3-MoE's 4, Llama's the head count; before, always the head count), and Qwen2-MoE
    without `shared_expert_intermediate_size` has a shared expert of 5632 (before, none);
    GLM-4.5 without `n_shared_experts` has one."""
    import transformers
    raw = dict(architectures=[arch], vocab_size=64, hidden_size=1024, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=64, head_dim=16,
               **{k: v for k, v in _MOE_FIELDS.get(arch, {}).items()
                  if k != "shared_expert_intermediate_size"})
    hf_cfg = getattr(transformers, HF_CONFIGS[arch])(**raw)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_kv_heads == hf_cfg.num_key_value_heads
    # GLM-4.5's shared experts: n_shared_experts of the routed experts' width, one MLP
    glm_shared = getattr(hf_cfg, "n_shared_experts", 0) * getattr(hf_cfg,
                                                                  "moe_intermediate_size", 0)
    assert cfg.shared_expert_intermediate_size == getattr(
        hf_cfg, "shared_expert_intermediate_size", glm_shared)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_an_activation_the_mlps_lack_is_refused_naming_it(act: str) -> None:
    """The MLPs apply SiLU or GELU's tanh approximation (Gemma's): before, a checkpoint asking
    for another activation was served with SiLU, without a word."""
    with pytest.raises(ValueError, match=f"unsupported hidden_act '{act}'.*silu, swish, "
                                         f"gelu_pytorch_tanh"):
        _config(hidden_act=act)
    assert _config(hidden_act="swish").hidden_act == "swish"  # transformers' SiLU too


def test_llama3_scaling_without_its_pretraining_length_takes_max_positions() -> None:
    """Hugging Face's llama3 scaling defaults `original_max_position_embeddings` to
    max_position_embeddings; before, building the rotary tables raised a bare KeyError."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from minisgl.layers.rotary import rope_frequencies
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64,
               intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0})
    cfg = ModelConfig.from_dict(raw)
    ours = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                            cfg.max_position_embeddings)
    hf = LlamaRotaryEmbedding(transformers.LlamaConfig(**raw))
    assert torch.equal(ours.inv_freq, hf.inv_freq)


@pytest.mark.parametrize("changes,dims", [
    ({"partial_rotary_factor": 0.5}, 64),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                "partial_rotary_factor": 0.25}}, 32),
    ({"partial_rotary_factor": 1.0}, 128),
])
def test_a_partial_rotary_factor_turns_that_share_of_a_head(changes: Dict[str, Any],
                                                            dims: int) -> None:
    """Hugging Face's rope turns only that fraction of each head's dimensions (a top-level
    factor or one in rope_parameters); a share that is no even count is refused."""
    cfg = _config(**changes)
    assert cfg.rotary_dims == dims and cfg.head_dim == 128
    with pytest.raises(ValueError, match="an even count up to head_dim 128, got 3"):
        _config(partial_rotary_factor=3 / 128)


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_phi3_scalings_are_its_longrope(kind: str) -> None:
    """transformers' Phi3Config reads Phi-3's older "su" and "yarn" as "longrope" (the 128K
    variants', Phi-3.5's), with the top-level original_max_position_embeddings."""
    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=64, hidden_size=64,
               intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               original_max_position_embeddings=4096, max_position_embeddings=131072,
               rope_scaling={"type": kind, "long_factor": [1.0] * 8, "short_factor": [1.0] * 8,
                             "factor": 4.0})
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.long_rope_from == 4096 and cfg.max_context == 131072


# Gemma 3 4B's config.json as published: its text_config lists only what differs from
# Gemma3TextConfig's defaults (transformers 4 keys: rope_scaling, no layer_types).
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "eos_token_id": [1, 106], "mm_tokens_per_image": 256,
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                             "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "vision_config": {"model_type": "siglip_vision_model"}}


def test_gemma3_multimodal_config_reads_as_transformers_reads_it() -> None:
    """The decoder of Gemma 3 4B: transformers' defaults for what text_config leaves out, the
    five-sliding-one-full layers, the full layers' linearly scaled rope (1e6) and the sliding
    ones' own theta (1e4), the attention scale of query_pre_attn_scalar, GELU (tanh), and the
    context transformers serves (128K: the scaling is not applied again, as in vLLM)."""
    import transformers
    hf = transformers.Gemma3Config(text_config=GEMMA3_4B["text_config"]).text_config
    cfg = ModelConfig.from_dict(GEMMA3_4B)
    assert (cfg.architecture, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.num_layers, cfg.hidden_act, cfg.tie_word_embeddings) == (
        "Gemma3ForConditionalGeneration", hf.vocab_size, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, 34, hf.hidden_activation, True)
    assert cfg.layer_windows == tuple(1024 if t == "sliding_attention" else 0
                                      for t in hf.layer_types)
    assert cfg.layer_windows[:6] == (1024,) * 5 + (0,)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (
        full["rope_theta"], "linear", 8.0)
    assert cfg.local_rope_theta == local["rope_theta"] == 10000.0
    assert cfg.attention_scale == hf.query_pre_attn_scalar ** -0.5
    assert cfg.max_context == hf.max_position_embeddings == 131072
    assert cfg.eos_token_ids == (1, 106)


def test_gemma3_transformers5_keys_read_alike() -> None:
    """The same decoder as transformers 5 writes it (per-layer-type rope_parameters,
    layer_types) reads to the same config."""
    import transformers
    text = transformers.Gemma3TextConfig(**GEMMA3_4B["text_config"]).to_dict()
    written = {**GEMMA3_4B, "text_config": text}
    assert ModelConfig.from_dict(written) == ModelConfig.from_dict(GEMMA3_4B)


@pytest.mark.parametrize("change,match", [
    ({"use_bidirectional_attention": True}, "unsupported use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "unsupported hidden_act 'relu'"),
])
def test_gemma3_features_minisgl_lacks_are_refused(change: Dict[str, Any], match: str) -> None:
    raw = {**GEMMA3_4B, "text_config": {**GEMMA3_4B["text_config"], **change}}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_experts_refuse_an_activation_other_than_silu() -> None:
    with pytest.raises(ValueError, match="for experts: minisgl's experts apply SiLU"):
        _config(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, hidden_act="gelu_pytorch_tanh")


def test_gemma2_config_reads_as_transformers_reads_it() -> None:
    """Gemma 2 from a config.json listing only its shape: transformers' defaults for the rest,
    every other layer sliding, one rope for all, both softcaps."""
    import transformers
    raw = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584,
           "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
           "num_key_value_heads": 8}
    hf = transformers.Gemma2Config(**raw)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else 0
                                      for t in hf.layer_types)
    assert cfg.layer_windows[:2] == (4096, 0)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        hf.attn_logit_softcapping, hf.final_logit_softcapping) == (50.0, 30.0)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (
        hf.rope_parameters["rope_theta"], None, None)
    assert (cfg.vocab_size, cfg.head_dim, cfg.hidden_act, cfg.max_context) == (
        hf.vocab_size, hf.head_dim, hf.hidden_activation, hf.max_position_embeddings)
    assert cfg.attention_scale == hf.query_pre_attn_scalar ** -0.5


def test_hf_overrides_replace_config_keys() -> None:
    """vLLM's hf_overrides: keys that replace config.json's, a multimodal checkpoint's
    text_config's too; the setting must be a JSON object."""
    from minisgl.engine.config import EngineConfig
    cfg = _config(sliding_window=4096, use_sliding_window=False, max_window_layers=30)
    assert cfg.layer_windows == ()
    over = ModelConfig.from_dict({**QWEN3_8B, "sliding_window": 4096, "max_window_layers": 30},
                                 overrides={"use_sliding_window": True, "is_matryoshka": True})
    assert over.layer_windows == (0,) * 30 + (4096,) * 6 and over.matryoshka_dimensions == ()
    gemma = ModelConfig.from_dict(GEMMA3_4B, overrides={"sliding_window": 512})
    assert max(gemma.layer_windows) == 512
    assert EngineConfig(hf_overrides='{"a": 1}').hf_override_dict == {"a": 1}
    with pytest.raises(ValueError, match="hf_overrides is not JSON"):
        EngineConfig(hf_overrides="{a")
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig(hf_overrides="[1]")


@pytest.mark.parametrize("changes", [{}, {"use_sliding_window": True, "sliding_window": 64},
                                     {"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]},
                                     {"no_rope_layer_interval": 3}])
def test_smollm3_nope_layers_and_windows_are_read_as_transformers_derives_them(
        changes: Dict[str, Any]) -> None:
    """SmolLM3's config class derives `no_rope_layers` (every fourth layer rotates nothing) and
    `layer_types` (with use_sliding_window, the NoPE layers slide) where config.json lacks
    them: the same per-layer rope and windows as its model."""
    import transformers
    raw = dict(architectures=["SmolLM3ForCausalLM"], vocab_size=64, hidden_size=64,
               intermediate_size=32, num_hidden_layers=8, num_attention_heads=4, **changes)
    cfg = ModelConfig.from_dict(raw)
    hf = transformers.SmolLM3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert cfg.rope_layers == tuple(bool(f) for f in hf.no_rope_layers)
    windows = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert cfg.layer_windows == (windows if any(windows) else ())
    assert cfg.rope_theta == 2e6 and cfg.tie_word_embeddings
