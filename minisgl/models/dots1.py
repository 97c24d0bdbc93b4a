"""dots.llm1 (Dots1ForCausalLM): Qwen3's attention (a per-head RMSNorm on q and k; biases on
the four projections where `attention_bias` says, and sliding-window layers where
`layer_types` or `max_window_layers` say) with DeepSeek-V3's mixture of experts, as GLM-4.5's:
sigmoid routing with a per-expert score correction over groups of experts, the routed
weights scaled, ungated shared experts, dense first layers (layers/moe.route_grouped)."""

from types import MappingProxyType

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM, Traits


class Dots1ForCausalLM(CausalLM):
    checkpoint_renames = MappingProxyType({"shared_experts": "shared_expert"})

    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
