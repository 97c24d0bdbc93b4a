"""The Qwen family: Qwen2 (bias on Q, K, V only) and Qwen3 (per-head RMSNorm on Q and K)."""

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM, Traits


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
