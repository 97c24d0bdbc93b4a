"""The Qwen family: Qwen2 (bias on Q, K, V only; Qwen2-MoE's `qkv_bias` may turn it off) and
Qwen3 (per-head RMSNorm on Q and K), and their mixture-of-experts variants (Qwen2-MoE with its
shared expert, Qwen3-MoE), whose sparse layers the config names (ModelConfig.is_sparse)."""

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM, Traits


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.qkv_bias, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2's attention; MoE layers with a sigmoid-gated shared expert."""


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3's attention; MoE layers (no shared expert)."""
