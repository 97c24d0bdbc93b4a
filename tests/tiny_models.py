"""Random-weight tiny Hugging Face checkpoints of every supported family, built on demand."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1)

FAMILIES: Dict[str, dict] = {
    "llama": dict(arch="LlamaConfig", tie_word_embeddings=True),
    "llama3": dict(arch="LlamaConfig", tie_word_embeddings=False, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=64)),
    # YaRN as Qwen2.5 / Qwen3 documents it for long context (a pretraining length below the
    # prompts, so both the interpolated and the kept frequencies matter), and linear scaling.
    "qwen2_yarn": dict(arch="Qwen2Config", tie_word_embeddings=True,
                       rope_scaling=dict(rope_type="yarn", factor=4.0,
                                         original_max_position_embeddings=64)),
    "llama_linear": dict(arch="LlamaConfig", tie_word_embeddings=False,
                         rope_scaling=dict(type="linear", factor=2.0)),
    "mistral": dict(arch="MistralConfig", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(arch="Qwen2Config", tie_word_embeddings=True),
    "qwen3": dict(arch="Qwen3Config", tie_word_embeddings=False, head_dim=32),
    # Mixture-of-experts families: a dense layer between sparse ones (Qwen3-MoE: mlp_only_layers;
    # Qwen2-MoE, which has a shared expert: decoder_sparse_step).
    "qwen3_moe": dict(arch="Qwen3MoeConfig", tie_word_embeddings=False, head_dim=32,
                      num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(arch="Qwen2MoeConfig", tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=2,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(arch="MixtralConfig", tie_word_embeddings=False, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=48, sliding_window=None),
    # Phi-3 / Phi-4: checkpoints with fused qkv_proj and gate_up_proj tensors.
    "phi3": dict(arch="Phi3Config", tie_word_embeddings=False, sliding_window=None,
                 pad_token_id=0),
    # GLM-4-0414: sandwich norms, q/k/v biases, fused gate/up, rotary over half of each head
    # in GPT-J's interleaved layout
    # (norms random, so that each of the four must load where it belongs)
    "glm4": dict(arch="Glm4Config", tie_word_embeddings=False, head_dim=16, pad_token_id=0,
                 eos_token_id=2, random_norms=True),
    # GLM-4.5: a dense first layer, then sigmoid routing over 2 groups of 4 experts (one group
    # eligible), a shared expert, scaled weights; q/k biases, rotary over half of each head
    "glm4_moe": dict(arch="Glm4MoeConfig", tie_word_embeddings=False, head_dim=16,
                     num_hidden_layers=3, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                     partial_rotary_factor=0.5, attention_bias=True, random_norms=True),
    # dots.llm1: Qwen3's attention (q/k norms, biases on all four projections) with GLM-4.5's
    # routing; top-k weights not renormalized
    "dots1": dict(arch="Dots1Config", tie_word_embeddings=False, head_dim=16,
                  num_hidden_layers=3, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_group=2, topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=False,
                  attention_bias=True, random_norms=True),
    # IBM Granite 3.x: the Llama decoder with its four multipliers (mild ones: Granite-3-8B's
    # 12 / 0.22 on random tiny weights would make every token the same).
    "granite": dict(arch="GraniteConfig", tie_word_embeddings=True, embedding_multiplier=1.7,
                    residual_multiplier=0.6, attention_multiplier=0.3, logits_scaling=2.5),
    # SmolLM3: every fourth layer rotates nothing (NoPE); four layers, so one of them is.
    "smollm3": dict(arch="SmolLM3Config", tie_word_embeddings=True, num_hidden_layers=4,
                    pad_token_id=0),
    # Phi-3.5 / Phi-3-128K's longrope (a pretraining length of 32: prompts past it, and decodes
    # crossing it), and Phi-4-mini's partial rotary embedding (3/4 of each head) with it.
    "phi3_longrope": dict(arch="Phi3Config", tie_word_embeddings=False, sliding_window=None,
                          pad_token_id=0, original_max_position_embeddings=32,
                          rope_scaling=dict(rope_type="longrope",
                                            short_factor=[1.0 + 0.1 * i for i in range(8)],
                                            long_factor=[1.5 + 0.7 * i for i in range(8)])),
    "phi4_mini": dict(arch="Phi3Config", tie_word_embeddings=True, sliding_window=None,
                      pad_token_id=0, original_max_position_embeddings=32,
                      partial_rotary_factor=0.75,
                      rope_scaling=dict(rope_type="longrope",
                                        short_factor=[1.0 + 0.2 * i for i in range(6)],
                                        long_factor=[2.0 + 0.9 * i for i in range(6)])),
    # Gemma 3: sliding (8 tokens, rope theta 1e4), full (linear scaling), sliding layers;
    # an attention scale other than head_dim's; norms (1 + weight) random like the rest.
    "gemma3": dict(arch="Gemma3TextConfig", tie_word_embeddings=True, head_dim=32,
                   num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 1e4}},
                   random_norms=True),
    # Gemma 2: sliding (8 tokens), full, sliding layers; softcaps small enough to bite on
    # random weights
    "gemma2": dict(arch="Gemma2Config", tie_word_embeddings=True, head_dim=32,
                   num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, random_norms=True),
}


def save_randomized(model: torch.nn.Module, out: Path, random_norms: bool = False) -> None:
    """Save `model` with its weights drawn N(0, 0.1), larger than their default init so that
    logits are well separated (norm weights kept at one unless `random_norms`)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if random_norms or "norm" not in name:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():  # GLM-4.5's router correction is a buffer
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)


