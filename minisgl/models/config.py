"""The model shape, read from a Hugging Face config.json (and generation_config.json).

Mixture-of-experts shapes take the names of both families: Qwen2/Qwen3-MoE (`num_experts`,
`moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`, Qwen2-MoE's
`shared_expert_intermediate_size`) and Mixtral (`num_local_experts`, whose `intermediate_size`
is the expert's and whose top-k weights are always renormalized). A dense model has
num_experts 0. An FP8 checkpoint's `quantization_config` is read by models/checkpoint_quant.py,
an AWQ or GPTQ one's by models/int_quant.py (an unsupported one is refused here, naming it).

Fields are read as each family's Hugging Face model reads them: a field absent from config.json
takes that family's transformers default (`_FAMILY_DEFAULTS`), the bias fields count only for
the families whose layers have them (Mistral and Mixtral have no biases, only Llama has MLP
biases, Qwen2-MoE's q/k/v bias is its `qkv_bias`), and a `hidden_act` other than SiLU or GELU
(tanh) is refused. A `partial_rotary_factor` below 1 (Phi-4-mini) turns only the first
`rotary_dim` dimensions of each head; SmolLM3's `no_rope_layers` (every fourth layer by
default) turn none (`rope_layers`); GLM-4 turns neighbouring pairs (`rotary_interleaved`).
Granite's four multipliers (embeddings, sublayer outputs,
attention scores, logits) are read for Granite only.

Phi-3's "longrope" (the 128K variants, Phi-3.5, Phi-4-mini; older configs say "su" or "yarn")
rotates with `short_factor` frequencies while a sequence is at most
`original_max_position_embeddings` tokens long and with `long_factor` ones beyond, as
transformers decides per forward: a prompt longer than that rotates all its tokens with the
long factors, a shorter one its tokens from that length on (`long_rope_from`).

The context length (`max_context`) is vLLM's: `max_position_embeddings`, stretched by a "yarn"
(to `original_max_position_embeddings` x factor) or "linear" rope scaling (not Gemma 3's,
whose positions count the stretch already). A sliding window
does not cut it: the layers that slide (`layer_windows`, as the family's transformers model
decides) attend only to their window's last tokens, which the attention backends mask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from minisgl.distributed.info import check_head_split
from minisgl.models.checkpoint_quant import (CHECKPOINT_NAMES, ONLINE, QUANTIZATIONS,
                                             CheckpointQuant, parse_quantization)
from minisgl.models.classifier import (CLASSIFIER_BASES, Classifier, parse_classifier,
                                       with_token_ids)
from minisgl.models.int_quant import IntQuant, parse_int_quant

# The rope scalings layers/rotary.py implements.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# The MLP activations the layers implement (transformers' names for SiLU, and Gemma's GELU
# with the tanh approximation); experts apply SiLU only.
SILU_ACTS = ("silu", "swish")
HIDDEN_ACTS = (*SILU_ACTS, "gelu_pytorch_tanh")

# transformers' defaults for the fields a family's config class sets otherwise than the generic
# defaults of `ModelConfig.from_dict` (save_pretrained writes them all, a hand-written config.json
# may not): Mistral's window, Mixtral's theta and eps, Qwen3's head_dim, Qwen's window switch,
# the context lengths, the KV head counts (Llama's: the head count), Qwen2-MoE's shared expert.
_QWEN = {"max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096}
_GEMMA3 = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
           "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
           "rope_theta": 1e6, "rope_local_base_freq": 10000.0}
_GEMMA2 = {**_GEMMA3, "vocab_size": 256000, "max_position_embeddings": 8192,
           "rope_theta": 10000.0, "sliding_window_pattern": 2,
           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Multimodal checkpoints served as their text decoder, and the family that decoder is
# (Gemma 3's is read by `_gemma`)
_TEXT_FAMILY = {"Mistral3ForConditionalGeneration": "MistralForCausalLM"}
GEMMA = ("Gemma2ForCausalLM", *GEMMA3)
# EAGLE-3 draft heads (EAGLE's own checkpoints and SpecForge's name; vLLM's): one Llama layer
# over the target's hidden states (models/eagle3.py), read as Llama's fields
EAGLE3 = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_FAMILY_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "MistralForCausalLM": {"max_position_embeddings": 131072, "sliding_window": 4096,
                           "num_key_value_heads": 8},
    "MixtralForCausalLM": {"max_position_embeddings": 131072, "rope_theta": 1e6,
                           "rms_norm_eps": 1e-5, "num_key_value_heads": 8},
    "Qwen2ForCausalLM": {**_QWEN, "num_key_value_heads": 32},
    "Qwen2MoeForCausalLM": {**_QWEN, "num_key_value_heads": 16,
                            "shared_expert_intermediate_size": 5632},
    "Qwen3ForCausalLM": {**_QWEN, "head_dim": 128, "num_key_value_heads": 32},
    "Qwen3MoeForCausalLM": {**_QWEN, "num_key_value_heads": 4},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "vocab_size": 32064},
    "Glm4ForCausalLM": {"max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-7,
                        "vocab_size": 151552, "num_key_value_heads": 2, "head_dim": 128,
                        "attention_bias": True, "partial_rotary_factor": 0.5,
                        "eos_token_id": [151329, 151336, 151338]},
    # Glm4MoeConfig's (GLM-4.5-Air's shape; a config.json lists its own)
    "Glm4MoeForCausalLM": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                           "vocab_size": 151552, "num_key_value_heads": 8,
                           "partial_rotary_factor": 0.5, "n_routed_experts": 128,
                           "n_shared_experts": 1, "num_experts_per_tok": 8,
                           "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                           "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
                           "topk_group": 1},
    # Dots1Config's (dots.llm1's shape)
    "Dots1ForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                         "vocab_size": 152064, "num_key_value_heads": 32,
                         "moe_intermediate_size": 1408, "first_k_dense_replace": 0,
                         "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 1,
                         "topk_group": 1, "n_shared_experts": 0, "sliding_window": 4096,
                         "max_window_layers": 62},
    "SmolLM3ForCausalLM": {"max_position_embeddings": 32768, "rope_theta": 2e6,
                           "vocab_size": 128256, "num_key_value_heads": 4,
                           "tie_word_embeddings": True, "use_sliding_window": False},
    # Gemma3TextConfig's: a multimodal checkpoint's text_config lists few fields
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
}
# The families whose MoE routes by DeepSeek-V3's sigmoid scheme (`_sigmoid_moe_fields`)
SIGMOID_MOE = ("Glm4MoeForCausalLM", "Dots1ForCausalLM")
# The families whose attention projections take `attention_bias` (Qwen2's are fixed: q/k/v
# bias, none on o; Mistral's and Mixtral's have none), and whose MLP takes `mlp_bias`.
_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                   "SmolLM3ForCausalLM", "GraniteForCausalLM", "Glm4ForCausalLM",
                   "Glm4MoeForCausalLM", "Dots1ForCausalLM")
_MLP_BIAS = ("LlamaForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM")
# The families whose attention may slide (see `_layer_windows`).
_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
             "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
             "SmolLM3ForCausalLM", "Dots1ForCausalLM", *GEMMA)
# The families whose config class lists `layer_types` (the others slide in every layer), and
# those whose `use_sliding_window` switches the window on (the others ignore the key).
_LAYER_TYPED = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                "SmolLM3ForCausalLM", "Dots1ForCausalLM", *GEMMA)
_SWITCHED = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "SmolLM3ForCausalLM")

@dataclass(frozen=True)
class Eagle3Shape:
    """What an EAGLE-3 head takes beyond its Llama layer: it scores `draft_vocab` tokens (its
    d2t tensor maps them to the target's), and reads the target's hidden states at the input
    of layers `aux_layers` (() : the target's default three, engine/eagle.py), each of
    `target_hidden` features, through its `fc`. `shares_embeddings`: its checkpoint has no
    embeddings, so it embeds with the target's (the engine sets it: config.json does not say)."""

    draft_vocab: int
    aux_layers: Tuple[int, ...]
    target_hidden: int
    shares_embeddings: bool = False

    @property
    def features(self) -> int:
        """How many of the target's hidden states `fc` fuses."""
        return len(self.aux_layers) or 3


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k, v and o (families that read it; see from_dict)
    mlp_bias: bool  # bias on the dense MLP's projections (Llama only)
    eos_token_ids: Tuple[int, ...]
    torch_dtype: Optional[str]
    num_experts: int = 0  # routed experts of a sparse layer; 0: a dense model
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # of one routed expert
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every step-th layer is sparse (see `is_sparse`)
    mlp_only_layers: Tuple[int, ...] = ()  # layers that stay dense
    shared_expert_intermediate_size: int = 0  # the shared expert; 0: none
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on it (GLM-4.5's has none)
    # How the router scores the experts: "softmax" (Qwen, Mixtral) or "sigmoid" (GLM-4.5,
    # DeepSeek-V3's: sigmoid scores, a learned per-expert bias added only to choose, the
    # experts in `moe_groups` groups of which the best `moe_topk_groups` (by their two best
    # scores) are eligible, the chosen scores renormalized where norm_topk_prob and then
    # multiplied by routed_scaling_factor)
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    qk_norm: bool = False  # a per-head RMSNorm on q and k (GLM-4.5's use_qk_norm)
    # Multi-token-prediction layers a checkpoint holds after the decoder's (GLM-4.5's
    # num_nextn_predict_layers), which are not served: their tensors are skipped.
    mtp_layers: int = 0
    quantization: Optional[CheckpointQuant] = None  # the checkpoint's FP8 layout; None: dense
    int_quant: Optional[IntQuant] = None  # its AWQ / GPTQ integer weights (int_quant.py)
    # Per decoder layer: the tokens its attention sees (its own and those before it, as
    # transformers' `kv_idx > q_idx - window`), 0: the whole context; () where none slides.
    layer_windows: Tuple[int, ...] = ()
    qkv_bias: bool = True  # Qwen2's q/k/v bias (always on; Qwen2-MoE's `qkv_bias`)
    hidden_act: str = "silu"  # the MLP's activation: one of HIDDEN_ACTS
    # Gemma 3: the attention's scores are scaled by query_pre_attn_scalar ** -0.5 (None:
    # head_dim's), and its sliding-window layers rotate with this theta, unscaled (None: every
    # layer rotates with rope_theta and rope_scaling).
    query_pre_attn_scalar: Optional[float] = None
    local_rope_theta: Optional[float] = None
    # Gemma's tanh softcapping: scores s -> cap * tanh(s / cap) before the softmax, and the
    # logits alike (None: none)
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # Matryoshka embeddings (vLLM's `is_matryoshka` / `matryoshka_dimensions`): the lengths an
    # embedding may be cut to (then normalized again); () any, None: not a Matryoshka model.
    matryoshka_dimensions: Optional[Tuple[int, ...]] = None
    # The dimensions of a head the rotary embedding turns (the first ones; 0: all of them)
    rotary_dim: int = 0
    # The rotary embedding turns neighbouring pairs of dimensions (GLM-4's GPT-J layout), not
    # the two halves (the NeoX layout everyone else uses)
    rotary_interleaved: bool = False
    # Per decoder layer: whether it rotates q and k at all (SmolLM3's NoPE layers do not);
    # () where every layer does.
    rope_layers: Tuple[bool, ...] = ()
    # Granite's multipliers: of the embeddings, of each sublayer's output before it joins the
    # residual stream, of the attention's scores (instead of head_dim ** -0.5; None: that),
    # and the divisor of the logits.
    embedding_multiplier: Optional[float] = None
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0
    # A sequence classification head (models/classifier.py; None: a causal LM)
    classifier: Optional[Classifier] = None
    # An EAGLE-3 draft head's shape (models/eagle3.py; None: not one)
    eagle: Optional[Eagle3Shape] = None

    def __post_init__(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: "
                             f"{', '.join(HIDDEN_ACTS)})")
        if self.num_experts and self.hidden_act not in SILU_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} for experts: "
                             f"minisgl's experts apply SiLU")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]"
                             f", got {self.num_experts_per_tok}")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1 with {self.num_experts} "
                             f"experts, got {self.moe_intermediate_size}")
        if self.rope_layers and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"no_rope_layers must give each of the {self.num_layers} layers a "
                             f"flag, got {len(self.rope_layers)}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers
                                   or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows must give each of the {self.num_layers} layers a "
                             f"window >= 0, got {self.layer_windows}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        self._check_router()
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: "
                             f"{', '.join(ROPE_TYPES)})")
        if kind in ("linear", "yarn") and (self.rope_scaling or {}).get("factor", 1) <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.rope_scaling}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"the rotary dimensions must be an even count up to head_dim "
                             f"{self.head_dim}, got {self.rotary_dim} (partial_rotary_factor)")
        if kind == "longrope":
            self._check_longrope(self.rope_scaling or {})

    def _check_longrope(self, s: Dict[str, Any]) -> None:
        half = self.rotary_dims // 2
        for name in ("short_factor", "long_factor"):
            factors = s.get(name)
            if not isinstance(factors, list) or len(factors) != half:
                raise ValueError(f"longrope {name} must list {half} factors (one per rotary "
                                 f"frequency), got {factors!r:.80}")
        if not isinstance(s.get("original_max_position_embeddings"), int):
            raise ValueError("longrope needs original_max_position_embeddings (the pretraining "
                             "length where the long factors take over)")

    def reload_error(self, other: "ModelConfig") -> Optional[str]:
        """Why the weights of a checkpoint whose config is `other` cannot replace this model's
        in place: the first field that differs, with both values (the model would compute
        otherwise, or its tensors have other shapes); None where they can. torch_dtype may
        differ: weights are cast to the served dtype as they load."""
        for f in fields(self):
            ours, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name != "torch_dtype" and ours != theirs:
                return (f"the checkpoint's {f.name} is {theirs!r:.80}; the served model's is "
                        f"{ours!r:.80}")
        return None

    def check_quantization(self, setting: Optional[str]) -> None:
        """ValueError where the `quantization` setting cannot apply to this checkpoint: one
        it does not know; FP8 over AWQ / GPTQ integer weights (it would quantize their
        dequantized values again); a checkpoint method's name (vLLM's: awq, gptq_marlin, ...)
        that is not this checkpoint's, per its config.json."""
        if setting is None:
            return
        if setting not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{setting!r}")
        if setting == ONLINE:
            if self.int_quant is not None:
                raise ValueError(f"quantization {setting!r} over this checkpoint's "
                                 f"{self.int_quant.describe()} weights is not supported: "
                                 f"serve it as it is (no --quantization)")
            return
        method = (self.int_quant.method if self.int_quant is not None else
                  self.quantization.method if self.quantization is not None else None)
        if CHECKPOINT_NAMES[setting] != method:
            what = (f"its quant_method is {method!r}" if method is not None
                    else "it has no quantization_config (its weights are not quantized)")
            raise ValueError(f"quantization {setting!r} names a {CHECKPOINT_NAMES[setting]} "
                             f"checkpoint, but {what}: leave --quantization unset to serve "
                             f"the checkpoint as it is, or give {ONLINE} to quantize "
                             f"16-bit weights as they load")

    @property
    def rotary_dims(self) -> int:
        """The dimensions of a head the rotary embedding turns (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def long_rope_from(self) -> int:
        """Longrope's pretraining length k: a sequence longer than k rotates with the long
        factors (see the module's docstring); 0 without longrope."""
        s = self.rope_scaling or {}
        return int(s["original_max_position_embeddings"]) if s.get("rope_type") == "longrope" \
            else 0

    @property
    def max_context(self) -> int:
        """The longest sequence served (see the module's docstring)."""
        scaling = self.rope_scaling or {}
        length = self.max_position_embeddings
        if self.architecture in GEMMA3:  # its max_position_embeddings are the scaled ones
            return length
        if scaling.get("rope_type") == "yarn" and scaling.get("factor"):
            trained = scaling.get("original_max_position_embeddings") or length
            length = max(length, int(trained * scaling["factor"]))
        elif scaling.get("rope_type") == "linear":
            length = int(length * scaling["factor"])
        return length

    @property
    def lm_head_rows(self) -> int:
        """The tokens the LM head scores: an EAGLE-3 head's draft vocabulary, else all."""
        return self.eagle.draft_vocab if self.eagle is not None else self.vocab_size

    @property
    def attention_scale(self) -> float:
        """What the attention multiplies q.k by."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_window(self) -> Optional[int]:
        """The window of the layers that slide; None where every layer sees the whole
        context."""
        return max(self.layer_windows, default=0) or None

    def _check_router(self) -> None:
        """ValueError naming the numbers for a router that cannot choose: groups that do not
        divide the experts, more eligible groups than groups, or fewer eligible experts than
        the top-k."""
        if self.moe_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring {self.moe_scoring!r}")
        if not self.num_experts or self.moe_scoring == "softmax":
            return
        groups, eligible = self.moe_groups, self.moe_topk_groups
        if groups < 1 or self.num_experts % groups or not 1 <= eligible <= groups:
            raise ValueError(f"n_group {groups} must divide the {self.num_experts} routed "
                             f"experts, and topk_group {eligible} be in [1, n_group]")
        per_group = self.num_experts // groups
        if per_group < 2 or eligible * per_group < self.num_experts_per_tok:
            raise ValueError(f"topk_group {eligible} of {groups} groups of {per_group} experts "
                             f"leave fewer than num_experts_per_tok {self.num_experts_per_tok} "
                             f"to choose from (a group is scored by its two best experts)")

    def check_tp(self, tp: int, expert_parallel: bool = False) -> None:
        """ValueError naming the numbers when the model cannot be split over `tp` ranks: its
        heads (distributed.info.check_head_split), and the MLP widths its layers use, which
        the column-parallel projections split evenly; with `expert_parallel`, its routed
        experts instead of their widths (each rank holds 1/tp of them whole)."""
        check_head_split(self.num_heads, self.num_kv_heads, tp)
        if expert_parallel and self.num_experts % tp:
            raise ValueError(f"cannot hold 1/{tp} of {self.num_experts} routed experts on each "
                             f"rank (expert parallelism): tp must divide the experts")
        routed = self.moe_intermediate_size if self.num_experts and not expert_parallel else 0
        widths = {"moe_intermediate_size": routed,
                  "shared_expert_intermediate_size": self.shared_expert_intermediate_size}
        if not all(self.is_sparse(i) for i in range(self.num_layers)):
            widths["intermediate_size"] = self.intermediate_size
        for name, width in widths.items():
            if width and width % tp:
                raise ValueError(f"cannot split the MLP's {name} {width} over tp={tp}: tp "
                                 f"must divide it")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) routes its tokens to experts instead of the
        dense MLP: as Hugging Face's Qwen-MoE decoders decide."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any], generation: Optional[Dict[str, Any]] = None,
                  overrides: Optional[Dict[str, Any]] = None) -> "ModelConfig":
        """The model of config.json `cfg` (and generation_config.json `generation`), as its
        family's Hugging Face model reads it (see the module's docstring). A rope_theta inside
        `rope_parameters` wins over a top-level one, as transformers 5 merges them.
        `overrides`: vLLM's hf_overrides, config.json keys that replace the file's (a
        multimodal checkpoint's text_config's too)."""
        if overrides:
            cfg = {**cfg, **overrides}
            if isinstance(cfg.get("text_config"), dict):
                cfg["text_config"] = {**cfg["text_config"], **overrides}
        declared = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        # the family a decoder's fields follow
        arch = _TEXT_FAMILY.get(declared) or CLASSIFIER_BASES.get(declared) or declared
        arch = "LlamaForCausalLM" if arch in EAGLE3 else arch
        if declared in _TEXT_FAMILY:
            cfg = _text_decoder(cfg)
        cfg = {**_FAMILY_DEFAULTS.get(arch, {}), **cfg}
        if arch in GEMMA:
            cfg = _gemma(cfg, arch)
        if arch == "SmolLM3ForCausalLM":
            cfg = _smollm3(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}
        partial = (cfg.get("rope_scaling") or rope).get("partial_rotary_factor",
                                                         cfg.get("partial_rotary_factor"))
        scaling = _rope_scaling(cfg.get("rope_scaling") or rope, arch)
        if scaling is not None and scaling["rope_type"] == "longrope":
            original = scaling.get("original_max_position_embeddings",
                                   cfg.get("original_max_position_embeddings"))
            scaling = {**scaling, "original_max_position_embeddings": original}
        return cls(
            architecture=declared,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            rotary_dim=0 if partial in (None, 1) else int(head_dim * partial),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch in _ATTENTION_BIAS and bool(cfg.get("attention_bias", False)),
            mlp_bias=arch in _MLP_BIAS and bool(cfg.get("mlp_bias", False)),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM" else True,
            hidden_act=cfg.get("hidden_act") or "silu",
            eos_token_ids=_eos_ids(cfg, generation or {}),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            quantization=parse_quantization(cfg),
            int_quant=parse_int_quant(cfg.get("quantization_config") or {}),
            layer_windows=_layer_windows(cfg, arch),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            local_rope_theta=cfg.get("local_rope_theta"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            matryoshka_dimensions=_matryoshka(cfg),
            rope_layers=(tuple(bool(f) for f in cfg["no_rope_layers"])
                         if arch == "SmolLM3ForCausalLM" else ()),
            rotary_interleaved=arch == "Glm4ForCausalLM",
            qk_norm=arch == "Glm4MoeForCausalLM" and bool(cfg.get("use_qk_norm", False)),
            **_granite_fields(cfg, arch),
            **_moe_fields(cfg, arch),
            classifier=parse_classifier(cfg, declared),
            eagle=_eagle3_shape(cfg) if declared in EAGLE3 else None,
        )

    @classmethod
    def from_dir(cls, path: Path, overrides: Optional[Dict[str, Any]] = None) -> "ModelConfig":
        """The model of directory `path` (its config.json and generation_config.json);
        `overrides` as for `from_dict`."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        cfg = json.loads(config_file.read_text())
        gen_file = config_file.parent / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        try:
            model = cls.from_dict(cfg, gen, overrides)
        except KeyError as e:  # a bare KeyError says only the key
            raise ValueError(f"{config_file} has no {e.args[0]!r}, which a model's config "
                             f"needs") from None
        if model.classifier is None:
            return model
        return replace(model, classifier=with_token_ids(model.classifier, config_file.parent))


