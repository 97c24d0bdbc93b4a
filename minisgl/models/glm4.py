"""The GLM-4 family.

GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) as Glm4ForCausalLM serves it: the shared
decoder with Gemma's sandwich of norms (plain RMSNorm weights), q/k/v biases and none on o,
a fused gate/up projection in the checkpoint, and a rotary embedding over the first half of
each head in GPT-J's interleaved layout (ModelConfig.rotary_interleaved).

GLM-4.5 / 4.6 (Glm4MoeForCausalLM: GLM-4.5-Air, GLM-4.5, GLM-4.6) is the plain pre-norm
decoder instead, its rotary embedding over the first half of each head in the NeoX layout,
q/k/v biases, an optional per-head q/k norm (use_qk_norm), dense MLPs in the first
`first_k_dense_replace` layers and mixtures of experts after them: sigmoid routing with a
per-expert score correction over groups of experts (layers/moe.route_grouped) and an ungated
shared expert. Its checkpoints' multi-token-prediction layer (after the decoder's) is not
served: those tensors are skipped."""

from types import MappingProxyType
from typing import Optional

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


class Glm4MoeForCausalLM(CausalLM):
    checkpoint_renames = MappingProxyType({"shared_experts": "shared_expert"})

    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.attention_bias, o_bias=False, qk_norm=cfg.qk_norm)

    def _own_name(self, name: str) -> Optional[str]:
        """As CausalLM's, and None for the multi-token-prediction layers' tensors (the
        layers numbered from num_layers on)."""
        layers = self.cfg.num_layers
        if any(name.startswith(f"model.layers.{i}.")
               for i in range(layers, layers + self.cfg.mtp_layers)):
            return None
        return super()._own_name(name)