def build_tiny(family: str, out: Path, tokenizer_dir: Optional[Path], seed: int = 0,
               labels: Tuple[str, ...] = (), **overrides: object) -> Path:
    """Save a random tiny model of `family` into `out`, with the default model's tokenizer when
    `tokenizer_dir` is given (else token-id prompts only); with `labels`, the family's
    *ForSequenceClassification of those labels instead of its causal LM."""
    import transformers
    spec = dict(FAMILIES[family])
    config_cls = getattr(transformers, spec.pop("arch"))
    random_norms = spec.pop("random_norms", False)
    if labels:
        spec.update(id2label=dict(enumerate(labels)), pad_token_id=None)
    config = config_cls(**{**BASE, **spec, **overrides})
    torch.manual_seed(seed)
    auto = (transformers.AutoModelForSequenceClassification if labels
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(config, torch_dtype=torch.float32)
    save_randomized(model, out, random_norms)
    for f in tokenizer_dir.iterdir() if tokenizer_dir is not None else []:
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def build_tiny_gemma3_multimodal(out: Path, seed: int = 0) -> Path:
    """A random Gemma3ForConditionalGeneration: the "gemma3" family's text decoder beside a
    one-layer vision tower and projector (tensors under `language_model.model.*`,
    `vision_tower.*` and `multi_modal_projector.*`, as the published checkpoints name them)."""
    import transformers
    spec = dict(FAMILIES["gemma3"])
    spec.pop("arch"), spec.pop("random_norms")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(
        **{**BASE, **spec}), vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_mistral3_multimodal(out: Path, seed: int = 0, tied: bool = False) -> Path:
    """A random Mistral3ForConditionalGeneration (Mistral-Small-3.1's architecture): a Mistral
    text decoder beside a one-layer Pixtral vision tower and projector, saved as transformers
    saves it (`language_model.model.*`, `language_model.lm_head.*` unless `tied`,
    `vision_tower.*`)."""
    import transformers
    text = transformers.MistralConfig(**{**BASE, "sliding_window": None,
                                         "tie_word_embeddings": False})
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2,
                                              image_size=28, patch_size=14)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision,
                                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    save_randomized(transformers.Mistral3ForConditionalGeneration(config), out)
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_lora(base: Path, out: Path, seed: int, rank: int = 8, alpha: float = 16.0,
                    targets: Tuple[str, ...] = LORA_TARGETS, **config: object) -> Path:
    """A PEFT LoRA adapter of the model at `base` with random A and B (PEFT's own init makes
    B zero: a no-op adapter), saved as PEFT saves one (adapter_config.json,
    adapter_model.safetensors). `config`: more LoraConfig fields (use_rslora, ...)."""
    import peft
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                           init_lora_weights=False, **config)  # type: ignore[arg-type]
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    adapted.save_pretrained(out)
    return out


def write_lora(base: Path, out: Path, seed: int, rank: int = 8, alpha: float = 16.0,
               targets: Tuple[str, ...] = LORA_TARGETS) -> Path:
    """The files PEFT saves for a LoRA adapter of the `targets` projections (default: every
    one) of the Llama-shaped model at `base`, written without PEFT (the GPU machine has none;
    tests/test_lora.py checks that PEFT reads them alike): random A [rank, in] and B
    [out, rank] in float32."""
    import json
    from safetensors.torch import save_file
    cfg = json.loads((base / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (q, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    shapes = {m: s for m, s in shapes.items() if m.split(".")[-1] in targets}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": sorted({m.split(".")[-1] for m in shapes}),
        "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base)}))
    return out