def _matryoshka(cfg: Dict[str, Any]) -> Optional[Tuple[int, ...]]:
    """The embedding lengths a Matryoshka model allows, as vLLM reads them: the listed
    `matryoshka_dimensions`, () for any with `is_matryoshka`, else None."""
    dims = cfg.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if cfg.get("is_matryoshka") else None


def _layer_windows(cfg: Dict[str, Any], arch: str) -> Tuple[int, ...]:
    """Each layer's sliding window (0: none) as the family's transformers model decides: none
    unless `use_sliding_window` where the family's config reads it; config.json's
    `layer_types` where the family's config reads them; else Qwen2/Qwen3 slide
    from layer `max_window_layers` on, Qwen2-MoE in its even layers below it, the other
    windowed families in every layer; Llama ignores the key. () where no layer slides."""
    window = cfg.get("sliding_window")
    if not window or arch not in _WINDOWED or (arch in _SWITCHED
                                               and not cfg.get("use_sliding_window")):
        return ()
    layers = range(cfg["num_hidden_layers"])
    bound = cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") if arch in _LAYER_TYPED else None
    if types is not None:
        slides = [t == "sliding_attention" for t in types]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Dots1ForCausalLM"):
        slides = [i >= bound for i in layers]
    elif arch == "Qwen2MoeForCausalLM":
        slides = [i % 2 == 0 and i < bound for i in layers]
    else:
        slides = [True for _ in layers]
    return tuple(int(window) if s else 0 for s in slides) if any(slides) else ()


