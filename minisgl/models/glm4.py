"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) as Glm4ForCausalLM serves it: the shared
decoder with Gemma's sandwich of norms (plain RMSNorm weights), q/k/v biases and none on o,
a fused gate/up projection in the checkpoint, and a rotary embedding over the first half of
each head in GPT-J's interleaved layout (ModelConfig.rotary_interleaved)."""

from types import MappingProxyType

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM, Traits


class Glm4ForCausalLM(CausalLM):
    """Its norms are named for where they sit: `post_self_attn_layernorm` normalizes the
    attention's output (our `post_attention_layernorm`), `post_attention_layernorm` opens the
    MLP (our `pre_feedforward_layernorm`), `post_mlp_layernorm` normalizes the MLP's output."""

    checkpoint_renames = MappingProxyType({
        "post_self_attn_layernorm": "post_attention_layernorm",
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "post_mlp_layernorm": "post_feedforward_layernorm"})
    checkpoint_fused = MappingProxyType({"gate_up_proj": ("gate_proj", "up_proj")})

    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.attention_bias, o_bias=False, qk_norm=False,
                      sandwich_norms=True)