def _text_decoder(cfg: Dict[str, Any],
                  kept: Tuple[str, ...] = ("eos_token_id", "quantization_config",
                                           "tie_word_embeddings")) -> Dict[str, Any]:
    """A multimodal checkpoint's config.json as its text decoder's: `text_config` over the
    top level, whose `kept` keys win (by default its quantization config, an explicit eos,
    and whether the LM head is the embeddings: transformers ties the whole model's by its
    top-level flag)."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    for key in kept:
        if key in cfg:
            text[key] = cfg[key]
    return text


def _eagle3_shape(cfg: Dict[str, Any]) -> Eagle3Shape:
    """An EAGLE-3 head's config.json fields: `draft_vocab_size` (default: the vocabulary),
    `eagle_aux_hidden_state_layer_ids` (top level, or in `eagle_config`, as vLLM reads them;
    default: none given, the target's (2, L // 2, L - 3)), `target_hidden_size` (default: the
    head's own hidden size)."""
    nested: Dict[str, Any] = cfg.get("eagle_config") or {}
    if not isinstance(nested, dict):
        nested = {}
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or nested.get(
        "eagle_aux_hidden_state_layer_ids") or ()
    return Eagle3Shape(int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                       tuple(int(i) for i in layers),
                       int(cfg.get("target_hidden_size") or cfg["hidden_size"]))


def _granite_fields(cfg: Dict[str, Any], arch: str) -> Dict[str, Any]:
    """Granite's multipliers (its config class's defaults: 1) where the family reads them."""
    if arch != "GraniteForCausalLM":
        return {}
    return dict(embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))


def _smollm3(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """SmolLM3's config.json with what its config class derives: `no_rope_layers` (1: the
    layer rotates; default every `no_rope_layer_interval`-th layer, 4th, does not) and
    `layer_types` (with `use_sliding_window`, the layers without rope slide)."""
    layers = cfg["num_hidden_layers"]
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    window = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    types = cfg.get("layer_types") or ["sliding_attention" if window and not r else
                                       "full_attention" for r in rope[:layers]]
    return {**cfg, "no_rope_layers": list(rope[:layers]), "layer_types": types}


def _gemma(cfg: Dict[str, Any], arch: str) -> Dict[str, Any]:
    """Gemma 2's and 3's config.json in the keys `from_dict` reads: a multimodal checkpoint's
    decoder fields come from its `text_config` (the vision tower is not served);
    `hidden_activation` is the MLP's activation; `layer_types` default to every
    `sliding_window_pattern`-th layer full (Gemma 2: every second, Gemma 3: every sixth), the
    others sliding. Gemma 3's full layers' rope (`rope_theta`, `rope_scaling`) and sliding
    ones' (`rope_local_base_freq`) are read from transformers 5's per-layer-type
    `rope_parameters` where given; Gemma 2's one rope is every layer's. Bidirectional
    attention is refused."""
    # a multimodal checkpoint's own eos, not its decoder config's default
    text = _text_decoder(cfg, ("eos_token_id",))
    if text.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention: minisgl's attention is "
                         "causal")
    layers = text["num_hidden_layers"]
    pattern = int(text.get("sliding_window_pattern") or 6)
    types = text.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    text = {**text, "hidden_act": text["hidden_activation"], "layer_types": types}
    if arch not in GEMMA3:
        return text
    per_type = text.get("rope_parameters") or {}
    if "full_attention" in per_type:
        full = per_type["full_attention"]
        local = per_type.get("sliding_attention") or {}
    else:
        full = {"rope_theta": text["rope_theta"], **(text.get("rope_scaling") or {})}
        local = {"rope_theta": text["rope_local_base_freq"]}
    if _rope_scaling(local) is not None:
        raise ValueError(f"unsupported rope scaling of the sliding-window layers: {local}")
    return {**text, "rope_parameters": {"rope_theta": 1e6, **full}, "rope_scaling": None,
            "local_rope_theta": float(local.get("rope_theta", 10000.0))}


def _rope_scaling(raw: Dict[str, Any], arch: str = "") -> Optional[Dict[str, Any]]:
    """The scaling with its type under `rope_type` (older configs say `type`), None without
    one (Hugging Face 5's `rope_parameters` hold the theta of an unscaled rope too). Phi-3's
    older "su" and "yarn" are its "longrope", as transformers' Phi3Config reads them."""
    kind = raw.get("rope_type", raw.get("type", "default"))
    if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):
        kind = "longrope"
    return None if kind == "default" else {**raw, "rope_type": kind}


def _sigmoid_moe_fields(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The mixture-of-experts fields of DeepSeek-V3's scheme (GLM-4.5, dots.llm1):
    `n_routed_experts`, the first `first_k_dense_replace` layers dense, `n_shared_experts`
    ungated shared experts (one MLP of their summed width), sigmoid routing over `n_group`
    groups (ModelConfig.moe_scoring)."""
    return dict(
        num_experts=int(cfg["n_routed_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        mlp_only_layers=tuple(range(int(cfg["first_k_dense_replace"]))),
        shared_expert_intermediate_size=int(cfg["moe_intermediate_size"])
        * int(cfg["n_shared_experts"] or 0),
        shared_expert_gated=False, moe_scoring="sigmoid", moe_groups=int(cfg["n_group"]),
        moe_topk_groups=int(cfg["topk_group"]),
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def _moe_fields(cfg: Dict[str, Any], arch: str) -> Dict[str, Any]:
    """The mixture-of-experts fields of a config.json, under either family's names (none for a
    dense model). Mixtral always renormalizes its top-k weights and has no dense layers."""
    if arch in SIGMOID_MOE:
        return _sigmoid_moe_fields(cfg)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if not experts:
        return {}
    mixtral = arch == "MixtralForCausalLM"
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def _eos_ids(cfg: Dict[str, Any], gen: Dict[str, Any]) -> Tuple[int, ...]:
    ids = []
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)
